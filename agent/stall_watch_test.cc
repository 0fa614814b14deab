#include "agent/stall_watch.h"

#include <doctest/doctest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <string>
#include <vector>

namespace launch::agent {
namespace {

constexpr uint64_t kSecond = 1000000000ull;

// A ring as a reader would see it, built by hand: times are chosen, not measured.
struct RingBuilder {
  RingSnapshot snap;
  RingBuilder(int rank, pid_t pid) {
    snap.rank = rank;
    snap.pid = pid;
    snap.created_ns = 1 * kSecond;
    snap.groups = {"world"};
    snap.last_seq = {0};
  }
  RingBuilder& Op(CollectiveOp op, int64_t bytes, uint64_t enqueued_s, uint64_t done_s) {
    RingEntry e;
    e.index = snap.issued++;
    e.op = static_cast<uint32_t>(op);
    e.group = 0;
    e.seq = ++snap.last_seq[0];
    e.bytes = bytes;
    e.enqueued_ns = enqueued_s * kSecond;
    e.done_ns = done_s * kSecond;
    e.state = static_cast<uint32_t>(done_s ? CollectiveState::kDone : CollectiveState::kEnqueued);
    if (done_s) {
      ++snap.completed;
      snap.last_done_ns = std::max(snap.last_done_ns, e.done_ns);
    }
    snap.entries.push_back(e);
    return *this;
  }
  RankView View() const {
    RankView v;
    v.rank = snap.rank;
    v.ring = snap;
    return v;
  }
};

TEST_CASE("AStoppedRankIsNamedAsNotHavingEnteredTheCollectiveTheOthersWaitIn") {
  RingBuilder r0(0, 100), r1(1, 101);
  r0.Op(CollectiveOp::kBroadcast, 8, 2, 3).Op(CollectiveOp::kAllReduce, 4096, 4, 0);
  r1.Op(CollectiveOp::kBroadcast, 8, 2, 3);
  const std::vector<RankView> views = {r0.View(), r1.View()};

  RingAnalysis quiet = AnalyzeRings(views, 7 * kSecond, 5 * kSecond);
  CHECK_FALSE(quiet.stalled);  // 4 s since the last completion

  RingAnalysis a = AnalyzeRings(views, 9 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.idle_s == doctest::Approx(6.0));
  CHECK_FALSE(a.desync);
  CHECK(a.waiting == std::vector<int>{0});
  CHECK(a.lagging == std::vector<int>{1});
  CHECK(a.blamed == std::vector<int>{1});
  REQUIRE(a.lines.size() == 2);
  CHECK(a.lines[0] ==
        "rank 0 (pid 100): waits in all-reduce #2 of group 'world' (4.0 KiB) for 5.0 s "
        "(enqueued)");
  CHECK(a.lines[1] ==
        "rank 1 (pid 101): has not entered all-reduce #2 of group 'world'; its last completed "
        "collective: broadcast #1 of group 'world' (8 B), 6.0 s ago");
}

TEST_CASE("ANativeStackThatDoesNotReachStartSaysWhyItEndsEarly") {
  const std::string start = "/bin/train(_start+0x21) [0x55beb4cece91]";
  const std::string blas = "/lib/libopenblas.so.0(sgemm_beta_ZEN+0x5d) [0x7fbeefc2025d]";
  CHECK(StackCutShort({blas, "/bin/train(main+0x2a8) [0x55beb4ceadf8]", start}).empty());
  // Stopped inside a kernel without unwind information: one frame, said so.
  CHECK(StackCutShort({blas}).find("no unwind information past this frame") != std::string::npos);
  // The dump's limit.
  std::vector<std::string> deep(kStackDumpFrames, blas);
  CHECK(StackCutShort(deep).find("innermost frames; the stack goes deeper") != std::string::npos);
  CHECK(StackCutShort({}).empty());
}

TEST_CASE("AStoppedRankInsideTheCollectiveIsBlamedNotTheOtherNodes") {
  RingBuilder r0(0, 100), r1(1, 101);
  r0.Op(CollectiveOp::kAllReduce, 8, 2, 0);
  r1.Op(CollectiveOp::kAllReduce, 8, 2, 0);
  RankView v1 = r1.View();
  v1.stopped = true;
  RingAnalysis a = AnalyzeRings({r0.View(), v1}, 10 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.lagging.empty());
  CHECK(a.blamed == std::vector<int>{1});
  CHECK(a.lines.back().find("other nodes") == std::string::npos);
}

TEST_CASE("ARankStoppedInsideAnEarlierCollectiveHasNotEnteredTheOneTheOthersWaitIn") {
  RingBuilder r0(0, 100), r1(1, 101);
  // Rank 0 finished #1 (rank 1 had contributed), then entered #2; rank 1 never returned from #1.
  r0.Op(CollectiveOp::kAllReduce, 8, 2, 3).Op(CollectiveOp::kAllReduce, 16, 4, 0);
  r1.Op(CollectiveOp::kAllReduce, 8, 2, 0);
  RingAnalysis a = AnalyzeRings({r0.View(), r1.View()}, 10 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.waiting == std::vector<int>{0, 1});
  CHECK(a.lagging == std::vector<int>{1});
  CHECK(a.blamed == std::vector<int>{1});
  REQUIRE(a.lines.size() == 2);
  CHECK(a.lines[0] ==
        "rank 0 (pid 100): waits in all-reduce #2 of group 'world' (16 B) for 6.0 s (enqueued)");
  CHECK(a.lines[1] ==
        "rank 1 (pid 101): waits in all-reduce #1 of group 'world' (8 B) for 8.0 s (enqueued); "
        "has not entered all-reduce #2 of group 'world'");
}

TEST_CASE("AStoppedRankAloneOnItsNodeIsAStallThoughItWaitsInNothing") {
  RingBuilder r1(1, 101);
  r1.Op(CollectiveOp::kAllReduce, 8, 2, 3);
  RankView v1 = r1.View();
  CHECK_FALSE(AnalyzeRings({v1}, 10 * kSecond, 5 * kSecond).stalled);
  v1.stopped = true;
  RingAnalysis a = AnalyzeRings({v1}, 10 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.waiting.empty());
  CHECK(a.blamed == std::vector<int>{1});
  CHECK_FALSE(AnalyzeRings({v1}, 7 * kSecond, 5 * kSecond).stalled);
}

TEST_CASE("RanksInDifferentCollectivesAtOneSequenceNumberAreADesync") {
  RingBuilder r0(0, 100), r1(1, 101);
  r0.Op(CollectiveOp::kAllReduce, 8, 2, 3).Op(CollectiveOp::kAllReduce, 8, 4, 0);
  r1.Op(CollectiveOp::kAllReduce, 8, 2, 3).Op(CollectiveOp::kBarrier, 0, 4, 0);
  RingAnalysis a = AnalyzeRings({r0.View(), r1.View()}, 10 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.desync);
  CHECK(a.lagging.empty());
  CHECK(a.blamed == std::vector<int>{0, 1});
  REQUIRE(a.lines.size() == 3);
  CHECK(a.lines[0] ==
        "desync in group 'world' at #2: rank 0 is in all-reduce (8 B), rank 1 is in barrier "
        "(0 B) - a rank skipped or added a collective");
}

TEST_CASE("AllToAllsOfDifferentSizesAtOneSequenceNumberAreNoDesync") {
  // Uneven splits: each rank sends what it chooses. A different op still is one.
  RingBuilder r0(0, 100), r1(1, 101);
  r0.Op(CollectiveOp::kAllToAll, 96, 2, 3).Op(CollectiveOp::kAllToAll, 8, 4, 0);
  r1.Op(CollectiveOp::kAllToAll, 32, 2, 3).Op(CollectiveOp::kAllToAll, 24, 4, 0);
  CHECK_FALSE(AnalyzeRings({r0.View(), r1.View()}, 10 * kSecond, 5 * kSecond).desync);
  RingBuilder r2(0, 100), r3(1, 101);
  r2.Op(CollectiveOp::kAllToAll, 8, 2, 0);
  r3.Op(CollectiveOp::kGather, 8, 2, 0);
  RingAnalysis a = AnalyzeRings({r2.View(), r3.View()}, 10 * kSecond, 5 * kSecond);
  CHECK(a.desync);
  CHECK(a.lines[0] ==
        "desync in group 'world' at #1: rank 0 is in all-to-all (8 B), rank 1 is in gather "
        "(8 B) - a rank skipped or added a collective");
}

TEST_CASE("NoRankInACollectiveIsNoStallHoweverLongTheGap") {
  RingBuilder r0(0, 100), r1(1, 101);
  r0.Op(CollectiveOp::kAllReduce, 8, 2, 3);
  r1.Op(CollectiveOp::kAllReduce, 8, 2, 3);
  RingAnalysis a = AnalyzeRings({r0.View(), r1.View()}, 1000 * kSecond, 5 * kSecond);
  CHECK_FALSE(a.stalled);
  CHECK(a.waiting.empty());
  CHECK(a.lines[1] ==
        "rank 1 (pid 101): in no collective; its last completed collective: all-reduce #1 of "
        "group 'world' (8 B), 997.0 s ago");
  // A zero timeout never stalls (the on-demand report).
  r0.Op(CollectiveOp::kAllReduce, 8, 4, 0);
  CHECK_FALSE(AnalyzeRings({r0.View(), r1.View()}, 1000 * kSecond, 0).stalled);
}

TEST_CASE("AWaitShorterThanTheTimeoutIsNoStallThoughNothingCompletedForLonger") {
  // Rank 0 is still starting (no collective yet, 9 s after the rings were made); rank 1 entered
  // its first all-reduce a moment ago.
  RingBuilder r0(0, 100), r1(1, 101);
  r1.Op(CollectiveOp::kAllReduce, 8, 9, 0);
  RingAnalysis a = AnalyzeRings({r0.View(), r1.View()}, 10 * kSecond, 5 * kSecond);
  CHECK(a.idle_s == doctest::Approx(9.0));
  CHECK_FALSE(a.stalled);
  CHECK(AnalyzeRings({r0.View(), r1.View()}, 14 * kSecond, 5 * kSecond).stalled);
}

TEST_CASE("EveryLocalRankWaitingPointsAtTheOtherNodes") {
  RingBuilder r0(2, 100), r1(3, 101);
  r0.Op(CollectiveOp::kAllReduce, 8, 2, 0);
  r1.Op(CollectiveOp::kAllReduce, 8, 2, 0);
  RingAnalysis a = AnalyzeRings({r0.View(), r1.View()}, 10 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.blamed == std::vector<int>{2, 3});
  CHECK(a.remote);
  CHECK(a.lines.back().find("run on other nodes") != std::string::npos);
}

TEST_CASE("ARankWithoutARingIsNamedAndIgnored") {
  RingBuilder r0(0, 100);
  r0.Op(CollectiveOp::kAllReduce, 8, 2, 0);
  RankView none;
  none.rank = 1;
  none.ring = Status::NotFound("no collective ring /dev/shm/x");
  RingAnalysis a = AnalyzeRings({r0.View(), none}, 10 * kSecond, 5 * kSecond);
  CHECK(a.stalled);
  CHECK(a.blamed == std::vector<int>{0});
  REQUIRE(a.lines.size() == 2);
  CHECK(a.lines[1] ==
        "rank 1: no collective ring (a program not on the library, or no process group yet)");
  RankView only;
  only.ring = Status::NotFound("x");
  CHECK(AnalyzeRings({only}, 10 * kSecond, 5 * kSecond).lines.size() == 1);
  CHECK_FALSE(AnalyzeRings({only}, 10 * kSecond, 5 * kSecond).stalled);
}

TEST_CASE("ProcessStateNamesAStoppedProcess") {
  pid_t pid = 0;
  char* argv[] = {const_cast<char*>("sleep"), const_cast<char*>("30"), nullptr};
  REQUIRE(posix_spawnp(&pid, "sleep", nullptr, nullptr, argv, environ) == 0);
  ::kill(pid, SIGSTOP);
  int st = 0;
  REQUIRE(::waitpid(pid, &st, WUNTRACED) == pid);
  CHECK(IsStopped(pid));
  CHECK(DescribeProcessState(pid).rfind("stopped (state T", 0) == 0);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &st, 0);
  CHECK(DescribeProcessState(pid) == "gone");
}

TEST_CASE("AGoneRankWithALiveReplacementIsReportedAsJoining") {
  boost::asio::io_context io;
  StallWatchOptions options;
  options.ring_prefix = StallWatch::DefaultRingPrefix("replacement-report");
  options.ranks = {1};
  options.stack_wait = std::chrono::milliseconds(0);
  options.replacement = [](int rank) -> std::optional<Replacement> {
    if (rank == 1) return Replacement{4242, 2};
    return std::nullopt;
  };
  auto watch = std::make_shared<StallWatch>(io, options, nullptr);
  // The lost worker's ring, left as a SIGKILLed worker leaves it: its writer is gone.
  const pid_t lost = ::fork();
  REQUIRE(lost >= 0);
  if (lost == 0) ::_exit(CollectiveRing::Create(watch->RingPath(1), 1).ok() ? 0 : 1);
  int st = 0;
  REQUIRE(::waitpid(lost, &st, 0) == lost);
  REQUIRE((WIFEXITED(st) && WEXITSTATUS(st) == 0));
  std::string report;
  watch->Report([&](const std::string& text) { report = text; });
  io.run();
  CHECK(report.find("rank 1 (pid " + std::to_string(lost) +
                    ") is gone: replaced in place (generation 2, started as pid 4242)") !=
        std::string::npos);
}

TEST_CASE("TheWatchRemovesItsRingFiles") {
  boost::asio::io_context io;
  StallWatchOptions options;
  options.ring_prefix = StallWatch::DefaultRingPrefix("test/run id");
  CHECK(options.ring_prefix.find("test_run_id") != std::string::npos);
  options.ranks = {0, 1};
  std::string path;
  {
    auto watch = std::make_shared<StallWatch>(io, options, nullptr);
    path = watch->RingPath(1);
    REQUIRE(CollectiveRing::Create(path, 1).ok());
    REQUIRE(::access(path.c_str(), F_OK) == 0);
  }
  CHECK(::access(path.c_str(), F_OK) != 0);
}

}  // namespace
}  // namespace launch::agent
