#pragma once

// The network interface a multi-host job's workers are told to use: GLOO_SOCKET_IFNAME and
// NCCL_SOCKET_IFNAME, for programs that do not pick one themselves (PyTorch's Gloo binds the
// address this host's own name resolves to, falling back to loopback, and NCCL's bootstrap does
// likewise when that name resolves to nothing useful).
//
// On a stock host that name resolves to 127.0.1.1 (Debian's installer) or to nothing, and every
// peer on another host is told to connect to a loopback address. The agent knows better: the
// interface that reaches MASTER_ADDR is the one the other hosts reach. It exports the variables
// only then, only those the user left unset (a user's setting always wins), and says why.

#include <map>
#include <string>
#include <vector>

#include "base/interfaces.h"

namespace launch::agent {

// What the agent knows when a round is assigned.
struct SocketInterfaceFacts {
  int num_nodes = 1;
  std::string master_addr;                      // the round's MASTER_ADDR
  std::string hostname;                         // this host's name (Hostname())
  std::vector<std::string> hostname_addresses;  // what it resolves to (ResolveHost)
  Route route;                                  // RouteTo(master_addr); interface "" when unknown
  std::string route_error;                      // why RouteTo failed; "" when it did not
  // The workers' environment before this decision (inherited plus the launcher's additions).
  std::map<std::string, std::string> worker_env;
};

struct SocketInterfaceExport {
  std::map<std::string, std::string> env;  // to add to every worker's; empty = nothing
  // One line for the log saying what was set and why (or, with `env` empty, why the workers may
  // bind loopback); "" = nothing to say.
  std::string message;
};

// The decision (pure): nothing for a single node, a loopback MASTER_ADDR (every node on this
// host), a host name that resolves first to a routable address (PyTorch's default is right), or
// both variables set by the user; otherwise the interface of `route` for each variable the user
// did not set. No interface found (route_error, or an address no interface holds): nothing set,
// and a message saying what to set by hand.
SocketInterfaceExport ChooseSocketInterfaces(const SocketInterfaceFacts& facts);

// The facts for a round with `num_nodes` nodes and `master_addr`, asked of this host (the
// resolver and the kernel's routing table), with the workers' `worker_env`.
SocketInterfaceFacts ProbeSocketInterfaceFacts(int num_nodes, const std::string& master_addr,
                                               std::map<std::string, std::string> worker_env);

}  // namespace launch::agent
