#include "agent/socket_interfaces.h"

#include "base/strings.h"

namespace launch::agent {

namespace {

constexpr const char* kVariables[] = {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"};

bool IsSet(const std::map<std::string, std::string>& env, const std::string& key) {
  auto it = env.find(key);
  return it != env.end() && !it->second.empty();
}

// "resolves to 127.0.1.1 (loopback)" / "resolves to nothing".
std::string Resolution(const SocketInterfaceFacts& f) {
  const std::string name =
      f.hostname.empty() ? "this host's name" : "this host's name " + f.hostname;
  if (f.hostname_addresses.empty()) return name + " resolves to nothing";
  return name + " resolves to " + f.hostname_addresses.front() + " (loopback)";
}

}  // namespace

SocketInterfaceExport ChooseSocketInterfaces(const SocketInterfaceFacts& f) {
  SocketInterfaceExport out;
  if (f.num_nodes <= 1 || IsLoopbackHost(f.master_addr)) return out;
  if (!HostnameBindsLoopback(f.hostname_addresses)) return out;
  std::vector<std::string> unset;
  for (const char* key : kVariables)
    if (!IsSet(f.worker_env, key)) unset.push_back(key);
  if (unset.empty()) return out;
  const std::string why = Resolution(f) +
                          ", where PyTorch's Gloo would listen, out of the other "
                          "hosts' reach";
  if (f.route.interface.empty() || IsLoopbackHost(f.route.address)) {
    const std::string found = !f.route_error.empty()
                                  ? f.route_error
                                  : "the route to MASTER_ADDR " + f.master_addr + " leaves from " +
                                        (f.route.address.empty() ? "no address" : f.route.address) +
                                        ", which no interface holds";
    out.message = why + "; cannot tell which interface reaches the other hosts (" + found +
                  "): set " + Join(unset, " and ") + " to it on every host";
    return out;
  }
  std::vector<std::string> assignments;
  for (const std::string& key : unset) {
    out.env[key] = f.route.interface;
    assignments.push_back(key + "=" + f.route.interface);
  }
  out.message = "workers get " + Join(assignments, " ") + ": " + why + "; " + f.route.interface +
                " (" + f.route.address + ") is the route to MASTER_ADDR " + f.master_addr +
                " (set them yourself to choose another)";
  return out;
}

SocketInterfaceFacts ProbeSocketInterfaceFacts(int num_nodes, const std::string& master_addr,
                                               std::map<std::string, std::string> worker_env) {
  SocketInterfaceFacts f;
  f.num_nodes = num_nodes;
  f.master_addr = master_addr;
  f.worker_env = std::move(worker_env);
  // Only where the decision can need them: a single-node job asks no resolver.
  if (num_nodes <= 1 || IsLoopbackHost(master_addr)) return f;
  f.hostname = Hostname();
  f.hostname_addresses = ResolveHost(f.hostname);
  StatusOr<Route> route = RouteTo(master_addr);
  if (route.ok())
    f.route = *route;
  else
    f.route_error = route.status().message();
  return f;
}

}  // namespace launch::agent
