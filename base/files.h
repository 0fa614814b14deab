#pragma once

#include <string>

#include "base/status.h"

namespace launch {

// mkdir -p: creates `path` and its missing parents (0755). IoError names the folder that
// could not be created.
Status MakeDirs(const std::string& path);

}  // namespace launch
