#include "trainer_runtime/util/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace launch::trainer {

std::vector<PipeOp> BuildPipelineSchedule(config::PipelineSchedule schedule, int stages, int stage,
                                          int microbatches) {
  using Kind = PipeOp::Kind;
  std::vector<PipeOp> ops;
  ops.reserve(static_cast<size_t>(2 * microbatches));
  if (schedule == config::PipelineSchedule::kGPipe) {
    for (int m = 0; m < microbatches; ++m) ops.push_back({Kind::kForward, m});
    for (int m = 0; m < microbatches; ++m) ops.push_back({Kind::kBackward, m});
    return ops;
  }
  // 1F1B: the stage s must have forwarded P-1-s micro-batches before the first gradient can come
  // back from the last stage, so it runs them up front; each later forward is paired with the
  // backward of the oldest live micro-batch.
  const int warmup = std::min(stages - 1 - stage, microbatches);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) ops.push_back({Kind::kForward, next_forward});
  while (next_forward < microbatches) {
    ops.push_back({Kind::kForward, next_forward++});
    ops.push_back({Kind::kBackward, next_backward++});
  }
  while (next_backward < microbatches) ops.push_back({Kind::kBackward, next_backward++});
  return ops;
}

int PeakLiveMicrobatches(const std::vector<PipeOp>& ops) {
  int live = 0, peak = 0;
  for (const PipeOp& op : ops) {
    live += op.kind == PipeOp::Kind::kForward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

std::string ScheduleToString(const std::vector<PipeOp>& ops) {
  std::string out;
  for (const PipeOp& op : ops) {
    if (!out.empty()) out += ' ';
    out += op.kind == PipeOp::Kind::kForward ? 'F' : 'B';
    out += std::to_string(op.micro);
  }
  return out;
}

double TheoreticalBubble(int stages, int microbatches) {
  return static_cast<double>(stages - 1) / static_cast<double>(microbatches + stages - 1);
}

StatusOr<std::vector<int64_t>> PartitionLayers(const std::vector<int64_t>& layer_costs, int stages,
                                               const std::vector<int64_t>& explicit_partition) {
  const int64_t layers = static_cast<int64_t>(layer_costs.size());
  if (stages > layers)
    return Status::InvalidConfig("train.parallel.stages " + std::to_string(stages) +
                                 " is more than the model's " + std::to_string(layers) +
                                 " layers (train.model.layers); every stage needs at least one");
  if (!explicit_partition.empty()) {
    if (static_cast<int>(explicit_partition.size()) != stages)
      return Status::InvalidConfig(
          "train.parallel.partition has " + std::to_string(explicit_partition.size()) +
          " entries but train.parallel.stages is " + std::to_string(stages));
    int64_t sum = 0;
    for (size_t i = 0; i < explicit_partition.size(); ++i) {
      if (explicit_partition[i] < 1)
        return Status::InvalidConfig("train.parallel.partition[" + std::to_string(i) + "] is " +
                                     std::to_string(explicit_partition[i]) +
                                     "; every stage needs at least one layer");
      sum += explicit_partition[i];
    }
    if (sum != layers)
      return Status::InvalidConfig("train.parallel.partition sums to " + std::to_string(sum) +
                                   " layers but the model (train.model.layers) has " +
                                   std::to_string(layers) + "; it must cover every layer once");
    return explicit_partition;
  }
  // Minimise the most expensive stage over contiguous splits: best[k][i] = the smallest possible
  // maximum stage cost when the first i layers form k stages. O(P * L^2), L is small.
  std::vector<int64_t> prefix(static_cast<size_t>(layers) + 1, 0);
  for (int64_t i = 0; i < layers; ++i)
    prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + layer_costs[i];
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  const size_t n = static_cast<size_t>(layers) + 1;
  std::vector<std::vector<int64_t>> best(static_cast<size_t>(stages) + 1,
                                         std::vector<int64_t>(n, kInf));
  std::vector<std::vector<int64_t>> cut(static_cast<size_t>(stages) + 1,
                                        std::vector<int64_t>(n, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= static_cast<size_t>(stages); ++k) {
    for (size_t i = k; i < n; ++i) {
      for (size_t j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == kInf) continue;
        const int64_t cost = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        // Ties prefer the later cut (earlier stages slightly larger), which is deterministic.
        if (cost <= best[k][i]) {
          best[k][i] = cost;
          cut[k][i] = static_cast<int64_t>(j);
        }
      }
    }
  }
  std::vector<int64_t> sizes(static_cast<size_t>(stages));
  size_t end = n - 1;
  for (size_t k = static_cast<size_t>(stages); k >= 1; --k) {
    const size_t start = static_cast<size_t>(cut[k][end]);
    sizes[k - 1] = static_cast<int64_t>(end - start);
    end = start;
  }
  return sizes;
}

std::vector<std::pair<int64_t, int64_t>> SplitRows(int64_t batch, int64_t chunks) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t base = batch / chunks, extra = batch % chunks;
  int64_t offset = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t rows = base + (c < extra ? 1 : 0);
    out.emplace_back(offset, rows);
    offset += rows;
  }
  return out;
}

Status CheckRowsFor(int64_t batch, int64_t chunks, const std::string& key) {
  if (batch >= chunks) return Status::Ok();
  return Status::InvalidArgument(key + " is " + std::to_string(chunks) + " but this batch has " +
                                 std::to_string(batch) + (batch == 1 ? " row" : " rows") +
                                 ": each of the " + std::to_string(chunks) +
                                 " needs at least one row (use batches of at least " +
                                 std::to_string(chunks) + " rows, or lower " + key + ")");
}

}  // namespace launch::trainer
