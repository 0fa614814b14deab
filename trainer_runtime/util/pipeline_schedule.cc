#include "trainer_runtime/util/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <tuple>

namespace launch::trainer {

std::vector<PipeOp> BuildPipelineSchedule(config::PipelineSchedule schedule, int stages, int stage,
                                          int microbatches, int virtual_stages) {
  using Kind = PipeOp::Kind;
  if (schedule == config::PipelineSchedule::kInterleaved1F1B)
    return BuildInterleavedSchedule(stages, stage, microbatches, virtual_stages);
  if (schedule == config::PipelineSchedule::kZeroBubble)
    return BuildZeroBubbleSchedule(stages, stage, microbatches);
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

std::vector<PipeOp> BuildInterleavedSchedule(int stages, int stage, int microbatches,
                                             int virtual_stages) {
  using Kind = PipeOp::Kind;
  const int total = microbatches * virtual_stages;
  // The k-th forward (backward) of this rank: groups of P micro-batches per chunk, the chunks
  // in order (in reverse for backwards), then the next P micro-batches.
  auto nth = [&](Kind kind, int k) {
    const int group = k / stages;
    int chunk = group % virtual_stages;
    if (kind == Kind::kBackward) chunk = virtual_stages - 1 - chunk;
    return PipeOp{kind, (k / (stages * virtual_stages)) * stages + k % stages, chunk};
  };
  // Before the first gradient reaches this rank's last chunk, each of the later ranks forwards
  // twice per step of the way back and forth, and every chunk but the last its group of P.
  const int warmup = std::min(total, 2 * (stages - 1 - stage) + (virtual_stages - 1) * stages);
  std::vector<PipeOp> ops;
  ops.reserve(static_cast<size_t>(2 * total));
  for (int k = 0; k < warmup; ++k) ops.push_back(nth(Kind::kForward, k));
  for (int k = 0; k < total - warmup; ++k) {
    ops.push_back(nth(Kind::kForward, warmup + k));
    ops.push_back(nth(Kind::kBackward, k));
  }
  for (int k = total - warmup; k < total; ++k) ops.push_back(nth(Kind::kBackward, k));
  return ops;
}

namespace {

// Which result an operation waits for or makes: a chunk's forward output, its input's gradient,
// its weights' gradients; of micro-batch `micro` at global stage `stage`.
enum class Made { kForward, kInputGrad, kWeightGrad };
using Key = std::tuple<Made, int, int>;

// What `op` of rank `rank` waits for (chunk c of rank p is global stage c*P + p of `global`).
std::vector<Key> InputsOf(const PipeOp& op, int rank, int stages, int global) {
  const int g = op.chunk * stages + rank;
  switch (op.kind) {
    case PipeOp::Kind::kForward:
      if (g == 0) return {};
      return {Key{Made::kForward, op.micro, g - 1}};
    case PipeOp::Kind::kBackward:
    case PipeOp::Kind::kBackwardInput:
      if (g == global - 1) return {Key{Made::kForward, op.micro, g}};
      return {Key{Made::kForward, op.micro, g}, Key{Made::kInputGrad, op.micro, g + 1}};
    case PipeOp::Kind::kBackwardWeight:
      return {Key{Made::kInputGrad, op.micro, g}};
  }
  return {};
}

std::vector<Key> OutputsOf(const PipeOp& op, int rank, int stages) {
  const int g = op.chunk * stages + rank;
  switch (op.kind) {
    case PipeOp::Kind::kForward:
      return {Key{Made::kForward, op.micro, g}};
    case PipeOp::Kind::kBackward:
      return {Key{Made::kInputGrad, op.micro, g}, Key{Made::kWeightGrad, op.micro, g}};
    case PipeOp::Kind::kBackwardInput:
      return {Key{Made::kInputGrad, op.micro, g}};
    case PipeOp::Kind::kBackwardWeight:
      return {Key{Made::kWeightGrad, op.micro, g}};
  }
  return {};
}

double CostOf(const PipeOp& op, const PipeCosts& costs) {
  switch (op.kind) {
    case PipeOp::Kind::kForward:
      return costs.forward;
    case PipeOp::Kind::kBackward:
      return costs.backward;
    case PipeOp::Kind::kBackwardInput:
      return costs.backward_input;
    case PipeOp::Kind::kBackwardWeight:
      return costs.backward_weight;
  }
  return 0;
}

// When everything `op` waits for is done, the latest finish among it; nullopt while any is not.
std::optional<double> InputsReady(const std::map<Key, double>& done, const PipeOp& op, int rank,
                                  int stages, int global) {
  double ready = 0;
  for (const Key& key : InputsOf(op, rank, stages, global)) {
    auto it = done.find(key);
    if (it == done.end()) return std::nullopt;
    ready = std::max(ready, it->second);
  }
  return ready;
}

}  // namespace

std::vector<PipeOp> BuildZeroBubbleSchedule(int stages, int stage, int microbatches) {
  using Kind = PipeOp::Kind;
  // 1F1B's order with each backward's input half, the weight halves `stage` input gradients
  // late: while a later stage's input gradients travel back, the earlier stages' weight passes
  // fill the wait, and on the last stages they make way for the input gradients the earlier
  // ones are waiting for. Each stage then holds at most P micro-batches (forward run, weight
  // pass not yet): the first stage's 1F1B figure.
  std::vector<PipeOp> ops;
  std::deque<int> due;
  for (PipeOp op :
       BuildPipelineSchedule(config::PipelineSchedule::k1F1B, stages, stage, microbatches)) {
    if (op.kind != Kind::kBackward) {
      ops.push_back(op);
      continue;
    }
    ops.push_back({Kind::kBackwardInput, op.micro});
    due.push_back(op.micro);
    if (static_cast<int>(due.size()) > stage) {
      ops.push_back({Kind::kBackwardWeight, due.front()});
      due.pop_front();
    }
  }
  for (int micro : due) ops.push_back({Kind::kBackwardWeight, micro});
  return ops;
}

PipeRun SimulatePipeline(const std::vector<std::vector<PipeOp>>& ranks, int virtual_stages,
                         const PipeCosts& costs) {
  const int stages = static_cast<int>(ranks.size());
  const int global = stages * virtual_stages;
  std::map<Key, double> done;
  std::vector<size_t> next(ranks.size(), 0);
  std::vector<double> free_at(ranks.size(), 0);
  double busy = 0;
  PipeRun run;
  size_t left = 0;
  for (const auto& ops : ranks) left += ops.size();
  while (left > 0) {
    // Any operation whose inputs are done can be placed: its start depends only on them and on
    // its rank's previous operation, so the order of placing does not change the times.
    size_t best = ranks.size();
    double best_start = 0;
    for (size_t p = 0; p < ranks.size(); ++p) {
      if (next[p] == ranks[p].size()) continue;
      const std::optional<double> ready =
          InputsReady(done, ranks[p][next[p]], static_cast<int>(p), stages, global);
      if (!ready) continue;
      const double start = std::max(*ready, free_at[p]);
      if (best == ranks.size() || start < best_start) {
        best = p;
        best_start = start;
      }
    }
    if (best == ranks.size()) {
      for (size_t p = 0; p < ranks.size(); ++p)
        if (next[p] < ranks[p].size())
          run.stuck += (run.stuck.empty() ? "" : ", ") + std::string("stage ") + std::to_string(p) +
                       " at " + ScheduleToString({ranks[p][next[p]]});
      return run;
    }
    const PipeOp& op = ranks[best][next[best]++];
    const double cost = CostOf(op, costs);
    free_at[best] = best_start + cost;
    busy += cost;
    run.makespan = std::max(run.makespan, free_at[best]);
    for (const Key& key : OutputsOf(op, static_cast<int>(best), stages)) done[key] = free_at[best];
    --left;
  }
  run.completed = true;
  run.bubble = run.makespan > 0 ? 1 - busy / (stages * run.makespan) : 0;
  return run;
}

int PeakLiveMicrobatches(const std::vector<PipeOp>& ops) {
  int live = 0, peak = 0;
  for (const PipeOp& op : ops) {
    if (op.kind == PipeOp::Kind::kForward) ++live;
    if (op.kind == PipeOp::Kind::kBackward || op.kind == PipeOp::Kind::kBackwardWeight) --live;
    peak = std::max(peak, live);
  }
  return peak;
}

std::string ScheduleToString(const std::vector<PipeOp>& ops) {
  std::string out;
  for (const PipeOp& op : ops) {
    if (!out.empty()) out += ' ';
    out += "FBIW"[static_cast<int>(op.kind)];
    out += std::to_string(op.micro);
    if (op.chunk != 0) out += "@" + std::to_string(op.chunk);
  }
  return out;
}

bool ReceiveOrderMatches(const std::vector<std::vector<PipeOp>>& ranks, int virtual_stages,
                         std::string* mismatch) {
  const int stages = static_cast<int>(ranks.size());
  const int global = stages * virtual_stages;
  // (sender, receiver, gradient?) -> the receiving ops' (chunk, micro), in the order sent, and
  // in the order received.
  using Link = std::tuple<int, int, bool>;
  std::map<Link, std::vector<std::pair<int, int>>> sent, received;
  for (int r = 0; r < stages; ++r) {
    const int next = (r + 1) % stages, prev = (r + stages - 1) % stages;
    for (const PipeOp& op : ranks[static_cast<size_t>(r)]) {
      const int g = op.chunk * stages + r;
      if (op.kind == PipeOp::Kind::kForward) {
        if (g > 0) received[{prev, r, false}].push_back({op.chunk, op.micro});
        if (g < global - 1) sent[{r, next, false}].push_back({(g + 1) / stages, op.micro});
      } else if (op.kind == PipeOp::Kind::kBackward || op.kind == PipeOp::Kind::kBackwardInput) {
        if (g < global - 1) received[{next, r, true}].push_back({op.chunk, op.micro});
        if (g > 0) sent[{r, prev, true}].push_back({(g - 1) / stages, op.micro});
      }
    }
  }
  for (const auto& [link, order] : sent) {
    if (received[link] == order) continue;
    const auto& [from, to, grad] = link;
    if (mismatch)
      *mismatch = std::string(grad ? "gradients" : "activations") + " from rank " +
                  std::to_string(from) + " to rank " + std::to_string(to) +
                  " are received in another order than sent";
    return false;
  }
  for (const auto& [link, order] : received) {
    if (order.empty() || sent.count(link)) continue;
    if (mismatch)
      *mismatch = "rank " + std::to_string(std::get<1>(link)) + " waits for messages rank " +
                  std::to_string(std::get<0>(link)) + " never sends";
    return false;
  }
  return true;
}

double TheoreticalBubble(int stages, int microbatches, config::PipelineSchedule schedule,
                         int virtual_stages) {
  // Idle pass times per stage over the step's, in units of a forward pass of one chunk.
  int work = microbatches;  // GPipe, 1F1B: M forwards (and 2M for the backwards, in 3(M+P-1))
  if (schedule == config::PipelineSchedule::kInterleaved1F1B) work = virtual_stages * microbatches;
  if (schedule == config::PipelineSchedule::kZeroBubble) work = 3 * microbatches;
  return static_cast<double>(stages - 1) / static_cast<double>(work + stages - 1);
}

StatusOr<std::vector<int64_t>> PartitionLayers(const std::vector<int64_t>& layer_costs,
                                               int pipeline_stages,
                                               const std::vector<int64_t>& explicit_partition,
                                               int virtual_stages) {
  const int64_t layers = static_cast<int64_t>(layer_costs.size());
  const int stages = pipeline_stages * virtual_stages;  // the chunks the model is cut into
  const std::string what =
      virtual_stages > 1
          ? "train.parallel.stages x virtual_stages (" + std::to_string(pipeline_stages) + " x " +
                std::to_string(virtual_stages) + " = " + std::to_string(stages) + ")"
          : "train.parallel.stages " + std::to_string(stages);
  if (stages > layers)
    return Status::InvalidConfig(what + " is more than the model's " + std::to_string(layers) +
                                 " layers (train.model.layers); every chunk needs at least one");
  if (!explicit_partition.empty()) {
    if (static_cast<int>(explicit_partition.size()) != stages)
      return Status::InvalidConfig("train.parallel.partition has " +
                                   std::to_string(explicit_partition.size()) + " entries but " +
                                   what + " asks for " + std::to_string(stages));
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
