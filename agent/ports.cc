#include "agent/ports.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "base/files.h"
#include "base/strings.h"

namespace launch::agent {
namespace {

// The kernel's range for outgoing connections' local ports. A port from it can be handed to
// any connect() on the machine between our check and the workers' bind; one below it cannot.
std::pair<int, int> EphemeralRange() {
  std::vector<std::string> parts =
      Split(Trim(ReadSmallFile("/proc/sys/net/ipv4/ip_local_port_range", 64)), '\t');
  long long lo = 0, hi = 0;
  if (parts.size() == 2 && ParseInt64(Trim(parts[0]), &lo) && ParseInt64(Trim(parts[1]), &hi))
    return {static_cast<int>(lo), static_cast<int>(hi)};
  return {32768, 60999};
}

// Binds `port` (0: any) on `ai`; the port bound, or -1.
int TryBind(const addrinfo* ai, int port, int* err) {
  int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
  if (ss.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port = htons(static_cast<uint16_t>(port));
  } else {
    reinterpret_cast<sockaddr_in*>(&ss)->sin_port = htons(static_cast<uint16_t>(port));
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&ss), ai->ai_addrlen) != 0) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  socklen_t len = sizeof(ss);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  ::close(fd);
  return ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                  : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

}  // namespace

StatusOr<int> PickFreePort(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), "0", &hints, &res);
  if (rc != 0) return Status::NotFound("cannot resolve '" + host + "': " + gai_strerror(rc));
  const auto [lo, hi] = EphemeralRange();
  const int first = 20000, last = lo > first + 1000 ? lo - 1 : 0;
  std::mt19937 rng{std::random_device{}()};
  int err = 0;
  // A free port below the ephemeral range (a bounded number of tries), else any the kernel
  // gives (then only the usual race with other processes remains).
  for (int attempt = 0; last > 0 && attempt < 200; ++attempt) {
    const int port = std::uniform_int_distribution<int>(first, last)(rng);
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      if (TryBind(ai, port, &err) == port) {
        freeaddrinfo(res);
        return port;
      }
      if (err != EAFNOSUPPORT) break;  // in use (or refused): another port
    }
  }
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    int port = TryBind(ai, 0, &err);
    if (port > 0) {
      freeaddrinfo(res);
      return port;
    }
  }
  freeaddrinfo(res);
  return Status::FromErrno("cannot bind to " + host, err);
}

}  // namespace launch::agent
