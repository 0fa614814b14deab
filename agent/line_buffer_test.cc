#include "agent/line_buffer.h"

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

TEST_CASE("OnlyWholeLinesLeaveTheBuffer") {
  LineBuffer b;
  std::string out;
  b.Feed("hel", "[r0]: ", &out);
  CHECK(out.empty());
  b.Feed("lo\nwor", "[r0]: ", &out);
  CHECK(out == "[r0]: hello\n");
  b.Feed("ld\n\nx", "[r0]: ", &out);
  CHECK(out == "[r0]: hello\n[r0]: world\n[r0]: \n");
  b.Flush("[r0]: ", &out);
  CHECK(out == "[r0]: hello\n[r0]: world\n[r0]: \n[r0]: x\n");
  CHECK(b.empty());
}

TEST_CASE("CarriageReturnRedrawsLeaveAtOnceAndCrLfIsOneLineEnd") {
  LineBuffer b;
  std::string out;
  b.Feed("\r 10%", "[r0]: ", &out);
  CHECK(out.empty());  // the leading '\r' ends nothing: the line was empty
  b.Feed("|##  |\r 20%|###", "[r0]: ", &out);
  CHECK(out == "[r0]:  10%|##  |\r");
  out.clear();
  b.Feed(" |\r\ndone\r", "[r0]: ", &out);
  CHECK(out == "[r0]:  20%|### |\r\n[r0]: done\r");
  out.clear();
  b.Feed("\nnext\n", "[r0]: ", &out);  // "\r" then "\n" in the next read: one line end
  CHECK(out == "\n[r0]: next\n");
  CHECK(b.empty());
}

TEST_CASE("ATerminalErasesTheRestOfARedrawBeforeTheLineWrittenOverIt") {
  bool after_cr = false;
  // rank 0's bar, then rank 1's shorter line over it: ESC[K first, or "0.189554" would show
  // through as "0.1895" plus the bar's tail.
  CHECK(EraseAfterRedraws("[rank 0]: [###.] 3/4 loss 0.189554\r", &after_cr) ==
        "[rank 0]: [###.] 3/4 loss 0.189554\r");
  CHECK(after_cr);
  CHECK(EraseAfterRedraws("[rank 1]: 0.1895\n", &after_cr) == "\x1b[K[rank 1]: 0.1895\n");
  CHECK_FALSE(after_cr);
  // Within one chunk, and the bar's own next state; "\r\n" keeps the bar's last state.
  CHECK(EraseAfterRedraws("a\rb\rc\r\nd\n", &after_cr) == "a\r\x1b[Kb\r\x1b[Kc\r\nd\n");
  CHECK(EraseAfterRedraws("plain\nlines\n", &after_cr) == "plain\nlines\n");
}

TEST_CASE("OverlongLinesAreSplitAtTheCap") {
  LineBuffer b(4);
  std::string out;
  b.Feed("abcdefghij", "> ", &out);
  CHECK(out == "> abcd\n> efgh\n");
  b.Flush("> ", &out);
  CHECK(out == "> abcd\n> efgh\n> ij\n");
}

TEST_CASE("TailKeepsTheLastLines") {
  TailLines t(2);
  t.Feed("a\nb\nc\npartial");
  auto lines = t.Lines();
  REQUIRE(lines.size() == 2);
  CHECK(lines[0] == "c");
  CHECK(lines[1] == "partial");
}

}  // namespace
}  // namespace launch::agent
