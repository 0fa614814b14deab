#include "trainer_runtime/parallel/pipeline_engine.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cmath>
#include <filesystem>
#include <map>

#include "base/check.h"
#include "base/files.h"
#include "base/host.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/autocast.h"
#include "trainer_runtime/model/split_backward.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Activations travel with a fixed-size header: ndim, up to 6 sizes, scalar type, and the chunk
// and micro-batch of the op that takes it (a check that the two ranks' schedules agree).
constexpr int kHeaderLen = 10;
constexpr int kMaxDims = 6;
constexpr int kDtypeAt = 7, kChunkAt = 8, kMicroAt = 9;
constexpr int kActivationTag = 0;
constexpr int kGradientTag = 1;

}  // namespace

PipelineEngine::PipelineEngine(const config::TrainConfig& cfg, const Platform& platform,
                               const ParallelLayout& layout,
                               c10::intrusive_ptr<CountingProcessGroup> world)
    : layout_(layout),
      microbatches_(cfg.parallel.microbatches),
      device_(platform.device()),
      autocast_dtype_(platform.autocast().dtype),
      world_(std::move(world)) {
  const int chunks = cfg.parallel.schedule == config::PipelineSchedule::kInterleaved1F1B
                         ? cfg.parallel.virtual_stages
                         : 1;
  ops_ = BuildPipelineSchedule(cfg.parallel.schedule, stages(), stage(), microbatches_, chunks);
  for (size_t i = 0; i < ops_.size(); ++i) {
    if (ops_[i].kind == PipeOp::Kind::kBackward || ops_[i].kind == PipeOp::Kind::kBackwardInput)
      last_backward_ = i;
    if (ops_[i].kind == PipeOp::Kind::kBackwardWeight) sync_after_ = true;
  }
  sync_after_ = sync_after_ || chunks > 1;
  // Under autocast the Linear maths run in a lower precision than the store's (split_backward.h):
  // the input passes then do the whole backward and the weight passes nothing.
  split_backward_ = cfg.parallel.schedule == config::PipelineSchedule::kZeroBubble &&
                    autocast_dtype_ == c10::ScalarType::Undefined;
}

StatusOr<std::unique_ptr<PipelineEngine>> PipelineEngine::Create(
    const config::TrainConfig& cfg, const Platform& platform, const ParallelLayout& layout,
    c10::intrusive_ptr<CountingProcessGroup> world, c10::intrusive_ptr<CountingProcessGroup> stage,
    std::shared_ptr<Model> model, std::vector<ForwardFn> forwards,
    std::unique_ptr<ParallelStrategy> data) {
  std::unique_ptr<PipelineEngine> engine(new PipelineEngine(cfg, platform, layout, world));
  const size_t chunks =
      static_cast<size_t>(engine->ops_.empty() ? 1
                                               : std::max_element(
                                                     engine->ops_.begin(), engine->ops_.end(),
                                                     [](const PipeOp& a, const PipeOp& b) {
                                                       return a.chunk < b.chunk;
                                                     })->chunk +
                                                     1);
  if (forwards.size() != chunks)
    return Status::InvalidConfig("the pipeline's schedule (train.parallel.schedule " +
                                 std::string(config::ToString(cfg.parallel.schedule)) + ") runs " +
                                 std::to_string(chunks) + " model chunks on each rank; got " +
                                 std::to_string(forwards.size()));
  if (engine->sync_after_ && data->SyncGradients(/*window_closes=*/false))
    return Status::InvalidConfig(
        "train.parallel.schedule " + std::string(config::ToString(cfg.parallel.schedule)) +
        ": the data strategy reduces every micro-batch (parallel.zero_stage 2 or 3, "
        "sync_each_batch), but under this schedule a parameter's gradient is whole only after "
        "the schedule's last pass over it; use zero_stage 1 or schedule 1f1b");
  engine->stage_pg_ = std::move(stage);
  engine->stage_model_ = std::move(model);
  engine->model_ = engine->stage_model_.get();
  engine->forwards_ = std::move(forwards);
  engine->data_ = std::move(data);
  return engine;
}

void PipelineEngine::ReformGroups(c10::intrusive_ptr<CountingProcessGroup> world,
                                  c10::intrusive_ptr<CountingProcessGroup> stage,
                                  c10::intrusive_ptr<CountingProcessGroup> data) {
  // The abandoned pass' sends failed with the broken group; nothing of them is waited for.
  pending_sends_.clear();
  pending_tensors_.clear();
  world_ = std::move(world);
  stage_pg_ = std::move(stage);
  data_->Reform(std::move(data));
}

Status PipelineSupports(const Platform& platform) {
  // Activations and gradients travel as the device's tensors (NCCL or Gloo send/recv; shared
  // memory between CPU ranks), their shape headers as CPU tensors over Gloo.
  return platform.CheckAutocast();
}

void PipelineEngine::BeforeForward(bool sync) {
  sync_ = sync;
  // Once per pass, as once per micro-batch of an accumulation window outside a pipeline: ddp's
  // bucket rebuild and buffer broadcast, zero's prefetch order.
  data_->BeforeForward(sync);
}

Status PipelineEngine::SaveModelState(const std::string& dir, torch::optim::Optimizer& optimizer) {
  const std::string shard = dir + "/" + layout_.ShardName();
  LAUNCH_RETURN_IF_ERROR(MakeDirs(shard));
  return data_->SaveModelState(shard, optimizer);
}

Status PipelineEngine::LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                                      int64_t written_by) {
  const std::string shard = dir + "/" + layout_.ShardName();
  std::error_code ec;
  if (!std::filesystem::is_directory(shard, ec))
    return Status::InvalidConfig("the checkpoint in " + dir + " has no folder " +
                                 layout_.ShardName() + " for this rank's stage (" +
                                 layout_.Describe() +
                                 "): it was written by another layout (train.parallel.stages)");
  return data_->LoadModelState(shard, optimizer, written_by);
}

StepCommStats PipelineEngine::TakeStepStats() {
  StepCommStats out = data_->TakeStepStats();
  out.blocking_comm_ms += clip_ms_;
  clip_ms_ = 0;
  return out;
}

void PipelineEngine::SendActivation(const torch::Tensor& t, int chunk, int micro) {
  TORCH_CHECK(t.dim() <= kMaxDims, "pipeline activations may have at most ", kMaxDims,
              " dimensions, got ", t.dim());
  auto header = torch::zeros({kHeaderLen}, torch::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) h[1 + i] = t.size(i);
  h[kDtypeAt] = static_cast<int64_t>(t.scalar_type());
  h[kChunkAt] = chunk;
  h[kMicroAt] = micro;
  torch::Tensor body = t.contiguous();
  for (torch::Tensor* part : {&header, &body}) {
    std::vector<at::Tensor> v = {*part};
    pending_sends_.push_back(world_->send(v, Next(), kActivationTag));
    pending_tensors_.push_back(*part);
  }
}

torch::Tensor PipelineEngine::RecvActivation(int chunk, int micro) {
  Timeline::Scope span("pipeline", "idle: receive activation from rank " + std::to_string(Prev()));
  auto header = torch::empty({kHeaderLen}, torch::kLong);
  std::vector<at::Tensor> hv = {header};
  world_->recv(hv, Prev(), kActivationTag)->wait();
  auto h = header.accessor<int64_t, 1>();
  TORCH_CHECK(h[0] >= 0 && h[0] <= kMaxDims, "corrupt activation header from rank ", Prev());
  TORCH_CHECK(h[kChunkAt] == chunk && h[kMicroAt] == micro, "pipeline: rank ", Prev(),
              " sent the activation of micro-batch ", h[kMicroAt], " for chunk ", h[kChunkAt],
              " where this rank runs micro-batch ", micro, " of chunk ", chunk,
              ": the two ranks run different schedules");
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < h[0]; ++i) sizes.push_back(h[1 + i]);
  auto body = torch::empty(
      sizes,
      torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[kDtypeAt])).device(device_));
  std::vector<at::Tensor> bv = {body};
  world_->recv(bv, Prev(), kActivationTag)->wait();
  return body;
}

void PipelineEngine::WaitSends() {
  Timeline::Scope span("pipeline", "idle: sends complete");
  for (auto& work : pending_sends_) work->wait();
  pending_sends_.clear();
  pending_tensors_.clear();
}

torch::Tensor PipelineEngine::ForwardBackward(const torch::Tensor& x, const torch::Tensor& y,
                                              const ChunkLossFn&, const CriterionFn& criterion,
                                              double scale) {
  TORCH_CHECK(criterion, "the pipeline's last stage needs a criterion (Accelerator::SetCriterion)");
  // The rows this batch really has (not train.batch_size): an empty micro-batch's mean loss
  // is nan. Every stage sees the same rows, so all refuse alike, before any communication.
  const int64_t batch = first() ? x.size(0) : y.size(0);
  const Status rows_ok = CheckRowsFor(batch, microbatches_, "train.parallel.microbatches");
  if (!rows_ok.ok()) throw compat::MakeError(rows_ok.message());
  const auto chunks = SplitRows(batch, microbatches_);
  // Which backward passes the data strategy synchronises: the window's last, or every one
  // where it reduces each micro-batch (zero stages 2 and 3, sync_each_batch); none when it
  // synchronises after the schedule.
  const bool every = data_->SyncGradients(/*window_closes=*/false);
  struct Live {
    torch::Tensor input;   // requires grad on every chunk but the model's first
    torch::Tensor output;  // activation sent on, or the weighted loss on the last chunk
    int64_t bytes = 0;
    c10::intrusive_ptr<WeightGradStore> weights;  // split backwards: the weight pass' inputs
  };
  using Key = std::pair<int, int>;  // (chunk, micro-batch)
  std::map<Key, Live> live;         // forward ran, input gradient not yet
  std::map<Key, Live> waiting;      // input gradient ran, weight pass not yet
  int64_t live_bytes = 0;
  double busy = 0, loss_sum = 0;
  auto name = [&](const char* what, const PipeOp& op) {
    std::string out = std::string(what) + " micro-batch " + std::to_string(op.micro);
    if (virtual_stages() > 1) out += " chunk " + std::to_string(op.chunk);
    return out;
  };
  const auto window_start = Clock::now();
  for (size_t i = 0; i < ops_.size(); ++i) {
    const PipeOp& op = ops_[i];
    const Key key{op.chunk, op.micro};
    const auto [offset, rows] = chunks[static_cast<size_t>(op.micro)];
    const double weight = scale * static_cast<double>(rows) / static_cast<double>(batch);
    if (op.kind == PipeOp::Kind::kForward) {
      torch::Tensor input =
          FirstChunk(op.chunk) ? x.narrow(0, offset, rows) : RecvActivation(op.chunk, op.micro);
      if (!FirstChunk(op.chunk) && input.is_floating_point()) input.requires_grad_(true);
      const auto t0 = Clock::now();
      Timeline::Scope span("pipeline", name("forward", op));
      Live entry{input, torch::Tensor(), 0, {}};
      torch::Tensor out;
      if (split_backward_) {
        entry.weights = c10::make_intrusive<WeightGradStore>();
        WeightGradStore::Scope split(entry.weights.get());
        out = StageForward(op.chunk, input);
      } else {
        out = StageForward(op.chunk, input);
      }
      entry.output = out;
      if (LastChunk(op.chunk)) {
        torch::Tensor loss;
        {
          AutocastScope amp(device_.type(), autocast_dtype_);
          loss = criterion(out, y.narrow(0, offset, rows));
        }
        loss_sum += loss.item<double>() * static_cast<double>(rows) / static_cast<double>(batch);
        entry.output = loss * weight;
      }
      busy += Seconds(Clock::now() - t0);
      // The next rank's chunk: the same one, or from the last rank the next one on the first.
      if (!LastChunk(op.chunk)) SendActivation(out.detach(), op.chunk + (last() ? 1 : 0), op.micro);
      entry.bytes = input.numel() * input.element_size() + out.numel() * out.element_size();
      live_bytes += entry.bytes;
      live.emplace(key, std::move(entry));
    } else if (op.kind == PipeOp::Kind::kBackward || op.kind == PipeOp::Kind::kBackwardInput) {
      auto it = live.find(key);
      TORCH_CHECK(it != live.end(), "schedule runs backward of micro-batch ", op.micro, " chunk ",
                  op.chunk, " before its forward");
      Live entry = std::move(it->second);
      live.erase(it);
      torch::Tensor grad;
      if (!LastChunk(op.chunk)) {
        grad = torch::empty_like(entry.output);
        std::vector<at::Tensor> gv = {grad};
        Timeline::Scope span("pipeline",
                             "idle: receive gradient from rank " + std::to_string(Next()));
        world_->recv(gv, Next(), kGradientTag)->wait();
      }
      const bool sync = !sync_after_ && sync_ && (every || i == last_backward_);
      const auto t0 = Clock::now();
      Timeline::Scope span(
          "pipeline",
          name(op.kind == PipeOp::Kind::kBackward ? "backward" : "backward (input gradient)", op));
      data_->BeforeBackward(entry.output, sync);
      if (LastChunk(op.chunk)) {
        torch::autograd::backward({entry.output});
      } else {
        torch::autograd::backward({entry.output}, {grad});
      }
      data_->AfterBackward(sync);
      busy += Seconds(Clock::now() - t0);
      if (!FirstChunk(op.chunk)) {
        torch::Tensor g = entry.input.grad().contiguous();
        std::vector<at::Tensor> v = {g};
        pending_sends_.push_back(world_->send(v, Prev(), kGradientTag));
        pending_tensors_.push_back(g);
      }
      if (op.kind == PipeOp::Kind::kBackwardInput) {
        // What the weight pass needs stays: the store's inputs and output gradients.
        const int64_t kept = entry.weights ? entry.weights->bytes() : 0;
        live_bytes += kept - entry.bytes;
        waiting.emplace(key, Live{{}, {}, kept, std::move(entry.weights)});
      } else {
        live_bytes -= entry.bytes;
      }
    } else {
      auto it = waiting.find(key);
      TORCH_CHECK(it != waiting.end(), "schedule runs the weight pass of micro-batch ", op.micro,
                  " chunk ", op.chunk, " before its input gradient");
      Live entry = std::move(it->second);
      waiting.erase(it);
      const auto t0 = Clock::now();
      Timeline::Scope span("pipeline", name("backward (weight gradients)", op));
      if (entry.weights) {
        data_->BeforeBackward(torch::Tensor(), /*sync=*/false);
        entry.weights->Flush();
        data_->AfterBackward(/*sync=*/false);
      }
      busy += Seconds(Clock::now() - t0);
      live_bytes -= entry.bytes;
    }
    totals_.peak_live = std::max(totals_.peak_live, static_cast<int>(live.size() + waiting.size()));
    totals_.peak_boundary_bytes = std::max(totals_.peak_boundary_bytes, live_bytes);
  }
  WaitSends();
  if (sync_after_ && sync_ && data_->SyncGradients(/*window_closes=*/true)) {
    const auto t0 = Clock::now();
    SyncAfterSchedule();
    busy += Seconds(Clock::now() - t0);
  }
  totals_.busy_s += busy;
  totals_.window_s += Seconds(Clock::now() - window_start);
  return torch::tensor(loss_sum, torch::kDouble);
}

void PipelineEngine::SyncAfterSchedule() {
  Timeline::Scope span("pipeline", "synchronise gradients after the schedule");
  // A backward whose only work is the gradient hooks: zero added to each gradient this rank
  // has, so the data strategy reduces them as at the end of a window's last backward. A
  // parameter without a gradient stays without (ddp's find_unused_parameters sees it unused).
  torch::Tensor root;
  for (const torch::Tensor& p : stage_model_->Parameters()) {
    if (!p.grad().defined()) continue;
    torch::Tensor zero = (p * 0).sum();
    root = root.defined() ? root + zero : zero;
  }
  if (!root.defined()) return;
  data_->BeforeBackward(root, /*sync=*/true);
  torch::autograd::backward({root});
  data_->AfterBackward(/*sync=*/true);
}

double PipelineEngine::GradNormSquared() {
  // The squares of this stage (summed over the data group's shards where it shards), then over
  // the stages.
  auto total = torch::tensor({data_->GradNormSquared()}, torch::kDouble);
  AllReduceSum(stage_pg_, total);
  return total.item<double>();
}

double PipelineEngine::ClipGradNorm(double max_norm) {
  const auto start = Clock::now();
  const double norm = std::sqrt(GradNormSquared());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) data_->ScaleGradients(coef);
  clip_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return norm;
}

torch::Tensor PipelineEngine::StageForward(int chunk, const torch::Tensor& input) {
  ForwardFn& forward = forwards_[static_cast<size_t>(chunk)];
  if (autocast_dtype_ == c10::ScalarType::Undefined) return forward(input);
  torch::Tensor out;
  {
    AutocastScope amp(device_.type(), autocast_dtype_);
    out = forward(input);
  }
  // Activations cross stage boundaries as float32: the receiving stage's buffers, its input
  // gradient and every stage's parameters stay float32, as in the other modes.
  return out.is_floating_point() ? out.to(torch::kFloat) : out;
}

torch::Tensor PipelineEngine::Forward(const torch::Tensor& inputs) {
  torch::NoGradGuard no_grad;
  torch::Tensor out;
  for (int c = 0; c < virtual_stages(); ++c) {
    torch::Tensor in = FirstChunk(c) ? inputs : RecvActivation(c, -1);
    out = StageForward(c, in);
    if (!LastChunk(c)) SendActivation(out, c + (last() ? 1 : 0), -1);
  }
  WaitSends();
  return last() ? out : torch::Tensor();
}

std::vector<double> PipelineEngine::Stats(uint64_t checksum) const {
  return {static_cast<double>(totals_.peak_live),
          totals_.window_s > 0 ? 1.0 - totals_.busy_s / totals_.window_s : 0.0,
          totals_.busy_s,
          totals_.window_s,
          PeakRssMb(),
          static_cast<double>(checksum >> 32),
          static_cast<double>(checksum & 0xffffffffull),
          static_cast<double>(totals_.peak_boundary_bytes)};
}

void PipelineEngine::ResetTimings() { totals_.busy_s = totals_.window_s = 0; }

}  // namespace launch::trainer
