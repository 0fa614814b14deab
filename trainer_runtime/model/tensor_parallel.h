#pragma once

// Tensor parallelism (Megatron-LM's): layers whose weights are split over the ranks of a tensor
// group, which all see the same batch. A column-parallel Linear holds a slice of the output
// features, a row-parallel Linear a slice of the input features; one after the other (attention's
// qkv then proj, the MLP's fc1 then fc2) they need one all-reduce forward and one backward, and
// what lies between them (attention heads, the MLP's activation) runs on this rank's slice alone.
//
// The communication is Megatron's conjugate mappings, autograd functions whose backward is the
// transpose of their forward (the gradient of a sum over ranks is a copy, and so on):
//
//   CopyToTensorRegion          identity forward,          all-reduce backward
//   ReduceFromTensorRegion      all-reduce forward,        identity backward
//   ScatterToTensorRegion       this rank's chunk forward, all-gather backward
//   GatherFromTensorRegion      all-gather forward,        this rank's chunk backward
//   GatherFromSequenceRegion    all-gather forward,        reduce-scatter backward
//   ReduceScatterToSequenceRegion  reduce-scatter forward, all-gather backward
//   AllToAllRegion              all-to-all forward,        the reverse all-to-all backward
//
// Context parallelism (DeepSpeed-Ulysses) splits every sequence over the ranks of a context group
// (parallel/layout.h): each holds 1/G of the tokens, and everything but attention runs on them
// alone. Attention needs the whole sequence: an all-to-all trades the sequence for the heads
// (each rank gets every token of 1/G of the heads: [B, S/G, ..., H, d] -> [B, S, ..., H/G, d]),
// attention runs whole on those heads, and a second all-to-all trades back. The context group is
// a TensorGroup too (the same collectives), and its ranks hold the whole layers (or, with a tensor
// group as well, the same shards): their gradients are averaged with the data-parallel ones.
//
// Sequence parallelism (Megatron's SP) shards what lies between the tensor-parallel layers (norms,
// dropout, residuals) along the sequence instead of repeating it on every rank: a column-parallel
// layer all-gathers its input from the sequence shards, a row-parallel one reduce-scatters its
// output into them. The same bytes travel as with one all-reduce; the activations between the
// layers take 1/T of the memory. A parameter used in a sequence-sharded region (a norm's weight)
// sees only this rank's rows: pass it through CopyToTensorRegion where it is used, so that its
// gradient is summed over the group.
//
// The layers talk to the group through TensorGroup, which parallel/tensor_group.h implements
// over a process group (as ZeRO's UnitGatherer, shard_unit.h). With a null group, or a group of
// one rank, every mapping is the identity and every layer is the whole layer: a model written
// with them runs unchanged in one process.
//
// Exactness: each layer can take its shard from the whole layer (ShardOf) and give the whole
// back (WholeOf), so a model built from one seed and then split trains as the one-process model
// does, up to the order of floating-point sums; a checkpoint can hold the whole model.
//
// Activations are batch first ([batch, sequence, features]); the sequence is dimension 1.
//
// Recipe for a user's own blocks (`g` = Accelerator::tensor_group(), T ranks; C features, H heads):
//   attention, heads split:
//     qkv = ColumnParallelLinear(C, 3 * C, g, ColumnParallelOptions().fused(3));
//     proj = RowParallelLinear(C, C, g);
//     y = qkv(x).view({B, S, 3, H / T, C / H})  ->  attention over this rank's H / T heads
//         ->  .view({B, S, C / T});
//     out = proj(y);  // whole again: summed over the group
//   MLP, hidden features split:
//     fc1 = ColumnParallelLinear(C, 4 * C, g);  fc2 = RowParallelLinear(4 * C, C, g);
//     out = fc2(gelu(fc1(x)));
//   vocabulary: VocabParallelEmbedding for the tokens, a ColumnParallelLinear head whose logits
//   stay split, and VocabParallelCrossEntropy on them.
//
// Part of the library's API (accelerator.h includes it); includes LibTorch. Collective: every
// rank of the group runs the same forwards and backwards through the same layers, in order.

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace launch::trainer {

// The ranks that split the layers. Held by the layers and by the autograd graph of a forward (it
// lives until that forward's backward ran).
class TensorGroup : public torch::CustomClassHolder {
 public:
  virtual int size() const = 0;
  virtual int rank() const = 0;
  // The sum (max) over the group, in place. COLLECTIVE. Throws c10::Error when a peer failed.
  virtual void AllReduceSum(torch::Tensor& values) = 0;
  virtual void AllReduceMax(torch::Tensor& values) = 0;
  // Every rank's `part` concatenated along dimension 0, in rank order. COLLECTIVE: the same
  // shape and dtype on every rank.
  virtual torch::Tensor AllGather(const torch::Tensor& part) = 0;
  // The sum over the group of `whole`, this rank's 1/size() of it along dimension 0.
  // COLLECTIVE; REQUIRES whole.size(0) divisible by size().
  virtual torch::Tensor ReduceScatter(const torch::Tensor& whole) = 0;
  // `blocks[r]` goes to rank r; returns what the ranks sent this one, block r from rank r (the
  // same shape). COLLECTIVE: the same shape and dtype on every rank; REQUIRES blocks.size(0) ==
  // size().
  virtual torch::Tensor AllToAll(const torch::Tensor& blocks) = 0;
};
using TensorGroupPtr = c10::intrusive_ptr<TensorGroup>;

// The group's size and this rank's place in it (1 and 0 for a null group).
int TensorSize(const TensorGroupPtr& group);
int TensorRank(const TensorGroupPtr& group);

// The conjugate mappings (above). `dim` is where a tensor is split (negative counts from the
// end); a split dimension must be divisible by the group's size.
torch::Tensor CopyToTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group);
torch::Tensor ReduceFromTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group);
torch::Tensor ScatterToTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                    int64_t dim = -1);
torch::Tensor GatherFromTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                     int64_t dim = -1);
torch::Tensor GatherFromSequenceRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                       int64_t dim = 1);
torch::Tensor ReduceScatterToSequenceRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                            int64_t dim = 1);

// Dimension `scatter` of `x` split into the group's size blocks, block r sent to rank r, and what
// the ranks sent back concatenated along dimension `gather` in rank order (Ulysses' exchange:
// scatter the heads, gather the sequence, and back). Its backward is the reverse exchange.
// `x` itself for a null group or one rank. c10::Error when dimension `scatter` does not split.
torch::Tensor AllToAllRegion(const torch::Tensor& x, const TensorGroupPtr& group, int64_t scatter,
                             int64_t gather);

// `ln` on `x`; with `sequence_parallel`, `x` is this rank's sequence shard and the norm's weight
// and bias pass through CopyToTensorRegion, so their gradients are summed over the group.
torch::Tensor SequenceParallelNorm(torch::nn::LayerNorm& ln, const torch::Tensor& x,
                                   const TensorGroupPtr& group, bool sequence_parallel);

// How a whole parameter is cut over a tensor group: along dimension `dim` (-1: not cut, every
// rank holds it whole), each of `blocks` equal blocks of that dimension split evenly (a fused
// q/k/v weight: 3 blocks, each rank holding its heads of each). The cut is a property of the
// architecture, not of the group's size: a checkpoint written with T shards is re-cut into
// another T' with it (state/reshard.h).
struct TensorSplit {
  int64_t dim = -1;
  int64_t blocks = 1;
  bool split() const { return dim >= 0; }
};
// Shard `index` of `parts` of `whole` cut as `split` (a contiguous copy; `whole` itself when not
// split). c10::Error when the dimension does not divide.
torch::Tensor CutShard(const torch::Tensor& whole, TensorSplit split, int64_t parts, int64_t index);
// The whole tensor from all its shards in rank order: CutShard's inverse.
torch::Tensor JoinShards(const std::vector<torch::Tensor>& shards, TensorSplit split);

// A layer whose parameters are shards of a whole layer's. Parameter names are the whole layer's
// (weight, bias), so a state dict maps onto the whole model by name.
class TensorParallelLayer {
 public:
  virtual ~TensorParallelLayer() = default;
  // How the whole parameter `name` is cut over the group.
  virtual TensorSplit SplitOf(const std::string& name) const = 0;
  // This rank's shard of the whole layer's parameter `name` (a copy of the right slice).
  // c10::Error naming both shapes when `whole` has the wrong one.
  virtual torch::Tensor ShardOf(const std::string& name, const torch::Tensor& whole) const = 0;
  // The whole parameter `name` from this rank's shard `part`. COLLECTIVE (an all-gather) for a
  // split parameter; `part` itself for a replicated one.
  virtual torch::Tensor WholeOf(const std::string& name, const torch::Tensor& part) const = 0;
  // Whether parameter `name` is split over the group (counted once per shard in a norm) or
  // replicated on every rank of it (counted once in all).
  bool IsSplit(const std::string& name) const { return SplitOf(name).split(); }
};

struct ColumnParallelOptions {
  // Whether the layer has a bias (split like the outputs).
  ColumnParallelOptions& bias(bool b) {
    bias_ = b;
    return *this;
  }
  // All-gather the outputs (every rank gets all of them) instead of leaving them split.
  ColumnParallelOptions& gather_output(bool b) {
    gather_output_ = b;
    return *this;
  }
  // The input is sharded along the sequence (all-gathered here; its gradient reduce-scattered).
  ColumnParallelOptions& sequence_parallel(bool b) {
    sequence_parallel_ = b;
    return *this;
  }
  // The outputs are `n` equal blocks of features computed together (attention's q, k, v: 3); each
  // rank takes its share of every block, so the local output is n blocks of out/(n x T).
  ColumnParallelOptions& fused(int64_t n) {
    fused_ = n;
    return *this;
  }
  bool bias_ = true;
  bool gather_output_ = false;
  bool sequence_parallel_ = false;
  int64_t fused_ = 1;
};

// y = x A^T + b with A's rows (the outputs) split over the group: weight [out/T, in], bias
// [out/T]. Output: this rank's out/T features (all `out` with gather_output).
class ColumnParallelLinearImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  ColumnParallelLinearImpl(int64_t in, int64_t out, TensorGroupPtr group,
                           ColumnParallelOptions options = {});
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor ShardOf(const std::string& name, const torch::Tensor& whole) const override;
  torch::Tensor WholeOf(const std::string& name, const torch::Tensor& part) const override;
  TensorSplit SplitOf(const std::string&) const override { return {0, options_.fused_}; }

  torch::Tensor weight, bias;

 private:
  int64_t in_, out_;
  TensorGroupPtr group_;
  ColumnParallelOptions options_;
};
TORCH_MODULE(ColumnParallelLinear);

// y = x A^T + b with A's columns (the inputs) split over the group: weight [out, in/T], bias [out]
// (replicated, added once after the sum). Input: this rank's in/T features (or all of them,
// split here, when !input_is_parallel). Output: all `out` features, summed over the group (with
// sequence_parallel: this rank's sequence shard of them).
class RowParallelLinearImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  RowParallelLinearImpl(int64_t in, int64_t out, TensorGroupPtr group, bool bias = true,
                        bool input_is_parallel = true, bool sequence_parallel = false);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor ShardOf(const std::string& name, const torch::Tensor& whole) const override;
  torch::Tensor WholeOf(const std::string& name, const torch::Tensor& part) const override;
  TensorSplit SplitOf(const std::string& name) const override {
    return name == "weight" ? TensorSplit{1, 1} : TensorSplit{};
  }

  torch::Tensor weight, bias;

 private:
  int64_t in_, out_;
  TensorGroupPtr group_;
  bool input_is_parallel_, sequence_parallel_;
};
TORCH_MODULE(RowParallelLinear);

// An Embedding whose rows (the vocabulary) are split over the group: weight [vocab/T, dim]. Each
// rank looks up the ids in its range (zeros for the others) and the group sums them: output
// [..., dim], whole (with sequence_parallel: this rank's sequence shard, input [B, S]).
class VocabParallelEmbeddingImpl : public torch::nn::Module, public TensorParallelLayer {
 public:
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, TensorGroupPtr group,
                             bool sequence_parallel = false);
  torch::Tensor forward(const torch::Tensor& ids);
  torch::Tensor ShardOf(const std::string& name, const torch::Tensor& whole) const override;
  torch::Tensor WholeOf(const std::string& name, const torch::Tensor& part) const override;
  TensorSplit SplitOf(const std::string&) const override { return {0, 1}; }

  torch::Tensor weight;

 private:
  int64_t vocab_, dim_;
  TensorGroupPtr group_;
  bool sequence_parallel_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Cross-entropy of logits split over the group along the vocabulary (the last dimension, this
// rank's vocab/T classes: a ColumnParallelLinear head's output), without gathering them: the
// group agrees on each row's max, the sum of its exponentials and the target's logit (three
// all-reduces of one value per row). Returns the per-row loss (logits' shape without the last
// dimension), equal to cross_entropy(gathered logits, target, reduction none). `target` holds
// whole-vocabulary class ids.
torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& target,
                                        const TensorGroupPtr& group);

// Every TensorParallelLayer in `module` (itself included) with its dotted path ("" for itself).
std::vector<std::pair<std::string, TensorParallelLayer*>> TensorParallelLayers(
    torch::nn::Module& module);

// Loads `parallel`'s parameters and buffers from `whole` (the same model built whole, same
// names): a tensor-parallel layer's parameters take their shards (ShardOf), everything else is
// copied. c10::Error naming the parameter when a name is missing or a shape does not fit.
void LoadShardsFromWhole(torch::nn::Module& parallel, torch::nn::Module& whole);

// The whole model's parameters and buffers by dotted name (state_dict order), gathered from the
// shards (WholeOf). COLLECTIVE over every tensor group the layers use.
std::vector<std::pair<std::string, torch::Tensor>> WholeStateOf(torch::nn::Module& parallel);

// How each split parameter of `module` is cut, by dotted name (the replicated ones are absent).
std::map<std::string, TensorSplit> TensorSplits(torch::nn::Module& module);

// Whether the trained parameter `param` of `module` is split (the others are replicated over the
// tensor group). For norms and checksums: a replicated parameter counts once, not T times.
std::vector<bool> SplitParameters(torch::nn::Module& module,
                                  const std::vector<torch::Tensor>& params);

}  // namespace launch::trainer
