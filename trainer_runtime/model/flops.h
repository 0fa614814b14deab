#pragma once

// The arithmetic one training step of a built-in model costs, counted from its configuration
// (the shapes model.cc builds), for the achieved TFLOP/s and MFU that `train` reports
// (metrics.jsonl, final.json). A TorchScript model has no count: its architecture is not known
// from the configuration, so the caller reports null.
//
// What is counted (model FLOPs, as in PaLM's MFU, Chowdhery et al. 2022, appendix B):
//   - Only matrix multiplies and convolutions, a multiply-add as 2 FLOPs. Elementwise work is
//     not counted: biases, activations, normalisation, pooling, softmax, dropout, residual adds,
//     embedding lookups (gathers) and the loss. On these models it is a few percent at most.
//   - Training = 3 x forward: the backward pass costs two forwards (the gradients of the inputs
//     and of the weights). The first layer's input gradient, which autograd skips, is counted
//     anyway, as the 6N convention does.
//   - Activation checkpointing's recomputed forward is not counted (that would be hardware
//     FLOPs): the same model does the same useful work either way.
// Per model, per sample:
//   - mlp [w0, ..., wn]: forward sum_i 2 w_i w_{i+1}.
//   - cnn: each block's 3x3 convolution (padding 1, stride 1, so the output keeps the input's
//     H x W) 2 * 9 * Cin * Cout * H * W, then the 2x2 pooling halves H and W (rounding down);
//     the hidden Linear 2 * (C * H * W) * hidden when hidden > 0; the head 2 * in * classes.
//   - transformer (a sample is one sequence of T tokens, T = data.context, or model.context
//     when that is 0, as the text data cuts its windows): per token 6N + 12 L d_model T
//     (PaLM's 6N + 12LHQT with H x Q = d_model; Megatron's count of the same matmuls). N counts
//     the weights that multiply activations: per block qkv (3 d^2), proj (d^2), fc1 and fc2
//     (8 d^2), and the head (d_model x vocab), which is the matrix PaLM counts as its (tied)
//     embedding. The token and position embedding tables are left out of N: they are looked
//     up, not multiplied. 12 L d T is attention's scores (Q K^T) and weighted sum (A V), 4 d T
//     per token per layer forward, over the full T x T square as PaLM counts it (the causal
//     mask does not halve it). T x that per sample.
//
// Plain arithmetic on the configuration; thread-safe.

#include <cstdint>
#include <optional>

#include "config/train_config.h"

namespace launch::trainer {

struct ModelFlops {
  // Default 0: FLOPs of one forward pass over one sample (a sequence for the transformer).
  int64_t forward_per_sample = 0;
  // Default 0: FLOPs of training on one sample, 3 x forward_per_sample.
  int64_t train_per_sample = 0;
  // Default 0: the transformer's tokens per sample (T); 0 for the other models.
  int64_t tokens_per_sample = 0;
};

// The counts above for `cfg`'s built-in model; nullopt for a TorchScript model. REQUIRES: a
// configuration the loader accepted (positive widths, channels, layers, context).
std::optional<ModelFlops> CountModelFlops(const config::TrainConfig& cfg);

}  // namespace launch::trainer
