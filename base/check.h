#pragma once

// LAUNCH_CHECK: for broken invariants only (never for bad input or outside failures,
// which are Status). Throws launch::CheckError carrying file:line, like GLOO_ENFORCE.

#include <stdexcept>
#include <string>

namespace launch {

class CheckError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

[[noreturn]] void CheckFailed(const char* file, int line, const char* condition,
                              const std::string& message);

}  // namespace launch

#define LAUNCH_CHECK(cond, ...)                                                              \
  do {                                                                                       \
    if (!(cond)) ::launch::CheckFailed(__FILE__, __LINE__, #cond, std::string(__VA_ARGS__)); \
  } while (0)
