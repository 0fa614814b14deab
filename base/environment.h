#pragma once

// The process environment as a map. Code that reads the environment takes such a map as a
// parameter (tests pass their own); only entry points call CurrentEnvironment().

#include <map>
#include <string>

namespace launch {

// Every NAME=VALUE of this process's environment (entries without '=' are skipped).
std::map<std::string, std::string> CurrentEnvironment();

}  // namespace launch
