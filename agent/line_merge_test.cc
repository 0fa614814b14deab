#include "agent/line_merge.h"

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

using Clock = LineMerger::Clock;
using std::chrono::milliseconds;

TEST_CASE("RankPrefixesNameRunsOfRanks") {
  CHECK(LineMerger::Prefix({3}) == "[rank 3]: ");
  CHECK(LineMerger::Prefix({0, 1}) == "[ranks 0,1]: ");
  CHECK(LineMerger::Prefix({0, 1, 2, 3}) == "[ranks 0-3]: ");
  CHECK(LineMerger::Prefix({0, 2, 5, 6, 7, 9, 10}) == "[ranks 0,2,5-7,9,10]: ");
}

TEST_CASE("ALineEveryRankPrintsLeavesOnceAtTheLastCopy") {
  const Clock::time_point t0 = Clock::now();
  LineMerger m({0, 1, 2, 3}, milliseconds(500));
  std::string out;
  m.Add(2, "warning: x\n", t0);
  m.Add(0, "warning: x\n", t0 + milliseconds(10));
  m.Add(1, "warning: x\n", t0 + milliseconds(20));
  auto next = m.Release(t0 + milliseconds(20), &out);
  CHECK(out.empty());  // rank 3 has not printed it, and its window is open
  REQUIRE(next.has_value());
  CHECK(*next == t0 + milliseconds(500));
  m.Add(3, "warning: x\n", t0 + milliseconds(30));
  CHECK_FALSE(m.Release(t0 + milliseconds(30), &out).has_value());
  CHECK(out == "[ranks 0-3]: warning: x\n");
  CHECK(m.empty());
}

TEST_CASE("AWindowEndsWithTheRanksThatPrintedTheLine") {
  const Clock::time_point t0 = Clock::now();
  LineMerger m({0, 1, 2}, milliseconds(500));
  std::string out;
  m.Add(0, "step 1\n", t0);
  m.Add(2, "step 1\n", t0 + milliseconds(100));
  m.Add(0, "only rank 0\n", t0 + milliseconds(200));
  CHECK(*m.Release(t0 + milliseconds(499), &out) == t0 + milliseconds(500));
  CHECK(out.empty());
  // The first line's window ends; the second's is still open.
  CHECK(*m.Release(t0 + milliseconds(500), &out) == t0 + milliseconds(700));
  CHECK(out == "[ranks 0,2]: step 1\n");
  m.Release(t0 + milliseconds(700), &out);
  CHECK(out == "[ranks 0,2]: step 1\n[rank 0]: only rank 0\n");
  // A copy after the window is a line of its own.
  m.Add(1, "step 1\n", t0 + milliseconds(800));
  m.ReleaseAll(&out);
  CHECK(out == "[ranks 0,2]: step 1\n[rank 0]: only rank 0\n[rank 1]: step 1\n");
}

TEST_CASE("ARankThatClosedItsStreamIsNotWaitedFor") {
  const Clock::time_point t = Clock::now();
  LineMerger m({0, 1, 2}, milliseconds(500));
  std::string out;
  m.Add(1, "done\n", t);
  m.Closed(1);  // rank 1 exited first
  m.Add(0, "done\n", t);
  CHECK(m.Release(t, &out).has_value());
  CHECK(out.empty());  // rank 2 may still print it
  m.Closed(2);
  CHECK_FALSE(m.Release(t, &out).has_value());
  CHECK(out == "[ranks 0,1]: done\n");
  // A replacement of rank 1 prints again: waited for as before.
  m.Opened(1);
  m.Opened(2);
  m.Add(0, "again\n", t);
  m.Add(2, "again\n", t);
  out.clear();
  m.Release(t, &out);
  CHECK(out.empty());
}

TEST_CASE("ACopyAfterARanksOwnLinesMovesTheHeldLineAfterThem") {
  const Clock::time_point t = Clock::now();
  LineMerger m({0, 1, 2}, milliseconds(500));
  std::string out;
  m.Add(0, "I am 0\n", t);
  m.Add(0, "done\n", t);
  m.Add(1, "I am 1\n", t);
  m.Add(1, "done\n", t);  // "done" moves after "I am 1"
  m.Add(2, "I am 2\n", t);
  m.Add(2, "done\n", t);  // and after "I am 2": complete, behind the ranks' own lines
  m.Release(t, &out);
  CHECK(out.empty());
  m.Release(t + milliseconds(500), &out);
  CHECK(out == "[rank 0]: I am 0\n[rank 1]: I am 1\n[rank 2]: I am 2\n[ranks 0-2]: done\n");
}

TEST_CASE("EachRanksLinesKeepTheirOrder") {
  const Clock::time_point t = Clock::now();
  LineMerger m({0, 1}, milliseconds(500));
  std::string out;
  // Rank 1 prints b before a: joining rank 0's a (held before b) would show its b first.
  m.Add(0, "a\n", t);
  m.Add(0, "b\n", t);
  m.Add(1, "b\n", t);
  m.Add(1, "a\n", t);
  m.ReleaseAll(&out);
  CHECK(out == "[rank 0]: a\n[ranks 0,1]: b\n[rank 1]: a\n");
  // The same line twice from one rank is two lines; a second rank's two copies join them.
  m.Add(0, "same\n", t);
  m.Add(0, "same\n", t);
  m.Add(1, "same\n", t);
  m.Add(1, "same\n", t);
  out.clear();
  m.Release(t, &out);
  CHECK(out == "[ranks 0,1]: same\n[ranks 0,1]: same\n");
}

TEST_CASE("AHeldLineHoldsTheLinesAfterItAndMemoryIsBounded") {
  const Clock::time_point t = Clock::now();
  LineMerger m({0, 1}, milliseconds(500), /*max_held_bytes=*/10);
  std::string out;
  m.Add(0, "first\n", t);
  m.Add(0, "x\n", t);
  m.Add(1, "x\n", t);  // complete, but behind "first"
  m.Release(t, &out);
  CHECK(out.empty());
  m.Add(1, "longer line\n", t);  // 20 bytes held: the oldest leave until 10 or fewer are
  m.Release(t, &out);
  CHECK(out == "[rank 0]: first\n[ranks 0,1]: x\n[rank 1]: longer line\n");
  CHECK(m.empty());
}

TEST_CASE("ProgressRedrawsMergeLikeLines") {
  const Clock::time_point t = Clock::now();
  LineMerger m({0, 1}, milliseconds(500));
  std::string out;
  m.Add(0, " 50%|#####     |\r", t);
  m.Add(1, " 50%|#####     |\r", t);
  m.Release(t, &out);
  CHECK(out == "[ranks 0,1]:  50%|#####     |\r");
  // The '\n' of a "\r\n" that came in a read of its own ends the row, unprefixed; an empty
  // line is a line.
  m.Add(0, "\n", t);
  m.Add(1, "\n", t);
  m.Add(0, "\n", t);
  out.clear();
  m.ReleaseAll(&out);
  CHECK(out == "\n[rank 0]: \n");
}

}  // namespace
}  // namespace launch::agent
