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
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// Activations travel with a fixed-size header: ndim, up to 6 sizes, scalar type.
constexpr int kHeaderLen = 8;
constexpr int kMaxDims = kHeaderLen - 2;
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
  ops_ = BuildPipelineSchedule(cfg.parallel.schedule, stages(), stage(), microbatches_);
  for (size_t i = 0; i < ops_.size(); ++i) {
    // This engine runs one chunk per rank and whole backwards (GPipe, 1F1B); the interleaved
    // and zero-bubble schedules of pipeline_schedule.h are not run by it yet.
    LAUNCH_CHECK(ops_[i].chunk == 0 && (ops_[i].kind == PipeOp::Kind::kForward ||
                                        ops_[i].kind == PipeOp::Kind::kBackward));
    if (ops_[i].kind == PipeOp::Kind::kBackward) last_backward_ = i;
  }
}

StatusOr<std::unique_ptr<PipelineEngine>> PipelineEngine::Create(
    const config::TrainConfig& cfg, const DistEnv& env, const Platform& platform,
    const ParallelLayout& layout, c10::intrusive_ptr<CountingProcessGroup> world,
    std::shared_ptr<Model> model, ForwardFn forward, std::unique_ptr<ParallelStrategy> data,
    std::chrono::milliseconds timeout) {
  std::unique_ptr<PipelineEngine> engine(new PipelineEngine(cfg, platform, layout, world));
  LAUNCH_ASSIGN_OR_RETURN(engine->stage_pg_,
                          CreateAxisGroup(layout, Axis::kStage, env, world, timeout));
  engine->stage_model_ = std::move(model);
  engine->model_ = engine->stage_model_.get();
  engine->forward_ = std::move(forward);
  engine->data_ = std::move(data);
  return engine;
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

void PipelineEngine::SendActivation(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() <= kMaxDims, "pipeline activations may have at most ", kMaxDims,
              " dimensions, got ", t.dim());
  auto header = torch::zeros({kHeaderLen}, torch::kLong);
  auto h = header.accessor<int64_t, 1>();
  h[0] = t.dim();
  for (int64_t i = 0; i < t.dim(); ++i) h[1 + i] = t.size(i);
  h[kHeaderLen - 1] = static_cast<int64_t>(t.scalar_type());
  torch::Tensor body = t.contiguous();
  for (torch::Tensor* part : {&header, &body}) {
    std::vector<at::Tensor> v = {*part};
    pending_sends_.push_back(world_->send(v, Next(), kActivationTag));
    pending_tensors_.push_back(*part);
  }
}

torch::Tensor PipelineEngine::RecvActivation() {
  Timeline::Scope span("pipeline", "idle: receive activation from rank " + std::to_string(Prev()));
  auto header = torch::empty({kHeaderLen}, torch::kLong);
  std::vector<at::Tensor> hv = {header};
  world_->recv(hv, Prev(), kActivationTag)->wait();
  auto h = header.accessor<int64_t, 1>();
  TORCH_CHECK(h[0] >= 0 && h[0] <= kMaxDims, "corrupt activation header from rank ", Prev());
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < h[0]; ++i) sizes.push_back(h[1 + i]);
  auto body = torch::empty(sizes, torch::TensorOptions()
                                      .dtype(static_cast<c10::ScalarType>(h[kHeaderLen - 1]))
                                      .device(device_));
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
  // where it reduces each micro-batch (zero stages 2 and 3, sync_each_batch).
  const bool every = data_->SyncGradients(/*window_closes=*/false);
  struct Live {
    torch::Tensor input;   // requires grad on every stage but the first
    torch::Tensor output;  // activation sent on, or the weighted loss on the last stage
    int64_t bytes = 0;
  };
  std::map<int, Live> live;
  int64_t live_bytes = 0;
  double busy = 0, loss_sum = 0;
  const auto window_start = Clock::now();
  for (size_t i = 0; i < ops_.size(); ++i) {
    const PipeOp& op = ops_[i];
    const auto [offset, rows] = chunks[static_cast<size_t>(op.micro)];
    const double weight = scale * static_cast<double>(rows) / static_cast<double>(batch);
    if (op.kind == PipeOp::Kind::kForward) {
      torch::Tensor input = first() ? x.narrow(0, offset, rows) : RecvActivation();
      if (!first() && input.is_floating_point()) input.requires_grad_(true);
      const auto t0 = Clock::now();
      Timeline::Scope span("pipeline", "forward micro-batch " + std::to_string(op.micro));
      torch::Tensor out = StageForward(input);
      Live entry{input, out, 0};
      if (last()) {
        torch::Tensor loss;
        {
          AutocastScope amp(device_.type(), autocast_dtype_);
          loss = criterion(out, y.narrow(0, offset, rows));
        }
        loss_sum += loss.item<double>() * static_cast<double>(rows) / static_cast<double>(batch);
        entry.output = loss * weight;
      }
      busy += Seconds(Clock::now() - t0);
      if (!last()) SendActivation(out.detach());
      entry.bytes = input.numel() * input.element_size() + out.numel() * out.element_size();
      live_bytes += entry.bytes;
      live.emplace(op.micro, std::move(entry));
      totals_.peak_live = std::max(totals_.peak_live, static_cast<int>(live.size()));
      totals_.peak_boundary_bytes = std::max(totals_.peak_boundary_bytes, live_bytes);
    } else {
      auto it = live.find(op.micro);
      TORCH_CHECK(it != live.end(), "schedule runs backward of micro-batch ", op.micro,
                  " before its forward");
      Live entry = std::move(it->second);
      live.erase(it);
      live_bytes -= entry.bytes;
      torch::Tensor grad;
      if (!last()) {
        grad = torch::empty_like(entry.output);
        std::vector<at::Tensor> gv = {grad};
        Timeline::Scope span("pipeline",
                             "idle: receive gradient from rank " + std::to_string(Next()));
        world_->recv(gv, Next(), kGradientTag)->wait();
      }
      const bool sync = sync_ && (every || i == last_backward_);
      const auto t0 = Clock::now();
      Timeline::Scope span("pipeline", "backward micro-batch " + std::to_string(op.micro));
      data_->BeforeBackward(entry.output, sync);
      if (last()) {
        torch::autograd::backward({entry.output});
      } else {
        torch::autograd::backward({entry.output}, {grad});
      }
      data_->AfterBackward(sync);
      busy += Seconds(Clock::now() - t0);
      if (!first()) {
        torch::Tensor g = entry.input.grad().contiguous();
        std::vector<at::Tensor> v = {g};
        pending_sends_.push_back(world_->send(v, Prev(), kGradientTag));
        pending_tensors_.push_back(g);
      }
    }
  }
  WaitSends();
  totals_.busy_s += busy;
  totals_.window_s += Seconds(Clock::now() - window_start);
  return torch::tensor(loss_sum, torch::kDouble);
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

torch::Tensor PipelineEngine::StageForward(const torch::Tensor& input) {
  if (autocast_dtype_ == c10::ScalarType::Undefined) return forward_(input);
  torch::Tensor out;
  {
    AutocastScope amp(device_.type(), autocast_dtype_);
    out = forward_(input);
  }
  // Activations cross stage boundaries as float32: the receiving stage's buffers, its input
  // gradient and every stage's parameters stay float32, as in the other modes.
  return out.is_floating_point() ? out.to(torch::kFloat) : out;
}

torch::Tensor PipelineEngine::Forward(const torch::Tensor& inputs) {
  torch::NoGradGuard no_grad;
  torch::Tensor in = first() ? inputs : RecvActivation();
  torch::Tensor out = StageForward(in);
  if (!last()) {
    SendActivation(out);
    WaitSends();
    return torch::Tensor();
  }
  return out;
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
