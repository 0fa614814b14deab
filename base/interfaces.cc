#include "base/interfaces.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "base/strings.h"

namespace launch {
namespace {

// `sa` as numeric text ("" for other families). IPv4-mapped IPv6 addresses as IPv4, so that a
// dual-stack socket's view and getifaddrs' agree.
std::string NumericAddress(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    if (!inet_ntop(AF_INET, &in->sin_addr, text, sizeof text)) return "";
    return text;
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    if (IN6_IS_ADDR_V4MAPPED(&in6->sin6_addr)) {
      in_addr v4;
      std::memcpy(&v4, in6->sin6_addr.s6_addr + 12, sizeof v4);
      if (!inet_ntop(AF_INET, &v4, text, sizeof text)) return "";
      return text;
    }
    if (!inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text)) return "";
    return text;
  }
  return "";
}

// `address` in NumericAddress's canonical form, or "" when it is not a numeric address.
std::string Canonical(std::string_view address) {
  const std::string text(address);
  sockaddr_in v4{};
  if (inet_pton(AF_INET, text.c_str(), &v4.sin_addr) == 1) {
    v4.sin_family = AF_INET;
    return NumericAddress(reinterpret_cast<const sockaddr*>(&v4));
  }
  sockaddr_in6 v6{};
  if (inet_pton(AF_INET6, text.c_str(), &v6.sin6_addr) == 1) {
    v6.sin6_family = AF_INET6;
    return NumericAddress(reinterpret_cast<const sockaddr*>(&v6));
  }
  return "";
}

}  // namespace

std::vector<InterfaceAddress> ListInterfaceAddresses() {
  std::vector<InterfaceAddress> out;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return out;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr) continue;
    std::string address = NumericAddress(i->ifa_addr);
    if (!address.empty()) out.push_back({i->ifa_name, std::move(address)});
  }
  ::freeifaddrs(list);
  return out;
}

std::string InterfaceHolding(const std::vector<InterfaceAddress>& interfaces,
                             std::string_view address) {
  const std::string wanted = Canonical(address);
  if (wanted.empty()) return "";
  for (const InterfaceAddress& i : interfaces)
    if (Canonical(i.address) == wanted) return i.name;
  return "";
}

std::string AddressOf(const std::vector<InterfaceAddress>& interfaces, std::string_view name) {
  for (const InterfaceAddress& i : interfaces)
    if (i.name == name) return i.address;
  return "";
}

bool HasInterface(const std::vector<InterfaceAddress>& interfaces, std::string_view name) {
  return std::any_of(interfaces.begin(), interfaces.end(),
                     [&](const InterfaceAddress& i) { return i.name == name; });
}

std::string InterfaceNames(const std::vector<InterfaceAddress>& interfaces) {
  std::vector<std::string> names;
  for (const InterfaceAddress& i : interfaces)
    if (std::find(names.begin(), names.end(), i.name) == names.end()) names.push_back(i.name);
  return names.empty() ? "none" : Join(names, ", ");
}

StatusOr<Route> RouteTo(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  // Any port: connect() on a UDP socket only looks up the route.
  const int rc = ::getaddrinfo(host.c_str(), "9", &hints, &res);
  if (rc != 0 || res == nullptr)
    return Status::NotFound("cannot resolve '" + host + "': " + ::gai_strerror(rc));
  Status failed = Status::Ok();
  std::optional<Route> route;
  for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      failed = Status::FromErrno("socket for a route to " + host, errno);
      continue;
    }
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
      failed = Status::FromErrno("no route to " + host, errno);
    } else if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      failed = Status::FromErrno("getsockname of a route to " + host, errno);
    } else {
      Route r;
      r.address = NumericAddress(reinterpret_cast<const sockaddr*>(&local));
      r.interface = InterfaceHolding(ListInterfaceAddresses(), r.address);
      route = std::move(r);
    }
    ::close(fd);
    if (route) break;
  }
  ::freeaddrinfo(res);
  if (!route) return failed;
  return *route;
}

std::vector<std::string> ResolveHost(const std::string& name) {
  std::vector<std::string> out;
  if (name.empty()) return out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(name.c_str(), nullptr, &hints, &res) != 0) return out;
  for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
    std::string text = NumericAddress(a->ai_addr);
    if (!text.empty() && std::find(out.begin(), out.end(), text) == out.end())
      out.push_back(std::move(text));
  }
  ::freeaddrinfo(res);
  return out;
}

std::string Hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "";
  return buf;
}

bool HostnameBindsLoopback(const std::vector<std::string>& addresses) {
  return addresses.empty() || IsLoopbackHost(addresses.front());
}

}  // namespace launch
