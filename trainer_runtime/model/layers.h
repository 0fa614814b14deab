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
#include "trainer_runtime/model/tensor_parallel.h"

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
//
// With a tensor group of T ranks (tensor_parallel.h) the block is Megatron's: qkv and fc1 are
// column-parallel, proj and fc2 row-parallel, each rank computes heads/T heads and 4C/T hidden
// features; one all-reduce forward and one backward per half. With `sequence_parallel` the
// block takes and gives this rank's 1/T of the sequence ([B, S/T, C]), and its norms, residuals
// and dropout run on it alone. Parameter names are the whole block's; without a group it is the
// whole block, draw for draw and bit for bit.
//
// With a context group of G ranks (tensor_parallel.h: DeepSpeed-Ulysses) the block takes and
// gives this rank's 1/G of the sequence, and attention trades it for 1/G of the heads over the
// whole sequence with one all-to-all before and one after (two forward, two backward).
//
// Dropout draws each mask whole, from the default generator, and keeps this rank's part of it
// (its heads, its rows of the sequence): every rank of a tensor and context group seeds that
// generator alike, so the block drops exactly what the whole block would.
class BlockImpl : public torch::nn::Module, public ShardUnit {
 public:
  BlockImpl(int64_t d_model, int64_t heads, double dropout, bool checkpoint = false,
            TensorGroupPtr tensor = TensorGroupPtr(), bool sequence_parallel = false,
            TensorGroupPtr context = TensorGroupPtr())
      : heads_(heads),
        dropout_(dropout),
        checkpoint_(checkpoint),
        tensor_(std::move(tensor)),
        sequence_parallel_(sequence_parallel && TensorSize(tensor_) > 1),
        context_(std::move(context)) {
    const int t = TensorSize(tensor_);
    TORCH_CHECK(heads % t == 0, "train.model.heads: ", heads, " heads do not split over ", t,
                " tensor-parallel ranks (train.parallel.tensor)");
    TORCH_CHECK(heads % (t * TensorSize(context_)) == 0, "train.model.heads: ", heads,
                " heads do not split over ", t, " tensor x ", TensorSize(context_),
                " context-parallel ranks (train.parallel.context)");
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    qkv_ = register_module(
        "qkv", ColumnParallelLinear(
                   d_model, 3 * d_model, tensor_,
                   ColumnParallelOptions().fused(3).sequence_parallel(sequence_parallel_)));
    proj_ = register_module(
        "proj", RowParallelLinear(d_model, d_model, tensor_, true, true, sequence_parallel_));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    fc1_ = register_module(
        "fc1", ColumnParallelLinear(d_model, 4 * d_model, tensor_,
                                    ColumnParallelOptions().sequence_parallel(sequence_parallel_)));
    fc2_ = register_module(
        "fc2", RowParallelLinear(4 * d_model, d_model, tensor_, true, true, sequence_parallel_));
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
    const int t_ranks = TensorSize(tensor_), c_ranks = TensorSize(context_);
    const int64_t heads = heads_ / t_ranks, c = x.size(2), hd = c / heads_;
    auto qkv = qkv_->forward(Norm(ln1_, x));
    // This rank's part of the sequence (the whole of it without a context group).
    const int64_t b = qkv.size(0), t = qkv.size(1);
    qkv = qkv.view({b, t, 3, heads, hd});
    // Ulysses: every token of 1/G of this rank's heads (the whole [B, S, 3, H/(T G), hd]).
    qkv = AllToAllRegion(qkv, context_, /*scatter=*/3, /*gather=*/1);
    auto q = qkv.select(2, 0).transpose(1, 2);  // [B, H/(T G), S, hd]
    auto k = qkv.select(2, 1).transpose(1, 2);
    auto v = qkv.select(2, 2).transpose(1, 2);
    auto att = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    att = att.masked_fill(causal_mask, -std::numeric_limits<float>::infinity());
    att = torch::softmax(att, -1);
    // This rank's heads are block (tensor rank x G + context rank) of the whole block's.
    if (dropout_ > 0)
      att = Dropout(att, /*dim=*/1, /*whole=*/heads_,
                    TensorRank(tensor_) * c_ranks + TensorRank(context_));
    auto y = torch::matmul(att, v).transpose(1, 2);  // [B, S, H/(T G), hd]
    // And back: this rank's part of the sequence, all of its H/T heads.
    y = AllToAllRegion(y, context_, /*scatter=*/1, /*gather=*/2);
    y = y.contiguous().view({b, t, c / t_ranks});
    auto h = x + proj_->forward(y);
    auto m = fc2_->forward(torch::gelu(fc1_->forward(Norm(ln2_, h))));
    // The residual stream's rows: this rank's part of the sequence, context-major (the context
    // group splits the sequence first, sequence parallelism each part again).
    if (dropout_ > 0) {
      const int64_t parts = c_ranks * (sequence_parallel_ ? t_ranks : 1);
      const int64_t part =
          TensorRank(context_) * (parts / c_ranks) + (sequence_parallel_ ? TensorRank(tensor_) : 0);
      m = Dropout(m, /*dim=*/1, m.size(1) * parts, part);
    }
    return h + m;
  }

  torch::Tensor Norm(torch::nn::LayerNorm& ln, const torch::Tensor& x) {
    return SequenceParallelNorm(ln, x, tensor_, sequence_parallel_);
  }
  // Dropout of a tensor every rank of the group holds whole.
  torch::Tensor Drop(const torch::Tensor& x) { return torch::dropout(x, dropout_, is_training()); }
  // Dropout of part `part` of a tensor split along `dim` into equal parts, which has `whole`
  // entries whole: the whole mask, this rank's part of it (torch::dropout's draws:
  // x * bernoulli(1-p) / (1-p)).
  torch::Tensor Dropout(const torch::Tensor& x, int64_t dim, int64_t whole, int64_t part) {
    if (whole == x.size(dim) || !is_training()) return Drop(x);
    auto sizes = x.sizes().vec();
    sizes[static_cast<size_t>(dim)] = whole;
    torch::Tensor mask = torch::empty(sizes, x.options()).bernoulli_(1 - dropout_);
    mask = mask.narrow(dim, x.size(dim) * part, x.size(dim));
    return x * mask.div_(1 - dropout_);
  }

  int64_t heads_;
  double dropout_;
  bool checkpoint_;
  TensorGroupPtr tensor_;
  bool sequence_parallel_;
  TensorGroupPtr context_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  ColumnParallelLinear qkv_{nullptr}, fc1_{nullptr};
  RowParallelLinear proj_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(Block);

}  // namespace launch::trainer
