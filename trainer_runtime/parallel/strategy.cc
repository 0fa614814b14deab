#include "trainer_runtime/parallel/strategy.h"

#include "base/files.h"
#include "trainer_runtime/state/checkpoint.h"

namespace launch::trainer {

double ParallelStrategy::MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void BroadcastModel(const c10::intrusive_ptr<CountingProcessGroup>& pg, Model* model) {
  if (!pg) return;
  std::vector<at::Tensor> tensors;
  for (auto& [name, p] : model->NamedParameters()) tensors.push_back(p);
  for (auto& [name, b] : model->NamedBuffers()) tensors.push_back(b);
  BroadcastFromRank0(pg, std::move(tensors));
}

void ParallelStrategy::Reform(c10::intrusive_ptr<CountingProcessGroup>) {
  TORCH_CHECK(false, Name(), " cannot go on over a re-formed group (no in-place recovery)");
}

void ParallelStrategy::SaveImage(torch::serialize::OutputArchive& archive,
                                 torch::optim::Optimizer& optimizer) {
  WriteModelKeys(archive, *model_, optimizer);
}

Status ParallelStrategy::LoadImage(torch::serialize::InputArchive& archive,
                                   torch::optim::Optimizer& optimizer) {
  // load() keeps the state of a parameter the image has none for (a snapshot before the first
  // step): the state goes back to the image's, none included.
  optimizer.state().clear();
  return ReadModelKeys(archive, "this rank's snapshot", *model_, optimizer);
}

double ParallelStrategy::ClipGradNorm(double max_norm) {
  if (!tensor_group_) return torch::nn::utils::clip_grad_norm_(model_->Parameters(), max_norm);
  // clip_grad_norm_'s rule over the norm of the whole model's gradients.
  const double norm = std::sqrt(GradNormSquared());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) ScaleGradients(coef);
  return norm;
}

double ParallelStrategy::GradNormSquared() {
  const std::vector<torch::Tensor> params = model_->Parameters();
  if (!tensor_group_) {
    // Summed where the gradients are, read once (one wait for a GPU, not one per parameter).
    torch::Tensor squares;
    for (const auto& p : params) {
      if (!p.grad().defined()) continue;
      torch::Tensor sq = p.grad().pow(2).sum().to(torch::kDouble);
      squares = squares.defined() ? squares + sq : sq;
    }
    return squares.defined() ? squares.item<double>() : 0.0;
  }
  // [0]: the shards' squares (summed over the tensor group), [1]: the replicated ones'.
  auto squares = torch::zeros({2}, torch::kDouble);
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].grad().defined())
      squares[i < split_.size() && split_[i] ? 0 : 1] +=
          params[i].grad().to(torch::kDouble).pow(2).sum().cpu();
  torch::Tensor shards = squares.narrow(0, 0, 1).clone();
  tensor_group_->AllReduceSum(shards);
  return shards.item<double>() + squares[1].item<double>();
}

void ParallelStrategy::ScaleGradients(double coef) {
  torch::NoGradGuard no_grad;
  for (auto& p : model_->Parameters())
    if (p.grad().defined()) p.mutable_grad().mul_(coef);
}

void ParallelStrategy::DropGradients() {
  for (auto& p : model_->Parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

void ParallelStrategy::Step(torch::optim::Optimizer& optimizer) {
  optimizer.step();
  DropGradients();  // zeroed in place (strategy.h: DDP's are views into its buckets)
}

StateBytes ParallelStrategy::MemoryBytes(const torch::optim::Optimizer& optimizer) const {
  return WholeStateBytes(*model_, optimizer);
}

StateBytes WholeStateBytes(const Model& model, const torch::optim::Optimizer& optimizer) {
  StateBytes out;
  for (const auto& p : model.Parameters()) {
    out.parameters += p.numel() * static_cast<int64_t>(p.element_size());
    if (p.grad().defined())
      out.gradients += p.grad().numel() * static_cast<int64_t>(p.element_size());
  }
  out.optimizer = OptimizerStateBytes(optimizer);
  return out;
}

Status ParallelStrategy::SaveModelState(const std::string& dir,
                                        torch::optim::Optimizer& optimizer) {
  // One model folder for all: its optimizer state in pieces, which any layout re-cuts.
  if (ReplicasEqual()) return rank() == 0 ? SaveModelFolder(dir, *model_, optimizer) : Status::Ok();
  return trainer::SaveModelState(dir + "/model_rank" + std::to_string(rank()) + ".pt", *model_,
                                 optimizer);
}

Status ParallelStrategy::LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                                        int64_t /*written_by*/) {
  std::string path = dir + "/model.pt";
  if (!ReplicasEqual()) {
    path = dir + "/model_rank" + std::to_string(rank()) + ".pt";
    if (!FileExists(path)) path = dir + "/model_rank0.pt";  // fewer ranks wrote it
  }
  LAUNCH_RETURN_IF_ERROR(trainer::LoadModelState(path, *model_, optimizer));
  // A zero run (zero.h) left the optimizer state in shards: this optimizer takes all of it.
  if (!HasShardedOptimizerState(dir)) return Status::Ok();
  LAUNCH_ASSIGN_OR_RETURN(std::vector<ParamPiece> whole, WholeParamPieces(*model_, optimizer));
  return LoadShardedOptimizerState(dir, optimizer, whole).status();
}

void ParallelStrategy::BroadcastBuffers() {
  if (model_->NamedBuffers().empty()) return;
  auto start = Clock::now();
  // Rank 0's values are written through a view with its own version counter (Python's
  // `.data`): a forward of this model may already have saved the buffers for its backward (a
  // GAN's discriminator under the generator's loss, then its second Backward in the micro-batch
  // syncs here), and BatchNorm saves its running statistics without reading them in training
  // mode's backward. A bumped counter would abort that backward ("modified by an inplace
  // operation"), as PyTorch's DDP does with broadcast_buffers=True.
  std::vector<at::Tensor> buffers;
  for (auto& [name, b] : model_->NamedBuffers()) buffers.push_back(b.variable_data());
  BroadcastFromRank0(pg_, std::move(buffers));
  stats_.blocking_comm_ms += MsSince(start);
}

StepCommStats ParallelStrategy::TakeStepStats() {
  StepCommStats out = stats_;
  if (pg_) {
    const int64_t now = pg_->allreduce_count();
    out.allreduces = now - allreduces_at_step_start_;
    allreduces_at_step_start_ = now;
    const int64_t scatters = pg_->reduce_scatter_count(), gathers = pg_->allgather_count();
    out.reduce_scatters = scatters - reduce_scatters_at_step_start_;
    out.allgathers = gathers - allgathers_at_step_start_;
    reduce_scatters_at_step_start_ = scatters;
    allgathers_at_step_start_ = gathers;
  }
  stats_ = StepCommStats();
  return out;
}

void AllReduceSum(const c10::intrusive_ptr<CountingProcessGroup>& pg, torch::Tensor& values) {
  if (!pg) return;
  std::vector<at::Tensor> v = {values};
  pg->allreduce(v, c10d::AllreduceOptions())->wait();
}

}  // namespace launch::trainer
