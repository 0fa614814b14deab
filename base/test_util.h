#pragma once

// Helpers the doctest binaries share (test-only, header-only: include it from *_test.cc files
// only).

#include <doctest/doctest.h>
#include <stdlib.h>

#include <string>
#include <string_view>

namespace launch::testing {

// A new folder /tmp/<name>-XXXXXX (mkdtemp: a fresh name, mode 0700); the test fails without.
inline std::string MakeTempDir(const std::string& name) {
  std::string path = "/tmp/" + name + "-XXXXXX";
  REQUIRE(::mkdtemp(path.data()) != nullptr);
  return path;
}

inline bool Contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

}  // namespace launch::testing
