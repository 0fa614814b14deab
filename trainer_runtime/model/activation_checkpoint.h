#pragma once

// Activation checkpointing (torch.utils.checkpoint): a block's forward runs without keeping its
// intermediate activations, and backward runs the block's forward again to get them. Memory held
// between forward and backward drops to the block's input; the price is one more forward of the
// block per backward (about a third more compute for a whole model).
//
//   // in a module's forward: the block's activations are not kept
//   x = CheckpointedForward([this](const torch::Tensor& h) { return fc2(torch::relu(fc1(h))); },
//                           x);
//
// `train` turns it on with `train.model.activation_checkpointing: true` for the built-in models'
// blocks (the MLP's hidden layers in runs of ceil(sqrt(hidden layers)), the transformer's blocks,
// the CNN's conv blocks); a user's module calls CheckpointedForward itself.
//
// What the recomputation reproduces exactly, so gradients equal those of a plain forward bit for
// bit: the input (saved), the default generator's state of the input's device (the CPU's or that
// CUDA device's: dropout masks; saved before the block ran, set for the recomputation, then put
// back so later draws are unaffected), and this thread's autocast state for that device type. What
// it does not undo: other side effects of `fn`. A module that updates state in forward (BatchNorm's
// running statistics) would update it twice; it asks RecomputingForCheckpoint() and skips the
// update then (the built-in CNN does).
//
// How: the block runs once with its graph recorded, to learn which parameters it uses (the
// graph's leaves), and the graph with the activations it holds is dropped at once, keeping the
// output. The output's grad_fn is a torch::autograd::Function whose inputs are the block's input
// and those parameters: their gradients come back from its backward (torch::autograd::grad on
// the recomputed block) and accumulate through the parameters' usual AccumulateGrad nodes. So
// DDP sees them as without checkpointing (its hooks and buckets, and find_unused_parameters'
// walk of the graph, which reaches the parameters through that Function), and a block whose
// input needs no gradient (the first, on the data) is checkpointed too. The peak inside one
// block's forward is what backward's recomputation needs anyway.
//
// Internal to trainer_runtime (includes LibTorch). Thread-safety: a block may be checkpointed on
// several threads at once (dp replicas), but the CPU generator is process-wide: with dropout,
// forwards that draw from it must not run concurrently (dp_seeded_replicas serialises them).

#include <functional>

#include <torch/torch.h>

namespace launch::trainer {

// Returns fn(input), computed without recording the graph inside `fn`; in backward, fn runs
// again on the saved input with grad enabled and its gradients flow to `input` and to the
// parameters `fn` uses. With grad mode off (evaluation) it is plain fn(input). `fn` must be a
// pure function of `input`, the parameters and its device's generator, and must stay callable until
// backward ran (capture modules by shared pointer or `this` of a module that outlives the step).
// REQUIRES: input is defined.
torch::Tensor CheckpointedForward(std::function<torch::Tensor(const torch::Tensor&)> fn,
                                  const torch::Tensor& input);

// True on the thread that is recomputing a checkpointed block inside backward.
bool RecomputingForCheckpoint();

}  // namespace launch::trainer
