// main() of every add_doctest binary: doctest's own, plus the skip protocol of base/test_skip.h.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/test_skip.h"

namespace launch::testing {
namespace {

constexpr int kSkipReturnCode = 77;  // cmake/testing.cmake's LAUNCH_SKIP_RETURN_CODE

struct Skip {
  const char* kind;  // "setup" or "env", as tests/run_unittest.py writes them
  std::string test_case;
  std::string reason;
};

// Test cases run one at a time on the main thread (REQUIRES of test_skip.h): no lock.
std::vector<Skip>& Skips() {
  static std::vector<Skip> skips;
  return skips;
}
std::string& CurrentTestCase() {
  static std::string name;
  return name;
}

// Knows which test case is running, so a skip is charged to it.
struct CurrentTestCaseListener : doctest::IReporter {
  explicit CurrentTestCaseListener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData& data) override {
    CurrentTestCase() = data.m_name;
  }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("launch_current_test_case", 1, CurrentTestCaseListener);

void Record(const char* kind, std::string_view reason) {
  std::string flat(reason);
  for (char& c : flat) {
    if (c == '\t' || c == '\n') c = ' ';  // one line, three tab-separated fields
  }
  Skips().push_back({kind, CurrentTestCase(), std::move(flat)});
}

// Lists the skips on stdout and in $LAUNCH_SKIP_FILE (when CTest set it); returns the exit code.
int FinishSkips(const char* argv0) {
  const char* path = std::getenv("LAUNCH_SKIP_FILE");
  if (Skips().empty()) return 0;
  std::printf("%s: %zu test case(s) skipped:\n", argv0, Skips().size());
  std::FILE* file = path != nullptr && *path != '\0' ? std::fopen(path, "w") : nullptr;
  if (path != nullptr && *path != '\0' && file == nullptr) {
    std::perror(path);
    return 1;  // a skip that cannot be reported must not pass for one
  }
  for (const Skip& skip : Skips()) {
    std::printf("  [%s] %s: %s\n", skip.kind, skip.test_case.c_str(), skip.reason.c_str());
    if (file != nullptr) {
      std::fprintf(file, "%s\t%s\t%s\n", skip.kind, skip.test_case.c_str(), skip.reason.c_str());
    }
  }
  if (file != nullptr && std::fclose(file) != 0) {
    std::perror(path);
    return 1;
  }
  return kSkipReturnCode;
}

}  // namespace

void SkipNeedsSetup(std::string_view what) { Record("setup", what); }
void SkipEnvDependent(std::string_view why) { Record("env", why); }

}  // namespace launch::testing

int main(int argc, char** argv) {
  // A skip file left by an earlier run must not outlive this one.
  if (const char* path = std::getenv("LAUNCH_SKIP_FILE")) std::remove(path);
  doctest::Context context(argc, argv);
  const int rc = context.run();
  if (context.shouldExit() || rc != 0) return rc;
  return launch::testing::FinishSkips(argv[0]);
}
