#include "base/strings.h"

#include <csignal>

#include <doctest/doctest.h>

namespace launch {
namespace {

TEST_CASE("WrapTextBreaksAtSpacesWithinTheWidthAndKeepsNewlines") {
  CHECK(WrapText("aa bb cc", 5) == std::vector<std::string>{"aa bb", "cc"});
  CHECK(WrapText("aa bb cc", 8) == std::vector<std::string>{"aa bb cc"});
  CHECK(WrapText("averylongword x", 4) == std::vector<std::string>{"averylongword", "x"});
  CHECK(WrapText("a\nb c", 10) == std::vector<std::string>{"a", "b c"});
  CHECK(WrapText("a  b", 10) == std::vector<std::string>{"a b"});
  CHECK(WrapText("", 10) == std::vector<std::string>{""});
}

TEST_CASE("SplitKeepsEmptyFields") {
  CHECK(Split("a,,b", ',') == std::vector<std::string>{"a", "", "b"});
  CHECK(Split("", ',') == std::vector<std::string>{""});
}

TEST_CASE("ClosestMatchSuggestsNearMisses") {
  std::vector<std::string> keys = {"nproc_per_node", "num_processes", "num_machines",
                                   "max_restarts"};
  CHECK(ClosestMatch("nprocs", keys) == "nproc_per_node");
  CHECK(ClosestMatch("num_proceses", keys) == "num_processes");
  CHECK(ClosestMatch("max_restart", keys) == "max_restarts");
  CHECK(ClosestMatch("zzz", keys).empty());
}

TEST_CASE("StrictNumberParsing") {
  long long i = 0;
  CHECK(ParseInt64(" 42 ", &i));
  CHECK(i == 42);
  CHECK_FALSE(ParseInt64("4x", &i));
  CHECK_FALSE(ParseInt64("", &i));
  double d = 0;
  CHECK(ParseDouble("3e-4", &d));
  CHECK(d == doctest::Approx(3e-4));
  CHECK_FALSE(ParseDouble("abc", &d));
}

TEST_CASE("SignalNames") {
  CHECK(SignalName(SIGSEGV) == "SIGSEGV");
  CHECK(SignalName(SIGKILL) == "SIGKILL");
}

}  // namespace
}  // namespace launch

TEST_CASE("LoopbackHosts") {
  CHECK(launch::IsLoopbackHost("localhost"));
  CHECK(launch::IsLoopbackHost("127.0.0.1"));
  CHECK(launch::IsLoopbackHost("127.0.0.3"));
  CHECK(launch::IsLoopbackHost("::1"));
  CHECK(launch::IsLoopbackHost("::ffff:127.0.0.2"));
  CHECK_FALSE(launch::IsLoopbackHost("10.0.0.1"));
  CHECK_FALSE(launch::IsLoopbackHost("127.example.com"));  // a name, not resolved
  CHECK_FALSE(launch::IsLoopbackHost("::ffff:10.0.0.1"));
  CHECK_FALSE(launch::IsLoopbackHost(""));
}
