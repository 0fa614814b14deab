#include "trainer_runtime/model/tensor_parallel.h"

#include <cmath>
#include <map>
#include <unordered_set>

#include "trainer_runtime/model/split_backward.h"

namespace launch::trainer {
namespace {

bool Unsplit(const TensorGroupPtr& group) { return !group || group->size() <= 1; }

// What a mapping does to a tensor, forward or backward.
enum class MapOp : int64_t { kIdentity, kAllReduce, kAllGather, kReduceScatter, kSplit, kAllToAll };

// `op` on `x` along `dim` (kAllToAll: scatters `dim` in blocks, block r to rank r, and joins what
// came back along `other`).
torch::Tensor Apply(MapOp op, const torch::Tensor& x, TensorGroup& group, int64_t dim,
                    int64_t other) {
  switch (op) {
    case MapOp::kIdentity:
      return x;
    case MapOp::kAllReduce: {
      torch::Tensor sum = x.contiguous().clone();
      group.AllReduceSum(sum);
      return sum;
    }
    case MapOp::kAllGather:
      // Gathering along dimension 0 of the moved tensor concatenates along `dim`.
      return group.AllGather(x.movedim(dim, 0).contiguous()).movedim(0, dim).contiguous();
    case MapOp::kReduceScatter:
      return group.ReduceScatter(x.movedim(dim, 0).contiguous()).movedim(0, dim).contiguous();
    case MapOp::kSplit:
      return x.chunk(group.size(), dim)[static_cast<size_t>(group.rank())].contiguous();
    case MapOp::kAllToAll:
      return torch::cat(group.AllToAll(torch::stack(x.chunk(group.size(), dim), 0)).unbind(0),
                        other);
  }
  return x;
}

// One mapping and its conjugate as an autograd function, each with its dimensions.
class ConjugateFunction : public torch::autograd::Function<ConjugateFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               TensorGroupPtr group, int64_t forward_op, int64_t backward_op,
                               int64_t dim, int64_t other, int64_t backward_dim,
                               int64_t backward_other) {
    torch::Tensor out = Apply(static_cast<MapOp>(forward_op), x, *group, dim, other);
    ctx->saved_data["backward_op"] = backward_op;
    ctx->saved_data["dim"] = backward_dim;
    ctx->saved_data["other"] = backward_other;
    // The graph keeps the group alive until the backward ran.
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto group =
        c10::static_intrusive_pointer_cast<TensorGroup>(ctx->saved_data["group"].toCapsule());
    const auto op = static_cast<MapOp>(ctx->saved_data["backward_op"].toInt());
    torch::autograd::variable_list out(8);
    out[0] = Apply(op, grads[0], *group, ctx->saved_data["dim"].toInt(),
                   ctx->saved_data["other"].toInt());
    return out;
  }
};

torch::Tensor Conjugate(const torch::Tensor& x, const TensorGroupPtr& group, MapOp forward,
                        MapOp backward, int64_t dim) {
  if (Unsplit(group)) return x;
  if (forward == MapOp::kSplit || forward == MapOp::kReduceScatter)
    TORCH_CHECK(x.size(dim) % group->size() == 0, "tensor parallelism: dimension ", dim,
                " of size ", x.size(dim), " does not split over ", group->size(), " ranks");
  dim = x.dim() > 0 ? (dim + x.dim()) % x.dim() : 0;
  return ConjugateFunction::apply(x, group, static_cast<int64_t>(forward),
                                  static_cast<int64_t>(backward), dim, 0, dim, 0);
}

void CheckShape(const torch::Tensor& whole, at::IntArrayRef expected, const std::string& what) {
  TORCH_CHECK(whole.sizes() == expected, "tensor parallelism: ", what, " has shape ", whole.sizes(),
              ", expected ", expected);
}

// Linear's own initialisation (torch::nn::LinearImpl::reset_parameters) of a shard whose whole
// layer has `fan_in` inputs: the same distribution as the whole layer's, and for a whole layer
// (one rank) the same random draws in the same order.
void InitLinear(torch::Tensor& weight, torch::Tensor& bias, int64_t fan_in) {
  torch::NoGradGuard no_grad;
  const double gain = std::sqrt(2.0 / (1 + 5.0));  // kaiming_uniform_ with a = sqrt(5)
  const double bound = gain * std::sqrt(3.0 / static_cast<double>(fan_in));
  weight.uniform_(-bound, bound);
  if (bias.defined()) {
    const double b = 1 / std::sqrt(static_cast<double>(fan_in));
    bias.uniform_(-b, b);
  }
}

}  // namespace

torch::Tensor CutShard(const torch::Tensor& whole, TensorSplit split, int64_t parts,
                       int64_t index) {
  if (!split.split()) return whole;
  TORCH_CHECK(whole.dim() > split.dim && whole.size(split.dim) % (split.blocks * parts) == 0,
              "tensor parallelism: a tensor of shape ", whole.sizes(), " does not cut into ",
              split.blocks, " blocks of ", parts, " shards along dimension ", split.dim);
  std::vector<torch::Tensor> pieces;
  for (const torch::Tensor& block : whole.chunk(split.blocks, split.dim))
    pieces.push_back(block.chunk(parts, split.dim)[static_cast<size_t>(index)]);
  return torch::cat(pieces, split.dim).contiguous();
}

torch::Tensor JoinShards(const std::vector<torch::Tensor>& shards, TensorSplit split) {
  TORCH_CHECK(!shards.empty(), "tensor parallelism: no shards to join");
  if (!split.split()) return shards.front();
  // Block b of the whole is the concatenation of block b of every shard.
  std::vector<std::vector<torch::Tensor>> blocks(static_cast<size_t>(split.blocks));
  for (const torch::Tensor& shard : shards) {
    auto chunks = shard.chunk(split.blocks, split.dim);
    for (size_t b = 0; b < blocks.size(); ++b) blocks[b].push_back(chunks[b]);
  }
  std::vector<torch::Tensor> whole;
  for (const auto& block : blocks) whole.push_back(torch::cat(block, split.dim));
  return torch::cat(whole, split.dim).contiguous();
}

int TensorSize(const TensorGroupPtr& group) { return group ? group->size() : 1; }
int TensorRank(const TensorGroupPtr& group) { return group ? group->rank() : 0; }

torch::Tensor CopyToTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group) {
  return Conjugate(x, group, MapOp::kIdentity, MapOp::kAllReduce, 0);
}
torch::Tensor ReduceFromTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group) {
  return Conjugate(x, group, MapOp::kAllReduce, MapOp::kIdentity, 0);
}
torch::Tensor ScatterToTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                    int64_t dim) {
  return Conjugate(x, group, MapOp::kSplit, MapOp::kAllGather, dim);
}
torch::Tensor GatherFromTensorRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                     int64_t dim) {
  return Conjugate(x, group, MapOp::kAllGather, MapOp::kSplit, dim);
}
torch::Tensor GatherFromSequenceRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                       int64_t dim) {
  return Conjugate(x, group, MapOp::kAllGather, MapOp::kReduceScatter, dim);
}
torch::Tensor ReduceScatterToSequenceRegion(const torch::Tensor& x, const TensorGroupPtr& group,
                                            int64_t dim) {
  return Conjugate(x, group, MapOp::kReduceScatter, MapOp::kAllGather, dim);
}

torch::Tensor AllToAllRegion(const torch::Tensor& x, const TensorGroupPtr& group, int64_t scatter,
                             int64_t gather) {
  if (Unsplit(group)) return x;
  scatter = (scatter + x.dim()) % x.dim();
  gather = (gather + x.dim()) % x.dim();
  TORCH_CHECK(x.size(scatter) % group->size() == 0, "context parallelism: dimension ", scatter,
              " of size ", x.size(scatter), " does not split over ", group->size(), " ranks");
  // The reverse exchange sends every gradient block back where its input block came from.
  const auto all_to_all = static_cast<int64_t>(MapOp::kAllToAll);
  return ConjugateFunction::apply(x, group, all_to_all, all_to_all, scatter, gather, gather,
                                  scatter);
}

torch::Tensor SequenceParallelNorm(torch::nn::LayerNorm& ln, const torch::Tensor& x,
                                   const TensorGroupPtr& group, bool sequence_parallel) {
  if (!sequence_parallel) return ln->forward(x);
  return torch::layer_norm(x, ln->options.normalized_shape(), CopyToTensorRegion(ln->weight, group),
                           CopyToTensorRegion(ln->bias, group), ln->options.eps());
}

// --- ColumnParallelLinear --------------------------------------------------------------------

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, TensorGroupPtr group,
                                                   ColumnParallelOptions options)
    : in_(in), out_(out), group_(std::move(group)), options_(options) {
  const int64_t split = options_.fused_ * TensorSize(group_);
  TORCH_CHECK(options_.fused_ >= 1 && out % split == 0, "ColumnParallelLinear: ", out,
              " outputs do not split into ", options_.fused_, " blocks over ", TensorSize(group_),
              " ranks");
  weight = register_parameter("weight", torch::empty({out / TensorSize(group_), in}));
  if (options_.bias_) bias = register_parameter("bias", torch::empty({out / TensorSize(group_)}));
  InitLinear(weight, bias, in);
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  const torch::Tensor input = options_.sequence_parallel_ ? GatherFromSequenceRegion(x, group_)
                                                          : CopyToTensorRegion(x, group_);
  torch::Tensor y = SplitLinear(input, weight, bias);
  if (!options_.gather_output_) return y;
  if (options_.fused_ == 1) return GatherFromTensorRegion(y, group_);
  // Gathered blocks come rank by rank; each rank's holds its share of every fused block.
  const int t = TensorSize(group_);
  if (t == 1) return y;
  torch::Tensor gathered = GatherFromTensorRegion(y, group_);  // [..., t * fused * k]
  auto sizes = gathered.sizes().vec();
  const int64_t k = out_ / (options_.fused_ * t);
  std::vector<int64_t> blocks(sizes.begin(), sizes.end() - 1);
  blocks.insert(blocks.end(), {t, options_.fused_, k});
  return gathered.view(blocks).transpose(-3, -2).reshape(sizes);
}

torch::Tensor ColumnParallelLinearImpl::ShardOf(const std::string& name,
                                                const torch::Tensor& whole) const {
  if (name == "weight")
    CheckShape(whole, {out_, in_}, "ColumnParallelLinear's whole weight");
  else
    CheckShape(whole, {out_}, "ColumnParallelLinear's whole bias");
  return CutShard(whole, SplitOf(name), TensorSize(group_), TensorRank(group_));
}

torch::Tensor ColumnParallelLinearImpl::WholeOf(const std::string&,
                                                const torch::Tensor& part) const {
  const int t = TensorSize(group_);
  if (t == 1) return part;
  torch::Tensor gathered = group_->AllGather(part.contiguous());  // [t * fused * k, ...]
  auto sizes = gathered.sizes().vec();
  std::vector<int64_t> blocks = {t, options_.fused_, out_ / (options_.fused_ * t)};
  blocks.insert(blocks.end(), sizes.begin() + 1, sizes.end());
  return gathered.view(blocks).transpose(0, 1).reshape(sizes).contiguous();
}

// --- RowParallelLinear -----------------------------------------------------------------------

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, TensorGroupPtr group,
                                             bool with_bias, bool input_is_parallel,
                                             bool sequence_parallel)
    : in_(in),
      out_(out),
      group_(std::move(group)),
      input_is_parallel_(input_is_parallel),
      sequence_parallel_(sequence_parallel) {
  TORCH_CHECK(in % TensorSize(group_) == 0, "RowParallelLinear: ", in, " inputs do not split over ",
              TensorSize(group_), " ranks");
  TORCH_CHECK(!sequence_parallel || input_is_parallel,
              "RowParallelLinear: sequence parallelism needs its input split (input_is_parallel)");
  weight = register_parameter("weight", torch::empty({out, in / TensorSize(group_)}));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}));
  InitLinear(weight, bias, in);
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  const torch::Tensor input = input_is_parallel_ ? x : ScatterToTensorRegion(x, group_);
  // Linear's own maths when whole (bit for bit).
  if (Unsplit(group_)) return SplitLinear(input, weight, bias);
  torch::Tensor partial = SplitLinear(input, weight);
  torch::Tensor y = sequence_parallel_ ? ReduceScatterToSequenceRegion(partial, group_)
                                       : ReduceFromTensorRegion(partial, group_);
  if (!bias.defined()) return y;
  // Added once, after the sum. On a sequence shard each rank's gradient covers its rows only.
  return y + (sequence_parallel_ ? CopyToTensorRegion(bias, group_) : bias);
}

torch::Tensor RowParallelLinearImpl::ShardOf(const std::string& name,
                                             const torch::Tensor& whole) const {
  if (name != "weight") {
    CheckShape(whole, {out_}, "RowParallelLinear's whole bias");
    return whole.clone();
  }
  CheckShape(whole, {out_, in_}, "RowParallelLinear's whole weight");
  return CutShard(whole, SplitOf(name), TensorSize(group_), TensorRank(group_));
}

torch::Tensor RowParallelLinearImpl::WholeOf(const std::string& name,
                                             const torch::Tensor& part) const {
  if (name != "weight" || TensorSize(group_) == 1) return part;
  return group_->AllGather(part.t().contiguous()).t().contiguous();
}

// --- VocabParallelEmbedding ------------------------------------------------------------------

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim,
                                                       TensorGroupPtr group, bool sequence_parallel)
    : vocab_(vocab), dim_(dim), group_(std::move(group)), sequence_parallel_(sequence_parallel) {
  TORCH_CHECK(vocab % TensorSize(group_) == 0, "VocabParallelEmbedding: a vocabulary of ", vocab,
              " does not split over ", TensorSize(group_), " ranks");
  weight = register_parameter("weight", torch::empty({vocab / TensorSize(group_), dim}));
  torch::NoGradGuard no_grad;
  weight.normal_(0, 1);  // Embedding's own initialisation
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  if (Unsplit(group_)) return torch::embedding(weight, ids);
  const int64_t rows = weight.size(0), first = rows * TensorRank(group_);
  const torch::Tensor outside = (ids < first) | (ids >= first + rows);
  const torch::Tensor local = (ids - first).masked_fill(outside, 0);
  const torch::Tensor found = torch::embedding(weight, local).masked_fill(outside.unsqueeze(-1), 0);
  return sequence_parallel_ ? ReduceScatterToSequenceRegion(found, group_)
                            : ReduceFromTensorRegion(found, group_);
}

torch::Tensor VocabParallelEmbeddingImpl::ShardOf(const std::string& name,
                                                  const torch::Tensor& whole) const {
  CheckShape(whole, {vocab_, dim_}, "VocabParallelEmbedding's whole weight");
  return CutShard(whole, SplitOf(name), TensorSize(group_), TensorRank(group_));
}

torch::Tensor VocabParallelEmbeddingImpl::WholeOf(const std::string&,
                                                  const torch::Tensor& part) const {
  return TensorSize(group_) == 1 ? part : group_->AllGather(part.contiguous());
}

// --- VocabParallelCrossEntropy ---------------------------------------------------------------

namespace {

class VocabParallelCrossEntropyFunction
    : public torch::autograd::Function<VocabParallelCrossEntropyFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                               const torch::Tensor& target, TensorGroupPtr group) {
    const int64_t classes = logits.size(-1), first = classes * group->rank();
    const torch::Tensor in_range = (target >= first) & (target < first + classes);
    const torch::Tensor local = (target - first).masked_fill(~in_range, 0).unsqueeze(-1);
    torch::Tensor max = std::get<0>(logits.max(-1)).contiguous();
    group->AllReduceMax(max);
    const torch::Tensor shifted = logits - max.unsqueeze(-1);
    torch::Tensor picked =
        shifted.gather(-1, local).squeeze(-1).masked_fill(~in_range, 0).contiguous();
    group->AllReduceSum(picked);
    const torch::Tensor exp = shifted.exp();
    torch::Tensor sum = exp.sum(-1).contiguous();
    group->AllReduceSum(sum);
    ctx->save_for_backward({exp / sum.unsqueeze(-1), local, in_range});
    return sum.log() - picked;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    // d loss / d logits = softmax - one-hot(target): the one only on the rank holding it.
    torch::Tensor grad = saved[0].clone();
    grad.scatter_add_(-1, saved[1], -saved[2].to(grad.scalar_type()).unsqueeze(-1));
    return {grad * grads[0].unsqueeze(-1), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor VocabParallelCrossEntropy(const torch::Tensor& logits, const torch::Tensor& target,
                                        const TensorGroupPtr& group) {
  if (Unsplit(group)) {
    const torch::Tensor flat = logits.reshape({-1, logits.size(-1)});
    return torch::nn::functional::cross_entropy(
               flat, target.reshape({-1}),
               torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
        .view(target.sizes());
  }
  return VocabParallelCrossEntropyFunction::apply(logits, target, group);
}

// --- Whole models ----------------------------------------------------------------------------

std::vector<std::pair<std::string, TensorParallelLayer*>> TensorParallelLayers(
    torch::nn::Module& module) {
  std::vector<std::pair<std::string, TensorParallelLayer*>> layers;
  for (const auto& item : module.named_modules("", /*include_self=*/true))
    if (auto* layer = dynamic_cast<TensorParallelLayer*>(item.value().get()))
      layers.emplace_back(item.key(), layer);
  return layers;
}

namespace {

// Each parameter of a tensor-parallel layer by its dotted name: the layer and the local name.
std::map<std::string, std::pair<TensorParallelLayer*, std::string>> LayerParameters(
    torch::nn::Module& module) {
  std::map<std::string, std::pair<TensorParallelLayer*, std::string>> out;
  for (const auto& [path, layer] : TensorParallelLayers(module)) {
    auto* as_module = dynamic_cast<torch::nn::Module*>(layer);
    for (const auto& p : as_module->named_parameters(/*recurse=*/false))
      out[path.empty() ? p.key() : path + "." + p.key()] = {layer, p.key()};
  }
  return out;
}

}  // namespace

void LoadShardsFromWhole(torch::nn::Module& parallel, torch::nn::Module& whole) {
  const auto layers = LayerParameters(parallel);
  const auto whole_params = whole.named_parameters();
  const auto whole_buffers = whole.named_buffers();
  torch::NoGradGuard no_grad;
  for (const auto& p : parallel.named_parameters()) {
    const torch::Tensor* source = whole_params.find(p.key());
    TORCH_CHECK(source, "tensor parallelism: the whole model has no parameter ", p.key());
    const auto layer = layers.find(p.key());
    torch::Tensor shard = layer == layers.end()
                              ? *source
                              : layer->second.first->ShardOf(layer->second.second, *source);
    TORCH_CHECK(shard.sizes() == p.value().sizes(), "tensor parallelism: parameter ", p.key(),
                " has shape ", p.value().sizes(), ", its shard of the whole model ", shard.sizes());
    p.value().copy_(shard);
  }
  for (const auto& b : parallel.named_buffers()) {
    const torch::Tensor* source = whole_buffers.find(b.key());
    TORCH_CHECK(source, "tensor parallelism: the whole model has no buffer ", b.key());
    b.value().copy_(*source);
  }
}

std::vector<std::pair<std::string, torch::Tensor>> WholeStateOf(torch::nn::Module& parallel) {
  const auto layers = LayerParameters(parallel);
  std::vector<std::pair<std::string, torch::Tensor>> out;
  torch::NoGradGuard no_grad;
  for (const auto& p : parallel.named_parameters()) {
    const auto layer = layers.find(p.key());
    out.emplace_back(p.key(),
                     layer == layers.end()
                         ? p.value().detach()
                         : layer->second.first->WholeOf(layer->second.second, p.value().detach()));
  }
  for (const auto& b : parallel.named_buffers()) out.emplace_back(b.key(), b.value().detach());
  return out;
}

std::map<std::string, TensorSplit> TensorSplits(torch::nn::Module& module) {
  std::map<std::string, TensorSplit> out;
  for (const auto& [name, where] : LayerParameters(module)) {
    const TensorSplit split = where.first->SplitOf(where.second);
    if (split.split()) out[name] = split;
  }
  return out;
}

std::vector<bool> SplitParameters(torch::nn::Module& module,
                                  const std::vector<torch::Tensor>& params) {
  std::unordered_set<const void*> split;
  const auto named = module.named_parameters();
  for (const auto& [name, where] : LayerParameters(module))
    if (where.first->IsSplit(where.second)) split.insert(named[name].unsafeGetTensorImpl());
  std::vector<bool> out;
  for (const torch::Tensor& p : params) out.push_back(split.count(p.unsafeGetTensorImpl()) > 0);
  return out;
}

}  // namespace launch::trainer
