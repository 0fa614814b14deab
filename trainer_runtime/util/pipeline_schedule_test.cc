// Unit tests for the pipeline schedules and partitions (no LibTorch, no processes).

#include "trainer_runtime/util/pipeline_schedule.h"

#include <map>
#include <set>

#include <doctest/doctest.h>

namespace launch::trainer {
namespace {

using config::PipelineSchedule;
using Kind = PipeOp::Kind;

// Simulates all stages with blocking receives and asynchronous sends: an operation can run
// when its input exists (forward: the previous stage forwarded this micro-batch; backward: the
// next stage back-propagated it, and this stage forwarded it). Returns false on deadlock.
bool RunsToCompletion(PipelineSchedule schedule, int stages, int micro) {
  std::vector<std::vector<PipeOp>> ops;
  for (int s = 0; s < stages; ++s) ops.push_back(BuildPipelineSchedule(schedule, stages, s, micro));
  std::vector<size_t> pc(static_cast<size_t>(stages), 0);
  std::set<std::pair<int, int>> forwarded, backwarded;  // (stage, micro)
  bool progress = true;
  for (int round = 0; progress && round < 10 * stages * micro + 10; ++round) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      auto& i = pc[static_cast<size_t>(s)];
      if (i == ops[static_cast<size_t>(s)].size()) continue;
      const PipeOp op = ops[static_cast<size_t>(s)][i];
      bool ready = op.kind == Kind::kForward
                       ? (s == 0 || forwarded.count({s - 1, op.micro}))
                       : (forwarded.count({s, op.micro}) &&
                          (s == stages - 1 || backwarded.count({s + 1, op.micro})));
      if (!ready) continue;
      (op.kind == Kind::kForward ? forwarded : backwarded).insert({s, op.micro});
      ++i;
      progress = true;
    }
  }
  for (int s = 0; s < stages; ++s)
    if (pc[static_cast<size_t>(s)] != ops[static_cast<size_t>(s)].size()) return false;
  return true;
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

}  // namespace
}  // namespace launch::trainer
