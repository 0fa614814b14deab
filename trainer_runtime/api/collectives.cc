#include "trainer_runtime/api/accelerator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/api/accelerator_internal.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {

// --- Across ranks ----------------------------------------------------------------------------

torch::Tensor& Accelerator::AllReduceSum(torch::Tensor& t) {
  Guarded([&] { SumInPlace(t); });
  return t;
}

void Accelerator::SumInPlace(torch::Tensor& t) {
  // Through shared memory when the group has it: the trainer agrees on signals with this after
  // every step, and a Gloo round trip costs 0.2-2 ms on 2 busy cores (most of a small model's
  // step) against ~20 us. Not counted as gradient communication either way.
  ShmAllReduce* shm = pg_ ? pg_->shm() : nullptr;
  if (shm && ShmAllReduce::Supports({t}, c10d::AllreduceOptions())) {
    // In the collective ring as the group's own operations are: a rank stuck here is as much a
    // hang as one stuck in a gradient all-reduce.
    const uint64_t token = pg_->RingBegin(CollectiveOp::kAllReduce, t.numel() * t.element_size());
    const Status status = shm->AllReduceNow(t);
    pg_->RingDone(token, status.ok());
    if (!status.ok()) throw compat::MakeError(status.ToString());
    return;
  }
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {t};
    const uint64_t token = pg_->RingBegin(CollectiveOp::kAllReduce, t.numel() * t.element_size());
    try {
      pg->allreduce(v, c10d::AllreduceOptions())->wait();
    } catch (...) {
      pg_->RingDone(token, /*ok=*/false);  // ended, failed: not "started" forever in the ring
      throw;
    }
    pg_->RingDone(token);
  }
}

double Accelerator::Mean(double value) {
  auto t = torch::tensor({value}, torch::kDouble);
  AllReduceSum(t);
  return t.item<double>() / world_size();
}

double Accelerator::MeanLoss(double loss) {
  const bool holds = !strategy_ || strategy_->HoldsLoss();
  auto t = torch::tensor({holds ? loss : 0.0, holds ? 1.0 : 0.0}, torch::kDouble);
  AllReduceSum(t);
  return t[0].item<double>() / std::max(1.0, t[1].item<double>());
}

torch::Tensor Accelerator::Gather(const torch::Tensor& t) { return torch::cat(GatherList(t)); }

void Accelerator::Barrier() {
  if (c10d::ProcessGroup* pg = control()) {
    const uint64_t token = pg_->RingBegin(CollectiveOp::kBarrier, 0);
    bool ok = false;
    try {
      ok = Guarded([&] { pg->barrier(c10d::BarrierOptions())->wait(); });
    } catch (...) {
      pg_->RingDone(token, /*ok=*/false);
      throw;
    }
    pg_->RingDone(token, ok);
  }
}

bool Accelerator::CheckTrigger() {
  auto t = torch::tensor({trigger_ ? 1.0 : 0.0}, torch::kDouble);
  AllReduceSum(t);
  trigger_ = false;
  return t.item<double>() > 0;
}

// --- Internal --------------------------------------------------------------------------------

Accelerator::CommStats Accelerator::TakeCommStats() {
  CommStats out;
  if (strategy_) {  // prepared
    // Each strategy counts the group's all-reduces since its last call, so the first pair's
    // count holds every pair's; the time waited is each pair's own.
    for (size_t i = 0; i < pairs_.size(); ++i) {
      StepCommStats s = pairs_[i].strategy->TakeStepStats();
      if (i == 0) {
        out.allreduces = s.allreduces;
        out.reduce_scatters = s.reduce_scatters;
        out.allgathers = s.allgathers;
      }
      out.blocking_comm_ms += s.blocking_comm_ms;
      out.launched_before_grads_done += s.launched_before_grads_done;
    }
  }
  return out;
}

int64_t Accelerator::num_buckets() const { return strategy_ ? strategy_->num_buckets() : 0; }

// Gradient communication is the gradient group's (the world's unless other axes split it), over
// the whole run: the groups before an in-place recovery's are carried.
Accelerator::RunCounts Accelerator::RunTotals() const {
  RunCounts t = carried_;
  if (data_pg_) {
    t.allreduces += data_pg_->allreduce_count();
    t.reduce_scatters += data_pg_->reduce_scatter_count();
    t.allgathers += data_pg_->allgather_count();
  }
  if (pg_) t.pair_exchanges += pg_->recorded_count();
  if (context_pg_) t.alltoalls += context_pg_->alltoall_count();
  t.recoveries = recoveries_;
  return t;
}

int64_t AcceleratorInternals::allreduces_total() const { return a_.RunTotals().allreduces; }

int64_t AcceleratorInternals::pair_exchanges_total() const { return a_.RunTotals().pair_exchanges; }

int64_t AcceleratorInternals::reduce_scatters_total() const {
  return a_.RunTotals().reduce_scatters;
}

int64_t AcceleratorInternals::allgathers_total() const { return a_.RunTotals().allgathers; }

int64_t AcceleratorInternals::alltoalls_total() const { return a_.RunTotals().alltoalls; }

std::vector<int64_t> AcceleratorInternals::StateBytes() const {
  const trainer::StateBytes b = a_.strategy_->MemoryBytes(*a_.optimizer_);
  return {b.parameters, b.gradients, b.optimizer};
}

std::vector<double> AcceleratorInternals::GatherPipelineStats(uint64_t checksum) {
  PipelineEngine* engine = pipeline();
  LAUNCH_CHECK(engine != nullptr, "GatherPipelineStats: not a pipeline");
  constexpr int kFields = PipelineEngine::kStatFields;
  const ParallelLayout& layout = *a_.layout_;
  auto gathered = torch::zeros({layout.degree(Axis::kStage) * kFields}, torch::kDouble);
  // The first replica's tensor rank 0 speaks for its stage.
  if (layout.coordinate(Axis::kData) == 0 && layout.coordinate(Axis::kTensor) == 0) {
    std::vector<double> mine = engine->Stats(checksum);
    auto g = gathered.accessor<double, 1>();
    const int stage = layout.coordinate(Axis::kStage);
    for (int f = 0; f < kFields; ++f) g[stage * kFields + f] = mine[static_cast<size_t>(f)];
  }
  a_.AllReduceSum(gathered);
  return std::vector<double>(gathered.data_ptr<double>(),
                             gathered.data_ptr<double>() + gathered.numel());
}

PipelineEngine* AcceleratorInternals::pipeline() const {
  return dynamic_cast<PipelineEngine*>(a_.strategy_.get());
}

CountingProcessGroup* AcceleratorInternals::process_group() const { return a_.pg_.get(); }

Model* AcceleratorInternals::model() const { return a_.model_.get(); }

// --- Evaluation, held objects and collectives of any shape ----------------------------------

IndexRange Accelerator::SplitBetweenProcesses(int64_t n) const {
  return SplitBetween(n, rank(), world_size());
}

std::vector<torch::Tensor> Accelerator::GatherList(const torch::Tensor& t) {
  const torch::Tensor mine = (t.dim() == 0 ? t.reshape({1}) : t).contiguous();
  c10d::ProcessGroup* pg = control();
  if (!pg) return {mine.clone()};
  // Gloo gathers equal shapes: first the sizes, then every rank's rows padded to the largest.
  std::vector<std::vector<at::Tensor>> sizes(1);
  for (int r = 0; r < world_size(); ++r) sizes[0].push_back(torch::empty({1}, torch::kLong));
  std::vector<at::Tensor> size_in = {torch::tensor({mine.size(0)}, torch::kLong)};
  pg->allgather(sizes, size_in, c10d::AllgatherOptions())->wait();
  int64_t largest = 0;
  for (const auto& s : sizes[0]) largest = std::max(largest, s.item<int64_t>());
  std::vector<int64_t> shape = mine.sizes().vec();
  shape[0] = largest;
  torch::Tensor padded = torch::zeros(shape, mine.options());
  padded.slice(0, 0, mine.size(0)).copy_(mine);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int r = 0; r < world_size(); ++r) out[0].push_back(torch::empty_like(padded));
  std::vector<at::Tensor> in = {padded};
  pg->allgather(out, in, c10d::AllgatherOptions())->wait();
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world_size(); ++r)
    parts.push_back(out[0][static_cast<size_t>(r)].slice(0, 0, sizes[0][r].item<int64_t>()));
  return parts;
}

torch::Tensor Accelerator::GatherForMetrics(const torch::Tensor& t) {
  const std::vector<torch::Tensor> parts = GatherList(t);
  // Rank r's row j is the batch's sample r + j*W (EvalSampler): row 0 of every rank in rank
  // order, then row 1, ... A rank has at most one row fewer than the rank before it.
  std::vector<int64_t> order;
  int64_t offset = 0;
  std::vector<int64_t> first(parts.size());
  for (size_t r = 0; r < parts.size(); ++r) {
    first[r] = offset;
    offset += parts[r].size(0);
  }
  for (int64_t j = 0; j < (parts.empty() ? 0 : parts[0].size(0)); ++j)
    for (size_t r = 0; r < parts.size(); ++r)
      if (j < parts[r].size(0)) order.push_back(first[r] + j);
  LAUNCH_CHECK(static_cast<int64_t>(order.size()) == offset,
               "GatherForMetrics: rank 0 has fewer rows than a later rank; pass the rows of an "
               "EvalDataLoader batch");
  const torch::Tensor all = torch::cat(parts);
  return all.index_select(0, torch::tensor(order, torch::kLong).to(all.device()));
}

torch::Tensor Accelerator::PadAcrossProcesses(const torch::Tensor& t, int64_t dim, double pad_value,
                                              bool pad_first) {
  LAUNCH_CHECK(t.dim() > 0 && dim >= -t.dim() && dim < t.dim(),
               "PadAcrossProcesses: dim out of range");
  if (dim < 0) dim += t.dim();
  auto size = torch::tensor({t.size(dim)}, torch::kLong);
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {size};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::MAX;
    pg->allreduce(v, opts)->wait();
  }
  const int64_t largest = size.item<int64_t>();
  if (largest == t.size(dim)) return t;
  std::vector<int64_t> shape = t.sizes().vec();
  shape[static_cast<size_t>(dim)] = largest;
  torch::Tensor out = torch::full(shape, pad_value, t.options());
  const int64_t begin = pad_first ? largest - t.size(dim) : 0;
  out.slice(dim, begin, begin + t.size(dim)).copy_(t);
  return out;
}

torch::Tensor& Accelerator::Broadcast(torch::Tensor& t, int src) {
  LAUNCH_CHECK(src >= 0 && src < world_size(), "Broadcast: src is not a rank");
  if (c10d::ProcessGroup* pg = control()) {
    std::vector<at::Tensor> v = {t};
    c10d::BroadcastOptions opts;
    opts.rootRank = src;
    pg->broadcast(v, opts)->wait();
  }
  return t;
}

std::string Accelerator::BroadcastObject(const std::string& bytes, int src) {
  auto size = torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong);
  Broadcast(size, src);
  auto data = torch::empty({size.item<int64_t>()}, torch::kUInt8);
  if (rank() == src && !bytes.empty()) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  Broadcast(data, src);
  return std::string(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
}

bool Accelerator::AveragesGradients() const {
  return strategy_ && data_parallel_size() > 1 && strategy_->AveragesGradients();
}

void Accelerator::CheckNoUnsyncedGradients() const {
  if (!AveragesGradients()) return;
  // Only reached when no Backward ran since the last step, so a normal loop never pays for it.
  bool any = false;
  for (const torch::Tensor& p : model_->Parameters())
    if (p.grad().defined() && p.grad().ne(0).any().item<bool>()) any = true;
  LAUNCH_CHECK(!any, "Step(): rank " + std::to_string(rank()) +
                         " has gradients that no Accelerator::Backward produced since the last "
                         "step, so they were not averaged over the ranks and each rank would "
                         "train on its own (the replicas drift apart). Replace loss.backward() "
                         "with accel->Backward(loss), or use accel->ForwardBackward");
}

void Accelerator::CheckNoStrayGradients() {
  if (!AveragesGradients()) return;
  bool stray = false;
  for (Pair& pair : pairs_)
    if (pair.strategy && pair.strategy->TakeStrayGradients()) stray = true;
  LAUNCH_CHECK(!stray, "rank " + std::to_string(rank()) +
                           ": a backward pass outside Accelerator::Backward (loss.backward()) "
                           "computed gradients of a prepared model; they were not averaged over "
                           "the ranks, so stepping on them trains each rank on its own (the "
                           "replicas drift apart). Replace loss.backward() with "
                           "accel->Backward(loss) and optimizer.step() with accel->Step()");
}

Status Accelerator::CheckReplicasAgree() {
  if (!strategy_ || !pg_ || !strategy_->ReplicasBitEqual()) return Status::Ok();
  // Along the replica axis (context x data): each rank against the first rank that holds the
  // same part of the model (the same stage and tensor coordinates).
  const uint64_t mine = ParameterChecksum(model_->Parameters());
  const torch::Tensor all = Gather(torch::tensor({static_cast<int64_t>(mine)}, torch::kLong));
  std::vector<std::string> differ;
  bool against_zero = true;  // every reference is rank 0 (the data axis is the world)
  for (int r = 0; r < world_size(); ++r) {
    const int reference = layout_->GroupRanksOf(r, AxisOf(Use::kGradient)).front();
    against_zero = against_zero && reference == 0;
    if (all[r].item<int64_t>() != all[reference].item<int64_t>())
      differ.push_back(std::to_string(r) +
                       (reference == 0 ? "" : " (against rank " + std::to_string(reference) + ")"));
  }
  if (differ.empty()) return Status::Ok();
  return Status::Internal(
      "Finish: the replicas disagree: the parameters of rank(s) " + Join(differ, ", ") +
      (against_zero ? " differ from rank 0's (" : " differ from their first replica's (") +
      std::string(strategy_->Name()) +
      " keeps them bit-identical; were gradients computed outside Backward, or parameters "
      "changed outside Step?)");
}

}  // namespace launch::trainer
