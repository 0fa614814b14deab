#pragma once

// Skips inside doctest unit tests that CTest reports as skipped, never as passed. The protocol
// is cmake/testing.cmake's (shared with the Python tests, tests/harness.py): a test case that
// cannot run records why and returns; when the binary ends with no failure and at least one
// skip, base/doctest_main.cc lists the skips, writes them to $LAUNCH_SKIP_FILE and exits 77
// (CTest's SKIP_RETURN_CODE). scripts/test fails on a NeedsSetup skip.
//
//   if (!Exists(kFashionMnistDir)) {
//     launch::testing::SkipNeedsSetup("/usr/share/... not installed (dataset-fashion-mnist)");
//     return;
//   }
//
// REQUIRES: called from a test case's own thread, while it runs (the skip is charged to it).
// Only test binaries made by add_doctest define these (in base/doctest_main.cc).

#include <string_view>

namespace launch::testing {

// Something scripts/setup builds or installs (a binary, a package, a data set) is missing.
void SkipNeedsSetup(std::string_view what);

// This machine cannot run the test whatever is installed (no GPU, no CAP_NET_ADMIN...).
void SkipEnvDependent(std::string_view why);

}  // namespace launch::testing
