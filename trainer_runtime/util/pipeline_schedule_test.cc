// Unit tests for the pipeline schedules and partitions (no LibTorch, no processes).

#include "trainer_runtime/util/pipeline_schedule.h"

#include <map>
#include <set>
#include <tuple>
#include <vector>

#include <doctest/doctest.h>

namespace launch::trainer {
namespace {

using config::PipelineSchedule;
using Kind = PipeOp::Kind;

// Every stage's operations run with blocking receives and asynchronous sends (SimulatePipeline)
// to the end: no deadlock.
bool RunsToCompletion(PipelineSchedule schedule, int stages, int micro) {
  std::vector<std::vector<PipeOp>> ops;
  for (int s = 0; s < stages; ++s) ops.push_back(BuildPipelineSchedule(schedule, stages, s, micro));
  return SimulatePipeline(ops, 1, PipeCosts{}).completed;
}

TEST_CASE("GPipe runs all forwards, then all backwards, keeping M micro-batches alive") {
  auto ops = BuildPipelineSchedule(PipelineSchedule::kGPipe, 2, 0, 4);
  CHECK(ScheduleToString(ops) == "F0 F1 F2 F3 B0 B1 B2 B3");
  CHECK(PeakLiveMicrobatches(ops) == 4);
}

TEST_CASE("1F1B warms up P-1-s forwards, alternates, then cools down") {
  CHECK(ScheduleToString(BuildPipelineSchedule(PipelineSchedule::k1F1B, 4, 0, 6)) ==
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  CHECK(ScheduleToString(BuildPipelineSchedule(PipelineSchedule::k1F1B, 4, 2, 6)) ==
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  CHECK(ScheduleToString(BuildPipelineSchedule(PipelineSchedule::k1F1B, 4, 3, 6)) ==
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
}

TEST_CASE("1F1B keeps at most P - s micro-batches alive; both schedules run every op once") {
  for (int p : {1, 2, 3, 4, 8}) {
    for (int m : {1, 2, 4, 7, 16}) {
      for (auto sched : {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B}) {
        for (int s = 0; s < p; ++s) {
          auto ops = BuildPipelineSchedule(sched, p, s, m);
          REQUIRE(ops.size() == static_cast<size_t>(2 * m));
          std::map<int, int> f, b;
          for (auto& op : ops) (op.kind == Kind::kForward ? f : b)[op.micro]++;
          for (int i = 0; i < m; ++i) CHECK((f[i] == 1 && b[i] == 1));
          if (sched == PipelineSchedule::kGPipe) {
            CHECK(PeakLiveMicrobatches(ops) == m);
          } else {
            CHECK(PeakLiveMicrobatches(ops) == std::min(p - s, m));
          }
        }
        INFO("P=" << p << " M=" << m);
        CHECK(RunsToCompletion(sched, p, m));
      }
    }
  }
}

TEST_CASE("theoretical bubble is (P-1)/(M+P-1)") {
  CHECK(TheoreticalBubble(1, 8) == doctest::Approx(0.0));
  CHECK(TheoreticalBubble(2, 4) == doctest::Approx(0.2));
  CHECK(TheoreticalBubble(4, 16) == doctest::Approx(3.0 / 19.0));
  CHECK(TheoreticalBubble(2, 8, PipelineSchedule::kInterleaved1F1B, 2) ==
        doctest::Approx(1.0 / 17));
  CHECK(TheoreticalBubble(2, 4, PipelineSchedule::kZeroBubble) == doctest::Approx(1.0 / 13));
}

TEST_CASE("balanced partition minimises the largest stage; explicit partitions are checked") {
  auto even = PartitionLayers({10, 10, 10, 10}, 2, {});
  REQUIRE(even.ok());
  CHECK(*even == std::vector<int64_t>{2, 2});
  auto skewed = PartitionLayers({100, 1, 1, 1, 1, 100}, 3, {});
  REQUIRE(skewed.ok());
  CHECK(*skewed == std::vector<int64_t>{1, 4, 1});
  auto all = PartitionLayers({5, 5, 5}, 3, {});
  REQUIRE(all.ok());
  CHECK(*all == std::vector<int64_t>{1, 1, 1});

  auto too_many = PartitionLayers({1, 1}, 3, {});
  REQUIRE(!too_many.ok());
  CHECK(too_many.status().message().find("more than the model's 2 layers") != std::string::npos);
  auto short_sum = PartitionLayers({1, 1, 1, 1}, 2, {1, 2});
  REQUIRE(!short_sum.ok());
  CHECK(short_sum.status().message().find("partition sums to 3") != std::string::npos);
  auto zero = PartitionLayers({1, 1, 1}, 2, {3, 0});
  REQUIRE(!zero.ok());
  CHECK(zero.status().message().find("partition[1]") != std::string::npos);
  auto given = PartitionLayers({1, 1, 1, 1}, 2, {3, 1});
  REQUIRE(given.ok());
  CHECK(*given == std::vector<int64_t>{3, 1});
}

TEST_CASE("CheckRowsFor names the key and both numbers when a chunk would be empty") {
  CHECK(CheckRowsFor(4, 4, "train.parallel.microbatches").ok());
  const Status s = CheckRowsFor(2, 4, "train.parallel.microbatches");
  CHECK(s.code() == Status::Code::kInvalidArgument);
  CHECK(s.message() ==
        "train.parallel.microbatches is 4 but this batch has 2 rows: each of the 4 needs at least "
        "one row (use batches of at least 4 rows, or lower train.parallel.microbatches)");
}

TEST_CASE("SplitRows gives near-equal non-empty chunks covering the batch") {
  auto chunks = SplitRows(10, 4);
  REQUIRE(chunks.size() == 4);
  CHECK(chunks[0] == std::make_pair<int64_t, int64_t>(0, 3));
  CHECK(chunks[1] == std::make_pair<int64_t, int64_t>(3, 3));
  CHECK(chunks[2] == std::make_pair<int64_t, int64_t>(6, 2));
  CHECK(chunks[3] == std::make_pair<int64_t, int64_t>(8, 2));
  CHECK(SplitRows(3, 3).size() == 3);
}

std::vector<std::vector<PipeOp>> Interleaved(int stages, int micro, int v) {
  std::vector<std::vector<PipeOp>> ranks;
  for (int s = 0; s < stages; ++s) ranks.push_back(BuildInterleavedSchedule(stages, s, micro, v));
  return ranks;
}

std::vector<std::vector<PipeOp>> ZeroBubble(int stages, int micro) {
  std::vector<std::vector<PipeOp>> ranks;
  for (int s = 0; s < stages; ++s) ranks.push_back(BuildZeroBubbleSchedule(stages, s, micro));
  return ranks;
}

// Each (kind, micro-batch, chunk) exactly once on each rank, for every kind in `kinds`.
void CheckEveryOpOnce(const std::vector<std::vector<PipeOp>>& ranks, int micro, int chunks,
                      const std::vector<Kind>& kinds) {
  for (const auto& ops : ranks) {
    std::map<std::tuple<int, int, int>, int> seen;
    for (const PipeOp& op : ops) ++seen[{static_cast<int>(op.kind), op.micro, op.chunk}];
    CHECK(seen.size() == kinds.size() * static_cast<size_t>(micro * chunks));
    for (const Kind kind : kinds)
      for (int m = 0; m < micro; ++m)
        for (int c = 0; c < chunks; ++c) CHECK(seen[{static_cast<int>(kind), m, c}] == 1);
  }
}

TEST_CASE("SimulatePipeline times 1F1B's bubble and finds a deadlock") {
  for (int stages : {2, 4})
    for (int micro : {1, 4, 8}) {
      std::vector<std::vector<PipeOp>> ranks;
      for (int s = 0; s < stages; ++s)
        ranks.push_back(BuildPipelineSchedule(PipelineSchedule::k1F1B, stages, s, micro));
      const PipeRun run = SimulatePipeline(ranks, 1, PipeCosts{});
      REQUIRE(run.completed);
      CHECK(run.makespan == doctest::Approx(3.0 * (micro + stages - 1)));
      CHECK(run.bubble == doctest::Approx(TheoreticalBubble(stages, micro)));
    }
  // Stage 1 waits for micro-batch 1 first, stage 0 for micro-batch 0's gradient first.
  const PipeRun stuck = SimulatePipeline(
      {{{Kind::kForward, 0}, {Kind::kBackward, 0}, {Kind::kForward, 1}, {Kind::kBackward, 1}},
       {{Kind::kForward, 1}, {Kind::kBackward, 1}, {Kind::kForward, 0}, {Kind::kBackward, 0}}},
      1, PipeCosts{});
  CHECK_FALSE(stuck.completed);
  CHECK(stuck.stuck == "stage 0 at B0, stage 1 at F1");
}

TEST_CASE("Interleaved 1F1B runs every chunk of every micro-batch without deadlock") {
  CHECK(ScheduleToString(BuildInterleavedSchedule(2, 0, 2, 2)) ==
        "F0 F1 F0@1 F1@1 B0@1 B1@1 B0 B1");
  CHECK(ScheduleToString(BuildInterleavedSchedule(2, 1, 2, 2)) ==
        "F0 F1 F0@1 B0@1 F1@1 B1@1 B0 B1");
  for (int stages : {2, 3, 4})
    for (int v : {2, 3})
      for (int groups : {1, 2, 3}) {
        const int micro = groups * stages;
        CAPTURE(stages);
        CAPTURE(v);
        CAPTURE(micro);
        const auto ranks = Interleaved(stages, micro, v);
        CheckEveryOpOnce(ranks, micro, v, {Kind::kForward, Kind::kBackward});
        // Each chunk is 1/v of the stage's layers: its passes take 1/v of the time.
        const PipeRun run = SimulatePipeline(ranks, v, PipeCosts{1.0 / v, 2.0 / v, 0, 0});
        REQUIRE(run.completed);
        const double want = static_cast<double>(stages - 1) / (v * micro + stages - 1);
        CHECK(run.bubble <= want + 0.05);
      }
  // The bubble against 1F1B's at P = 2, M = 8 (the goal's setting): v = 2 shrinks it to
  // 1/17 from 1/9.
  const PipeRun run = SimulatePipeline(Interleaved(2, 8, 2), 2, PipeCosts{0.5, 1.0, 0, 0});
  CHECK(run.bubble == doctest::Approx(1.0 / 17));
  CHECK(run.bubble ==
        doctest::Approx(TheoreticalBubble(2, 8, PipelineSchedule::kInterleaved1F1B, 2)));
}

TEST_CASE("ZB-H1 splits each backward, keeps 1F1B's peak memory and a third of its bubble") {
  CHECK(ScheduleToString(BuildZeroBubbleSchedule(2, 0, 4)) ==
        "F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3");
  CHECK(ScheduleToString(BuildZeroBubbleSchedule(2, 1, 4)) ==
        "F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3");
  for (int stages : {2, 3, 4, 8})
    for (int micro : {1, 2, 4, 8, 12, 16}) {
      CAPTURE(stages);
      CAPTURE(micro);
      const auto ranks = ZeroBubble(stages, micro);
      CheckEveryOpOnce(ranks, micro, 1,
                       {Kind::kForward, Kind::kBackwardInput, Kind::kBackwardWeight});
      for (const auto& ops : ranks) CHECK(PeakLiveMicrobatches(ops) <= stages);
      // The same work as 1F1B's (a backward is its two halves), timed alike.
      const PipeRun zb = SimulatePipeline(ranks, 1, PipeCosts{1, 2, 1, 1});
      REQUIRE(zb.completed);
      std::vector<std::vector<PipeOp>> one;
      for (int s = 0; s < stages; ++s)
        one.push_back(BuildPipelineSchedule(PipelineSchedule::k1F1B, stages, s, micro));
      const PipeRun base = SimulatePipeline(one, 1, PipeCosts{1, 2, 1, 1});
      CHECK(zb.makespan <= base.makespan);
      CHECK(zb.bubble < base.bubble);
      // Idle passes per stage: P - 1 against 1F1B's 3(P - 1).
      if (micro >= stages) {
        CHECK(zb.makespan == doctest::Approx(3.0 * micro + stages - 1));
        CHECK(zb.bubble ==
              doctest::Approx(TheoreticalBubble(stages, micro, PipelineSchedule::kZeroBubble)));
      }
    }
}

TEST_CASE("Every schedule receives each link's messages in the order they are sent") {
  // Both transports match messages in order per (sender, receiver, tag): an activation or
  // gradient taken out of order would train on another micro-batch's.
  for (int stages : {2, 3, 4})
    for (int groups : {1, 2, 3}) {
      const int micro = groups * stages;
      CAPTURE(stages);
      CAPTURE(micro);
      std::string why;
      for (auto sched :
           {PipelineSchedule::kGPipe, PipelineSchedule::k1F1B, PipelineSchedule::kZeroBubble}) {
        std::vector<std::vector<PipeOp>> ranks;
        for (int s = 0; s < stages; ++s)
          ranks.push_back(BuildPipelineSchedule(sched, stages, s, micro));
        CHECK_MESSAGE(ReceiveOrderMatches(ranks, 1, &why), why);
      }
      for (int v : {2, 3}) {
        CAPTURE(v);
        CHECK_MESSAGE(ReceiveOrderMatches(Interleaved(stages, micro, v), v, &why), why);
      }
    }
  // A receiver that takes two micro-batches the other way round is found.
  auto ranks = Interleaved(2, 2, 2);
  std::swap(ranks[1][0], ranks[1][1]);
  std::string why;
  CHECK_FALSE(ReceiveOrderMatches(ranks, 2, &why));
  CHECK(why == "activations from rank 0 to rank 1 are received in another order than sent");
}

TEST_CASE("With virtual stages the model is cut into stages x virtual_stages chunks") {
  auto cut = PartitionLayers({10, 10, 10, 10}, 2, {}, 2);
  REQUIRE(cut.ok());
  CHECK(*cut == std::vector<int64_t>{1, 1, 1, 1});
  auto too_few = PartitionLayers({1, 1, 1}, 2, {}, 2);
  REQUIRE_FALSE(too_few.ok());
  CHECK(too_few.status().message().find("stages x virtual_stages (2 x 2 = 4)") !=
        std::string::npos);
  auto wrong = PartitionLayers({1, 1, 1, 1}, 2, {2, 2}, 2);
  REQUIRE_FALSE(wrong.ok());
  CHECK(wrong.status().message().find("has 2 entries") != std::string::npos);
}

}  // namespace
}  // namespace launch::trainer
