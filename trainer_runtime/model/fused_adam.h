#pragma once

// Adam and AdamW stepped with multi-tensor (_foreach_*) ops or fused kernels, as PyTorch's
// torch.optim.Adam(foreach=True) and (fused=True) step on a GPU, where LibTorch's own
// torch::optim::Adam and AdamW launch a handful of kernels per parameter.
//
// MultiTensorAdam and MultiTensorAdamW are torch::optim::Adam and AdamW with step() replaced:
// the options, the parameter groups, the per-parameter state (AdamParamState /
// AdamWParamState: step, exp_avg, exp_avg_sq, max_exp_avg_sq, created on a parameter's first
// step exactly as LibTorch creates it), save() and load() are the base class's. A checkpoint
// written under one implementation therefore loads into any other, and code that inspects the
// state (OptimizerStateBytes, checkpoint.h's pieces, ZeRO's shards) sees no difference. The
// update is LibTorch's adam.cpp / adamw.cpp, group by group with each group's options: Adam adds
// weight_decay * param to the gradient, AdamW multiplies the parameter by 1 - lr * weight_decay;
// the step count, bias corrections and amsgrad's running maximum are per parameter; a parameter
// without a gradient is skipped and gets no state.
//
// What each implementation runs (config::OptimizerImplementation, YAML optimizer.implementation):
//   - kForLoop: torch::optim's own step (NewAdam returns the plain class).
//   - kForeach: the _foreach_* ops over each group's tensors of one device and dtype: on CUDA a
//     few multi-tensor kernels per group, on the CPU the same per-tensor kernels as the for loop.
//     Equal to the for loop up to float rounding.
//   - kFused: at::_fused_adam_ / at::_fused_adamw_, one kernel per device and dtype. The kernels
//     keep the step count as a float32 tensor; here it stays the state's int64 step, copied into
//     one such tensor per distinct count for each step.
//   - kAuto: foreach when every parameter that has a gradient is a CUDA tensor, else the for loop
//     (PyTorch's _default_to_fused_or_foreach). Decided at every step, since `train` builds the
//     optimizer before moving the model to its device; on the CPU it is the for loop itself, so
//     results stay bit-identical to torch::optim's and PyTorch's CPU Adam.
//
// Internal to trainer_runtime (includes LibTorch). Not thread-safe, like torch::optim.

#include <memory>
#include <optional>
#include <vector>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

using config::OptimizerImplementation;

class MultiTensorAdam : public torch::optim::Adam {
 public:
  // REQUIRES: `implementation` is not kForLoop (that is torch::optim::Adam itself), and a kFused
  // one passed CheckAdamImplementation (NewAdam checks both).
  MultiTensorAdam(std::vector<torch::optim::OptimizerParamGroup> groups,
                  torch::optim::AdamOptions defaults, OptimizerImplementation implementation);
  // Throws c10::Error (as torch::optim does) for sparse gradients, and for kFused on a device
  // this LibTorch has no fused kernels for, naming train.optimizer.implementation.
  torch::Tensor step(LossClosure closure = nullptr) override;
  OptimizerImplementation implementation() const { return implementation_; }

 private:
  OptimizerImplementation implementation_;
};

class MultiTensorAdamW : public torch::optim::AdamW {
 public:
  // As MultiTensorAdam's.
  MultiTensorAdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                   torch::optim::AdamWOptions defaults, OptimizerImplementation implementation);
  torch::Tensor step(LossClosure closure = nullptr) override;
  OptimizerImplementation implementation() const { return implementation_; }

 private:
  OptimizerImplementation implementation_;
};

// Whether `implementation` can step `groups` with this LibTorch: only kFused can fail, when
// this LibTorch has no fused kernels for the device the parameters are on, nor for CUDA (where
// `train` moves CPU-built parameters on a GPU; a step on a device without kernels throws).
// InvalidConfig naming train.optimizer.implementation, the LibTorch version and what to use.
Status CheckAdamImplementation(OptimizerImplementation implementation,
                               const std::vector<torch::optim::OptimizerParamGroup>& groups);

// Adam or AdamW over `groups` (each with its own options) with `defaults`, stepped by
// `implementation`: torch::optim's class for kForLoop, MultiTensorAdam(W) otherwise.
// CheckAdamImplementation's InvalidConfig when it cannot.
StatusOr<std::unique_ptr<torch::optim::Optimizer>> NewAdam(
    std::vector<torch::optim::OptimizerParamGroup> groups,
    const torch::optim::AdamOptions& defaults, OptimizerImplementation implementation);
StatusOr<std::unique_ptr<torch::optim::Optimizer>> NewAdam(
    std::vector<torch::optim::OptimizerParamGroup> groups,
    const torch::optim::AdamWOptions& defaults, OptimizerImplementation implementation);

// The implementation `optimizer` steps with: a MultiTensorAdam(W)'s own, kForLoop for
// torch::optim's Adam and AdamW, nullopt for any other optimizer.
std::optional<OptimizerImplementation> AdamImplementationOf(
    const torch::optim::Optimizer& optimizer);

// An optimizer of `like`'s class (Adam or AdamW), defaults and implementation over `groups`:
// ZeRO's shard optimizers step as the one the user prepared. REQUIRES: AdamImplementationOf
// (like) has a value.
StatusOr<std::unique_ptr<torch::optim::Optimizer>> AdamLike(
    const torch::optim::Optimizer& like, std::vector<torch::optim::OptimizerParamGroup> groups);

}  // namespace launch::trainer
