#include "trainer_runtime/model/fused_adam.h"

#include <cmath>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/ATen.h>
#include <torch/torch.h>

#include "base/check.h"
#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {
namespace {

namespace optim = torch::optim;

// One device and dtype's share of a parameter group: what one multi-tensor or fused call
// takes (CUDA's multi-tensor kernels need a single device and dtype; PyTorch groups alike).
struct Bucket {
  Bucket(at::Device d, at::ScalarType t) : device(d), dtype(t) {}
  at::Device device;
  at::ScalarType dtype;
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs;
  std::vector<int64_t> steps;  // each tensor's step count, this step included
};

// The bias corrections as adam.cpp computes them (double, from the int64 step).
struct StepScalars {
  std::vector<at::Scalar> neg_step_size;  // -lr / (1 - beta1^step)
  std::vector<at::Scalar> sqrt_bias2;     // sqrt(1 - beta2^step)
};

StepScalars Scalars(const std::vector<int64_t>& steps, double lr, double beta1, double beta2) {
  StepScalars s;
  for (int64_t step : steps) {
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    s.neg_step_size.emplace_back(-(lr / bias_correction1));
    s.sqrt_bias2.emplace_back(std::sqrt(bias_correction2));
  }
  return s;
}

struct Hyper {
  double lr, beta1, beta2, weight_decay, eps;
  bool amsgrad;
  bool decoupled;  // AdamW
};

// adam.cpp's and adamw.cpp's per-tensor sequence, the same ops in the same order over lists.
void ForeachStep(Bucket& b, const Hyper& h) {
  const StepScalars s = Scalars(b.steps, h.lr, h.beta1, h.beta2);
  if (h.decoupled && h.weight_decay != 0) at::_foreach_mul_(b.params, 1 - h.lr * h.weight_decay);
  std::vector<at::Tensor> grads = b.grads;
  // Adam's L2 term joins a copy of the gradient; the gradient itself stays as backward left it.
  if (!h.decoupled && h.weight_decay != 0)
    grads = at::_foreach_add(b.grads, b.params, h.weight_decay);
  at::_foreach_mul_(b.exp_avgs, h.beta1);
  at::_foreach_add_(b.exp_avgs, grads, 1 - h.beta1);
  at::_foreach_mul_(b.exp_avg_sqs, h.beta2);
  at::_foreach_addcmul_(b.exp_avg_sqs, grads, grads, 1 - h.beta2);
  std::vector<at::Tensor> denom;
  if (h.amsgrad) {
    at::_foreach_maximum_(b.max_exp_avg_sqs, b.exp_avg_sqs);
    denom = at::_foreach_sqrt(b.max_exp_avg_sqs);
  } else {
    denom = at::_foreach_sqrt(b.exp_avg_sqs);
  }
  at::_foreach_div_(denom, s.sqrt_bias2);
  at::_foreach_add_(denom, h.eps);
  at::_foreach_addcdiv_(b.params, b.exp_avgs, denom, s.neg_step_size);
}

void FusedStep(Bucket& b, const Hyper& h) {
  TORCH_CHECK(compat::HasFusedAdam(b.device.type()),
              "train.optimizer.implementation: fused: LibTorch ", compat::LibTorchVersion(),
              " has no fused Adam/AdamW kernels for ", b.device.type(),
              " tensors; use foreach or for_loop");
  // The kernels read each tensor's step from a float32 scalar on its device: one copy of all
  // counts, one view each (distinct tensors, as PyTorch's state holds them).
  std::vector<float> counts(b.steps.begin(), b.steps.end());
  const at::Tensor all = at::tensor(counts, at::TensorOptions().dtype(at::kFloat)).to(b.device);
  const std::vector<at::Tensor> steps = all.unbind(0);
  compat::FusedAdamStep(h.decoupled, b.params, b.grads, b.exp_avgs, b.exp_avg_sqs,
                        h.amsgrad ? at::TensorList(b.max_exp_avg_sqs) : at::TensorList(), steps,
                        h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, h.amsgrad);
}

// Every parameter that will be stepped is a CUDA tensor (kAuto's test).
bool AllCuda(const optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params())
      if (p.grad().defined() && !p.is_cuda()) return false;
  return true;
}

// Steps every group of `optimizer` (an Adam with State and Options, or an AdamW) with the
// multi-tensor or fused kernels. State is created as adam.cpp creates it, on first use.
template <typename State, typename Options>
void StepGroups(optim::Optimizer& optimizer, bool decoupled, bool fused) {
  for (auto& group : optimizer.param_groups()) {
    const auto& options = static_cast<const Options&>(group.options());
    const Hyper h{options.lr(),
                  std::get<0>(options.betas()),
                  std::get<1>(options.betas()),
                  options.weight_decay(),
                  options.eps(),
                  options.amsgrad(),
                  decoupled};
    std::vector<Bucket> buckets;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.grad().is_sparse(),
                  "Adam does not support sparse gradients, please consider SparseAdam instead");
      auto* state = static_cast<State*>(compat::FindParamState(optimizer, p));
      if (state == nullptr) {
        auto fresh = std::make_unique<State>();
        fresh->step(0);
        fresh->exp_avg(torch::zeros_like(p, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        if (h.amsgrad) fresh->max_exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Preserve));
        state = fresh.get();
        compat::SetParamState(optimizer, p, std::move(fresh));
      }
      state->step(state->step() + 1);
      Bucket* bucket = nullptr;
      for (Bucket& b : buckets)
        if (b.device == p.device() && b.dtype == p.scalar_type()) bucket = &b;
      if (bucket == nullptr) bucket = &buckets.emplace_back(p.device(), p.scalar_type());
      bucket->params.push_back(p);
      bucket->grads.push_back(p.grad());
      bucket->exp_avgs.push_back(state->exp_avg());
      bucket->exp_avg_sqs.push_back(state->exp_avg_sq());
      if (h.amsgrad) bucket->max_exp_avg_sqs.push_back(state->max_exp_avg_sq());
      bucket->steps.push_back(state->step());
    }
    for (Bucket& b : buckets) fused ? FusedStep(b, h) : ForeachStep(b, h);
  }
}

// Evaluates `closure` with gradients on, as torch::optim's step does, then steps.
template <typename Base, typename State, typename Options>
torch::Tensor Step(Base& optimizer, OptimizerImplementation implementation, bool decoupled,
                   const optim::Optimizer::LossClosure& closure) {
  if (implementation == OptimizerImplementation::kAuto && !AllCuda(optimizer))
    return optimizer.Base::step(closure);
  torch::NoGradGuard no_grad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  StepGroups<State, Options>(optimizer, decoupled,
                             implementation == OptimizerImplementation::kFused);
  return loss;
}

std::string FusedUnavailable(c10::DeviceType device) {
  return "train.optimizer.implementation: fused: LibTorch " + compat::LibTorchVersion() +
         " has no fused Adam/AdamW kernels for " + c10::DeviceTypeName(device, true) +
         " tensors (CUDA has them from LibTorch 2.0, the CPU from 2.4); use foreach or for_loop";
}

template <typename Multi, typename Plain, typename Options>
StatusOr<std::unique_ptr<optim::Optimizer>> New(std::vector<optim::OptimizerParamGroup> groups,
                                                const Options& defaults,
                                                OptimizerImplementation implementation) {
  LAUNCH_RETURN_IF_ERROR(CheckAdamImplementation(implementation, groups));
  if (implementation == OptimizerImplementation::kForLoop)
    return std::unique_ptr<optim::Optimizer>(std::make_unique<Plain>(std::move(groups), defaults));
  return std::unique_ptr<optim::Optimizer>(
      std::make_unique<Multi>(std::move(groups), defaults, implementation));
}

}  // namespace

MultiTensorAdam::MultiTensorAdam(std::vector<optim::OptimizerParamGroup> groups,
                                 optim::AdamOptions defaults,
                                 OptimizerImplementation implementation)
    : optim::Adam(std::move(groups), std::move(defaults)), implementation_(implementation) {
  LAUNCH_CHECK(implementation != OptimizerImplementation::kForLoop,
               "the for loop is torch::optim::Adam itself");
}

torch::Tensor MultiTensorAdam::step(LossClosure closure) {
  return Step<optim::Adam, optim::AdamParamState, optim::AdamOptions>(*this, implementation_,
                                                                      /*decoupled=*/false, closure);
}

MultiTensorAdamW::MultiTensorAdamW(std::vector<optim::OptimizerParamGroup> groups,
                                   optim::AdamWOptions defaults,
                                   OptimizerImplementation implementation)
    : optim::AdamW(std::move(groups), std::move(defaults)), implementation_(implementation) {
  LAUNCH_CHECK(implementation != OptimizerImplementation::kForLoop,
               "the for loop is torch::optim::AdamW itself");
}

torch::Tensor MultiTensorAdamW::step(LossClosure closure) {
  return Step<optim::AdamW, optim::AdamWParamState, optim::AdamWOptions>(
      *this, implementation_, /*decoupled=*/true, closure);
}

Status CheckAdamImplementation(OptimizerImplementation implementation,
                               const std::vector<optim::OptimizerParamGroup>& groups) {
  if (implementation != OptimizerImplementation::kFused) return Status::Ok();
  std::set<c10::DeviceType> devices;
  for (const auto& group : groups)
    for (const auto& p : group.params()) devices.insert(p.device().type());
  if (devices.empty()) devices.insert(c10::DeviceType::CPU);  // ZeRO asks before it has any
  for (c10::DeviceType device : devices) {
    if (compat::HasFusedAdam(device)) continue;
    // `train` builds the model on the CPU and moves it to its GPU before the first step.
    if (device == c10::DeviceType::CPU && compat::HasFusedAdam(c10::DeviceType::CUDA)) continue;
    return Status::InvalidConfig(FusedUnavailable(device));
  }
  return Status::Ok();
}

StatusOr<std::unique_ptr<optim::Optimizer>> NewAdam(std::vector<optim::OptimizerParamGroup> groups,
                                                    const optim::AdamOptions& defaults,
                                                    OptimizerImplementation implementation) {
  return New<MultiTensorAdam, optim::Adam>(std::move(groups), defaults, implementation);
}

StatusOr<std::unique_ptr<optim::Optimizer>> NewAdam(std::vector<optim::OptimizerParamGroup> groups,
                                                    const optim::AdamWOptions& defaults,
                                                    OptimizerImplementation implementation) {
  return New<MultiTensorAdamW, optim::AdamW>(std::move(groups), defaults, implementation);
}

std::optional<OptimizerImplementation> AdamImplementationOf(const optim::Optimizer& optimizer) {
  if (const auto* adam = dynamic_cast<const MultiTensorAdam*>(&optimizer))
    return adam->implementation();
  if (const auto* adamw = dynamic_cast<const MultiTensorAdamW*>(&optimizer))
    return adamw->implementation();
  if (dynamic_cast<const optim::Adam*>(&optimizer) || dynamic_cast<const optim::AdamW*>(&optimizer))
    return OptimizerImplementation::kForLoop;
  return std::nullopt;
}

StatusOr<std::unique_ptr<optim::Optimizer>> AdamLike(
    const optim::Optimizer& like, std::vector<optim::OptimizerParamGroup> groups) {
  const std::optional<OptimizerImplementation> implementation = AdamImplementationOf(like);
  LAUNCH_CHECK(implementation.has_value(), "AdamLike of an optimizer that is not Adam or AdamW");
  if (dynamic_cast<const optim::AdamW*>(&like))
    return NewAdam(std::move(groups), static_cast<const optim::AdamWOptions&>(like.defaults()),
                   *implementation);
  return NewAdam(std::move(groups), static_cast<const optim::AdamOptions&>(like.defaults()),
                 *implementation);
}

}  // namespace launch::trainer
