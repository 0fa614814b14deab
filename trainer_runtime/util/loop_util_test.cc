// Unit tests for loop_util.h (plain C++: this binary links no LibTorch).

#include "trainer_runtime/util/loop_util.h"

#include <stdlib.h>
#include <unistd.h>

#include <string>

#include <doctest/doctest.h>

#include "base/files.h"

namespace launch::trainer {
namespace {

TEST_CASE("MetricsHistoryUpToKeepsParsedLinesUpToTheStep") {
  char tmpl[] = "/tmp/loop-util-test-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string path = std::string(tmpl) + "/metrics.jsonl";
  // Compact lines as the trainer writes them, a line with spaces as older versions wrote them,
  // a string holding the text "step", a redone step and a line a crash cut short.
  const std::string one = R"({"step":1,"loss":0.5,"note":"\"step\": 9"})";
  const std::string two = R"({"step": 2, "loss": 0.25})";
  REQUIRE(WriteFileAtomically(path, one + "\n" + two + "\n" + R"({"step":3,"loss":0.125})" + "\n" +
                                        R"({"note":"no step"})" + "\n" + R"({"step":2,"lo)")
              .ok());
  CHECK(MetricsHistoryUpTo(path, 2) == one + "\n" + two + "\n");
  CHECK(MetricsHistoryUpTo(path, 0) == "");
  CHECK(MetricsHistoryUpTo(path + ".missing", 2) == "");
  ::unlink(path.c_str());
  ::rmdir(tmpl);
}

}  // namespace
}  // namespace launch::trainer
