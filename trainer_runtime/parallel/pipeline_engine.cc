#include "trainer_runtime/parallel/pipeline_engine.h"

#include <sys/resource.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cmath>

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

double PeakRssMb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;
}

}  // namespace

PipelineEngine::PipelineEngine(const config::TrainConfig& cfg, const DistEnv& env,
                               const ParallelLayout& layout,
                               c10::intrusive_ptr<CountingProcessGroup> pg)
    : cfg_(cfg), env_(env), pg_(std::move(pg)) {
  stages_ = layout.degree(Axis::kStage);
  stage_ = layout.coordinate(Axis::kStage);
  replicas_ = layout.degree(Axis::kData);
  replica_ = layout.coordinate(Axis::kData);
  ops_ = BuildPipelineSchedule(cfg_.parallel.schedule, stages_, stage_, cfg_.parallel.microbatches);
}

StatusOr<std::unique_ptr<PipelineEngine>> PipelineEngine::Create(
    const config::TrainConfig& cfg, const DistEnv& env, const ParallelLayout& layout,
    c10::intrusive_ptr<CountingProcessGroup> pg, std::chrono::milliseconds timeout) {
  std::unique_ptr<PipelineEngine> engine(new PipelineEngine(cfg, env, layout, pg));
  // This stage's replicas in the other pipelines average their gradients.
  LAUNCH_ASSIGN_OR_RETURN(engine->stage_pg_,
                          CreateAxisGroup(layout, Axis::kData, env, pg, timeout));
  return engine;
}

void PipelineEngine::SetStage(std::shared_ptr<Model> model, ForwardFn forward) {
  model_ = std::move(model);
  forward_ = std::move(forward);
  // Replicas built from different seeds would otherwise average gradients taken at different
  // weights and never meet again: start them all from replica 0's stage, as DDP's Prepare does.
  BroadcastModel(stage_pg_, model_.get());
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
    pending_sends_.push_back(pg_->send(v, Next(), kActivationTag));
    pending_tensors_.push_back(*part);
  }
}

torch::Tensor PipelineEngine::RecvActivation() {
  Timeline::Scope span("pipeline", "idle: receive activation from rank " + std::to_string(Prev()));
  auto header = torch::empty({kHeaderLen}, torch::kLong);
  std::vector<at::Tensor> hv = {header};
  pg_->recv(hv, Prev(), kActivationTag)->wait();
  auto h = header.accessor<int64_t, 1>();
  TORCH_CHECK(h[0] >= 0 && h[0] <= kMaxDims, "corrupt activation header from rank ", Prev());
  std::vector<int64_t> sizes;
  for (int64_t i = 0; i < h[0]; ++i) sizes.push_back(h[1 + i]);
  auto body = torch::empty(
      sizes, torch::TensorOptions().dtype(static_cast<c10::ScalarType>(h[kHeaderLen - 1])));
  std::vector<at::Tensor> bv = {body};
  pg_->recv(bv, Prev(), kActivationTag)->wait();
  return body;
}

void PipelineEngine::WaitSends() {
  Timeline::Scope span("pipeline", "idle: sends complete");
  for (auto& work : pending_sends_) work->wait();
  pending_sends_.clear();
  pending_tensors_.clear();
}

double PipelineEngine::ForwardBackward(const torch::Tensor& x, const torch::Tensor& y,
                                       int64_t batch, const LossFn& loss_fn, double scale) {
  // The rows this batch really has (not train.batch_size): an empty micro-batch's mean loss
  // is nan. Every stage sees the same rows, so all refuse alike, before any communication.
  const Status rows_ok =
      CheckRowsFor(batch, cfg_.parallel.microbatches, "train.parallel.microbatches");
  if (!rows_ok.ok()) throw compat::MakeError(rows_ok.message());
  if (gradients_synced_) SyncBuffers();
  gradients_synced_ = false;
  const auto chunks = SplitRows(batch, cfg_.parallel.microbatches);
  struct Live {
    torch::Tensor input;   // requires grad on every stage but the first
    torch::Tensor output;  // activation sent on, or the weighted loss on the last stage
    int64_t bytes = 0;
  };
  std::map<int, Live> live;
  int64_t live_bytes = 0;
  double busy = 0, loss_sum = 0;
  const auto window_start = Clock::now();
  for (const PipeOp& op : ops_) {
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
          AutocastScope amp(bf16());
          loss = loss_fn(out, y.narrow(0, offset, rows));
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
        pg_->recv(gv, Next(), kGradientTag)->wait();
      }
      const auto t0 = Clock::now();
      Timeline::Scope span("pipeline", "backward micro-batch " + std::to_string(op.micro));
      if (last()) {
        torch::autograd::backward({entry.output});
      } else {
        torch::autograd::backward({entry.output}, {grad});
      }
      busy += Seconds(Clock::now() - t0);
      if (!first()) {
        torch::Tensor g = entry.input.grad().contiguous();
        std::vector<at::Tensor> v = {g};
        pending_sends_.push_back(pg_->send(v, Prev(), kGradientTag));
        pending_tensors_.push_back(g);
      }
    }
  }
  WaitSends();
  totals_.busy_s += busy;
  totals_.window_s += Seconds(Clock::now() - window_start);
  return loss_sum;
}

void PipelineEngine::SyncBuffers() {
  if (!stage_pg_ || model_->NamedBuffers().empty()) return;
  std::vector<at::Tensor> buffers;
  for (auto& [name, b] : model_->NamedBuffers()) buffers.push_back(b);
  BroadcastFromRank0(stage_pg_, std::move(buffers));
}

double PipelineEngine::AllReduceGradients(double loss) {
  gradients_synced_ = true;
  comm_ms_ = 0;
  if (!stage_pg_) return loss;
  const auto start = Clock::now();
  // Flat all-reduces over this stage's replicas (one per dtype: per-call latency dominates on
  // Gloo). A parameter without a gradient sends zeros and a 0 in `used`; when no replica used
  // it, its gradient stays undefined afterwards, so the optimizer skips it (no weight decay),
  // as PyTorch DDP leaves globally unused parameters. The loss rides along so every replica
  // logs the mean.
  std::vector<torch::Tensor> params = model_->Parameters();
  std::vector<torch::Tensor> tensors;
  torch::Tensor extras = torch::zeros({static_cast<int64_t>(params.size()) + 1}, torch::kFloat);
  auto used = extras.accessor<float, 1>();
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor& p = params[i];
    used[static_cast<int64_t>(i)] = p.grad().defined() ? 1.0f : 0.0f;
    if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    tensors.push_back(p.grad());
  }
  used[static_cast<int64_t>(params.size())] = static_cast<float>(loss);
  tensors.push_back(extras);
  AllReduceFlat(*stage_pg_, tensors, replicas_);
  for (size_t i = 0; i < params.size(); ++i)
    if (used[static_cast<int64_t>(i)] == 0.0f) params[i].mutable_grad() = torch::Tensor();
  comm_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return used[static_cast<int64_t>(params.size())];
}

double PipelineEngine::ClipGradNorm(double max_norm) {
  const auto start = Clock::now();
  // The norm over the whole model: squares summed over stages (and over identical replicas,
  // hence the division).
  std::vector<torch::Tensor> params = model_->Parameters();
  double sq = 0;
  for (auto& p : params)
    if (p.grad().defined()) sq += p.grad().pow(2).sum().item<double>();
  auto total = torch::tensor({sq}, torch::kDouble);
  AllReduceSum(pg_, total);
  const double norm = std::sqrt(total.item<double>() / replicas_);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : params)
      if (p.grad().defined()) p.mutable_grad().mul_(coef);
  }
  comm_ms_ += std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  return norm;
}

torch::Tensor PipelineEngine::StageForward(const torch::Tensor& input) {
  if (!bf16()) return forward_(input);
  torch::Tensor out;
  {
    AutocastScope amp(true);
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
