#pragma once

// How config values are written back as text (--print_config, run identity, the key table's
// Show functions): one spelling per kind, so the same value always prints the same way.
// Internal to config/.

#include <sstream>
#include <string>
#include <vector>

#include "config/launch_config.h"

namespace launch::config {

std::string Num(double v);                        // shortest round form: 0.001, 600, 1e-08
std::string Bool(bool v);                         // true | false
std::string StreamSpecText(const StreamSpec& s);  // 3 | 0:1,1:3

template <typename T>
std::string ListText(const std::vector<T>& v) {  // [a, b, c]
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

}  // namespace launch::config
