#pragma once

#include <string>

#include "base/status.h"

namespace launch::agent {

// A free TCP port on `host` for the workers' store: one below the kernel's ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range), which no outgoing connection on the machine can be
// given before rank 0 binds it (torchrun's bind-to-port-0 pick can be, and then the store fails
// with "Address already in use"); the kernel's choice when none is free there. A process that
// binds the same port on purpose in between can still take it.
StatusOr<int> PickFreePort(const std::string& host);

}  // namespace launch::agent
