#pragma once

#include <string>

#include "base/status.h"

namespace launch::agent {

// Asks the kernel for a free TCP port on `host` (bind to port 0, read it back, close). Another
// process may take it before the workers bind it; the same trade-off torchrun makes.
StatusOr<int> PickFreePort(const std::string& host);

}  // namespace launch::agent
