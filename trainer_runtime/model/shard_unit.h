#pragma once

// The units of ZeRO stage 3 (`parallel: {mode: zero, zero_stage: 3}`, parallel/zero.h): the
// blocks of a model whose parameters each rank holds only a shard of between uses, gathered
// whole around the block's forward and again for its backward, freed after each (FSDP's wrapped
// modules). LibTorch's modules have no forward hooks, so a block says both things itself:
//
//   class MyBlockImpl : public torch::nn::Module, public launch::trainer::ShardUnit {
//     torch::Tensor forward(const torch::Tensor& x) {
//       return ShardedForward(*this, [this](const torch::Tensor& h) { return Body(h); }, x);
//     }
//   };
//
// A module derived from ShardUnit is a unit with every parameter below it (a unit inside a unit
// belongs to the outer one). Its parameters must be used only inside ShardedForward on it:
// between uses their memory is released, and a tensor read there holds no data (reading it is
// undefined behaviour, as with FSDP's sharded parameters). The parameters outside every unit,
// and one shared by two units (tied weights) or by a unit and the rest of the model, are the
// model's root: they stay whole on every rank and are sharded as stage 2 shards.
//
// Without stage 3 (any other mode, one process, evaluation in another program) ShardedForward is
// fn(input): a model written this way runs unchanged everywhere. With it, backward gathers a
// unit when its output's gradient arrives (a hook on the output), so the output must be what
// later layers use and the gradient must flow through it. Activation checkpointing
// (activation_checkpoint.h) composes: call CheckpointedForward inside `fn`.
//
// Internal to trainer_runtime (includes LibTorch). Thread-safety: one training thread; the
// gatherer is process-wide (one stage-3 strategy at a time).

#include <functional>

#include <torch/torch.h>

namespace launch::trainer {

// Marks a module type as a stage-3 unit (FSDP's ModuleWrapPolicy by type).
class ShardUnit {
 public:
  virtual ~ShardUnit() = default;
};

// fn(input) with `unit`'s parameters whole for its duration (see above). `fn` may be called
// again in backward only through activation checkpointing; it must not keep the parameters.
torch::Tensor ShardedForward(torch::nn::Module& unit,
                             const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                             const torch::Tensor& input);

// What stage 3 does around a unit's forward (parallel/zero.cc implements it).
class UnitGatherer {
 public:
  virtual ~UnitGatherer() = default;
  // Whether `unit` is one of its units (ShardedForward is plain fn(input) otherwise).
  virtual bool IsUnit(const torch::nn::Module& unit) const = 0;
  // The unit's parameters are whole on return.
  virtual void BeforeUnitForward(const torch::nn::Module& unit) = 0;
  // After fn returned `output`: releases the parameters and, when the output takes part in
  // backward, arranges the gather before the unit's backward.
  virtual void AfterUnitForward(const torch::nn::Module& unit, const torch::Tensor& output) = 0;
};

// Installs the process's gatherer (null: none). The strategy that installs it removes it before
// it goes.
void SetUnitGatherer(UnitGatherer* gatherer);

}  // namespace launch::trainer
