#pragma once

// Building blocks shared by the whole-model trainer (model.cc) and the pipeline stages
// (pipeline_stages.cc): the transformer block and the MLP's layer. One definition keeps
// parameter names and maths identical, so a pipeline stage copies its slice of the whole model
// by name and trains exactly like it. Both are ZeRO stage-3 units (shard_unit.h).
//
// Internal to trainer_runtime (includes LibTorch).

#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "trainer_runtime/model/activation_checkpoint.h"
#include "trainer_runtime/model/shard_unit.h"

namespace launch::trainer {

// A Linear layer (torch::nn::Linear's parameters, names and maths) that is a stage-3 unit.
class UnitLinearImpl : public torch::nn::LinearImpl, public ShardUnit {
 public:
  using LinearImpl::LinearImpl;
  torch::Tensor forward(const torch::Tensor& x) {
    return ShardedForward(
        *this, [this](const torch::Tensor& h) { return LinearImpl::forward(h); }, x);
  }
};
TORCH_MODULE(UnitLinear);

// Causal transformer block (pre-LayerNorm GPT block), a stage-3 unit. With `checkpoint` its
// activations are recomputed in backward instead of kept (activation_checkpoint.h): the same
// gradients.
class BlockImpl : public torch::nn::Module, public ShardUnit {
 public:
  BlockImpl(int64_t d_model, int64_t heads, double dropout, bool checkpoint = false)
      : heads_(heads), dropout_(dropout), checkpoint_(checkpoint) {
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
    proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    fc1_ = register_module("fc1", torch::nn::Linear(d_model, 4 * d_model));
    fc2_ = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask) {
    return ShardedForward(
        *this,
        [this, &causal_mask](const torch::Tensor& h) {
          if (!checkpoint_) return Body(h, causal_mask);
          // The mask by value: backward calls this again after forward returned.
          return CheckpointedForward(
              [this, causal_mask](const torch::Tensor& in) { return Body(in, causal_mask); }, h);
        },
        x);
  }

 private:
  torch::Tensor Body(const torch::Tensor& x, const torch::Tensor& causal_mask) {
    const int64_t b = x.size(0), t = x.size(1), c = x.size(2), hd = c / heads_;
    auto qkv = qkv_->forward(ln1_->forward(x)).view({b, t, 3, heads_, hd});
    auto q = qkv.select(2, 0).transpose(1, 2);  // [B, H, T, hd]
    auto k = qkv.select(2, 1).transpose(1, 2);
    auto v = qkv.select(2, 2).transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = att.masked_fill(causal_mask, -std::numeric_limits<float>::infinity());
    att = torch::softmax(att, -1);
    if (dropout_ > 0) att = torch::dropout(att, dropout_, is_training());
    auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({b, t, c});
    auto h = x + proj_->forward(y);
    auto m = fc2_->forward(torch::gelu(fc1_->forward(ln2_->forward(h))));
    if (dropout_ > 0) m = torch::dropout(m, dropout_, is_training());
    return h + m;
  }

  int64_t heads_;
  double dropout_;
  bool checkpoint_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(Block);

}  // namespace launch::trainer
