#pragma once

// This host's network interfaces, and which of them reaches a given peer: what a job's workers
// must bind for their collectives when the job spans hosts.
//
// Why it matters: Gloo (and PyTorch's default device for it) binds the address this host's own
// name resolves to, falling back to loopback when it resolves to nothing; stock hosts map their
// name to 127.0.1.1 (Debian's installer) or not at all, so every peer on another host is told to
// connect to a loopback address and is refused. The address the kernel would send from to reach
// MASTER_ADDR is the one the other hosts can reach (they reached MASTER_ADDR's host through the
// same network), and the interface holding it is what GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
// name.
//
// The pure functions take the interface list as data, so their rules are tested without a
// network; ListInterfaceAddresses, RouteTo and ResolveHost ask the kernel and the resolver.
// Thread-safe: no state.

#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace launch {

struct InterfaceAddress {
  std::string name;     // "eth0"
  std::string address;  // numeric: "10.0.0.2", "fe80::1" (no zone)
};

// This host's interfaces that have an IPv4 or IPv6 address (getifaddrs), one entry per
// address, in the kernel's order; empty when getifaddrs fails.
std::vector<InterfaceAddress> ListInterfaceAddresses();

// The name of the interface in `interfaces` that holds `address` (compared as addresses: an
// IPv4-mapped IPv6 address matches its IPv4 form), or "" when none does or `address` is not a
// numeric address. Pure.
std::string InterfaceHolding(const std::vector<InterfaceAddress>& interfaces,
                             std::string_view address);

// The first address of the interface called `name` in `interfaces` (the one Gloo binds for
// GLOO_SOCKET_IFNAME), or "" when there is none. Pure.
std::string AddressOf(const std::vector<InterfaceAddress>& interfaces, std::string_view name);

// Whether an interface called `name` is in `interfaces`. Pure.
bool HasInterface(const std::vector<InterfaceAddress>& interfaces, std::string_view name);

// The interfaces' names, each once, in order ("lo, eth0"), or "none": for messages. Pure.
std::string InterfaceNames(const std::vector<InterfaceAddress>& interfaces);

// Where this host sends from to reach a peer.
struct Route {
  std::string address;    // the local address, numeric
  std::string interface;  // the interface holding it; "" when none was found (a race with
                          // an address being removed)
};

// The local address the kernel picks to reach `host` (a name, resolved here, or a numeric
// address; its first address when a name), and the interface holding it: the local end of a UDP
// socket connected to it (connect() on UDP only looks up the route; nothing is sent). Errors
// name `host`: NotFound when it resolves to nothing, IoError when there is no route to it.
StatusOr<Route> RouteTo(const std::string& host);

// The addresses `name` resolves to (getaddrinfo, numeric, each once, in the resolver's order,
// the order in which Gloo and PyTorch try them); empty when it resolves to nothing.
std::vector<std::string> ResolveHost(const std::string& name);

// This host's name (gethostname), or "" when it has none.
std::string Hostname();

// Whether a host whose own name resolves to `addresses` (ResolveHost(Hostname())) makes
// PyTorch's default Gloo device bind loopback: it resolves to nothing, or its first address is
// a loopback one (127.0.1.1 from Debian's /etc/hosts). Pure.
bool HostnameBindsLoopback(const std::vector<std::string>& addresses);

}  // namespace launch
