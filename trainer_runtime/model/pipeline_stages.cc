// Pipeline stages (pipeline_stages.h): the public SequentialStage and the stages of `train`'s
// built-in models (BuildStage).
#include "trainer_runtime/model/pipeline_stages.h"

#include <algorithm>
#include <set>

#include "trainer_runtime/model/layers.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/model/split_backward.h"

namespace launch::trainer {
namespace {

using config::ModelType;

// --- Stage modules ------------------------------------------------------------------------------
// Parameter names equal the whole model's (model.cc), so a stage copies its slice by name and
// checkpoints carry the same names.

// Linear layers [first, last) of the MLP; ReLU (and dropout) after every layer but the model's
// last.
class MlpStageImpl : public torch::nn::Module, public TensorForward {
 public:
  MlpStageImpl(const std::vector<int64_t>& widths, int64_t first, int64_t last, double dropout)
      : first_(first), num_layers_(static_cast<int64_t>(widths.size()) - 1), dropout_(dropout) {
    for (int64_t i = first; i < last; ++i)
      layers_.push_back(register_module(
          "fc" + std::to_string(i),
          torch::nn::Linear(widths[static_cast<size_t>(i)], widths[static_cast<size_t>(i) + 1])));
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      // Linear's maths, its weight gradient left for later in a zero-bubble schedule.
      x = SplitLinear(x, layers_[i]->weight, layers_[i]->bias);
      if (first_ + static_cast<int64_t>(i) + 1 < num_layers_) {
        x = torch::relu(x);
        if (dropout_ > 0) x = torch::dropout(x, dropout_, is_training());
      }
    }
    return x;
  }

 private:
  int64_t first_, num_layers_;
  double dropout_;
  std::vector<torch::nn::Linear> layers_;
};
TORCH_MODULE(MlpStage);

// Blocks [first, last); the first stage also embeds tokens, the last applies ln_f and the head.
// With a tensor group, the transformer of model.cc split the same way (Megatron's layers); with
// sequence parallelism the activations between stages are this rank's 1/T of the sequence.
class TransformerStageImpl : public torch::nn::Module, public TensorForward {
 public:
  TransformerStageImpl(const config::ModelConfig& cfg, int64_t first, int64_t last,
                       TensorGroupPtr tensor, bool sequence_parallel)
      : context_(cfg.context),
        has_embedding_(first == 0),
        has_head_(last == cfg.transformer_layers),
        tensor_(std::move(tensor)),
        sequence_parallel_(sequence_parallel && TensorSize(tensor_) > 1) {
    if (has_embedding_) {
      tok_ = register_module("tok", VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tensor_));
      pos_ = register_module("pos", torch::nn::Embedding(cfg.context, cfg.d_model));
    }
    for (int64_t i = first; i < last; ++i)
      blocks_.push_back(
          register_module("block" + std::to_string(i),
                          Block(cfg.d_model, cfg.heads, cfg.dropout, cfg.activation_checkpointing,
                                tensor_, sequence_parallel_)));
    if (has_head_) {
      ln_ =
          register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
      head_ = register_module(
          "head",
          ColumnParallelLinear(
              cfg.d_model, cfg.vocab_size, tensor_,
              ColumnParallelOptions().gather_output(true).sequence_parallel(sequence_parallel_)));
    }
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(torch::Tensor x) {
    // The whole sequence: a sequence-parallel stage after the first receives a shard of it.
    const int64_t t = x.size(1) * (sequence_parallel_ && !has_embedding_ ? TensorSize(tensor_) : 1);
    if (has_embedding_) {
      TORCH_CHECK(t <= context_, "sequence length ", t, " exceeds the model context ", context_);
      x = tok_->forward(x) +
          pos_->forward(torch::arange(t, torch::TensorOptions(torch::kLong).device(x.device())));
      if (sequence_parallel_) x = ScatterToTensorRegion(x, tensor_, 1);
    }
    auto mask = torch::ones({t, t}, torch::TensorOptions(torch::kBool).device(x.device())).triu(1);
    for (auto& block : blocks_) x = block->forward(x, mask);
    if (!has_head_) return x;
    return head_->forward(SequenceParallelNorm(ln_, x, tensor_, sequence_parallel_));
  }

 private:
  int64_t context_;
  bool has_embedding_, has_head_;
  TensorGroupPtr tensor_;
  bool sequence_parallel_;
  VocabParallelEmbedding tok_{nullptr};
  torch::nn::Embedding pos_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_{nullptr};
  ColumnParallelLinear head_{nullptr};
};
TORCH_MODULE(TransformerStage);

// A Sequential with a one-tensor forward: AnyModule cannot hold Sequential's templated forward.
class StageSequentialImpl : public torch::nn::SequentialImpl {
 public:
  torch::Tensor forward(torch::Tensor x) { return torch::nn::SequentialImpl::forward(x); }
};
TORCH_MODULE(StageSequential);

}  // namespace

std::vector<int64_t> LayerCosts(const config::ModelConfig& m) {
  std::vector<int64_t> costs;
  if (m.type == ModelType::kMlp) {
    for (size_t i = 0; i + 1 < m.mlp_layers.size(); ++i)
      costs.push_back(m.mlp_layers[i] * m.mlp_layers[i + 1] + m.mlp_layers[i + 1]);
  } else if (m.type == ModelType::kTransformer) {
    const int64_t d = m.d_model;
    for (int64_t i = 0; i < m.transformer_layers; ++i) costs.push_back(12 * d * d + 13 * d);
    if (!costs.empty()) {
      costs.front() += (m.vocab_size + m.context) * d;
      costs.back() += 2 * d + d * m.vocab_size + m.vocab_size;
    }
  }
  return costs;
}

StatusOr<torch::nn::AnyModule> BuildStage(const config::TrainConfig& cfg, int stage,
                                          const std::vector<int64_t>& sizes,
                                          const TensorGroupPtr& tensor) {
  const config::ModelConfig& m = cfg.model;
  if (m.type == ModelType::kTorchScript)
    return LoadScriptModule(m.torchscript_stages[static_cast<size_t>(stage)],
                            "train.model.torchscript[" + std::to_string(stage) + "]");
  int64_t first = 0;
  for (int s = 0; s < stage; ++s) first += sizes[static_cast<size_t>(s)];
  const int64_t last = first + sizes[static_cast<size_t>(stage)];
  torch::manual_seed(cfg.seed);
  LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Model> whole, CreateModel(m));
  torch::nn::AnyModule any;
  try {
    if (m.type == ModelType::kMlp) {
      any = torch::nn::AnyModule(MlpStage(m.mlp_layers, first, last, m.dropout));
    } else {
      any = torch::nn::AnyModule(
          TransformerStage(m, first, last, tensor, cfg.parallel.sequence_parallel));
    }
    // The stage's slice of the whole model (its shards of it, split layers).
    LoadShardsFromWhole(*any.ptr(), whole->module());
  } catch (const c10::Error& e) {
    return Status::Internal("pipeline stage " + std::to_string(stage) + ": " +
                            e.what_without_backtrace());
  }
  return any;
}

StatusOr<std::vector<torch::nn::AnyModule>> BuildStageChunks(const config::TrainConfig& cfg,
                                                             int stage,
                                                             const std::vector<int64_t>& sizes,
                                                             const TensorGroupPtr& tensor) {
  std::vector<torch::nn::AnyModule> chunks;
  const int stages = cfg.parallel.stages;
  // Without interleaving (and for a TorchScript list, never interleaved) the stage's own.
  const int count =
      sizes.size() > static_cast<size_t>(stages) ? static_cast<int>(sizes.size()) : stage + 1;
  for (int chunk = stage; chunk < count; chunk += stages) {
    LAUNCH_ASSIGN_OR_RETURN(torch::nn::AnyModule one, BuildStage(cfg, chunk, sizes, tensor));
    chunks.push_back(std::move(one));
  }
  return chunks;
}

StatusOr<std::shared_ptr<torch::nn::Module>> JoinChunks(
    const std::vector<torch::nn::AnyModule>& chunks) {
  auto joined = std::make_shared<torch::nn::Module>("Chunks");
  std::set<std::string> names;
  auto claim = [&](const std::string& name, size_t chunk) -> Status {
    if (names.insert(name).second) return Status::Ok();
    return Status::InvalidArgument("JoinChunks: chunk " + std::to_string(chunk) + " has a '" +
                                   name +
                                   "' as an earlier chunk does; name each chunk's modules as "
                                   "the whole model does (SequentialStage keeps its indices)");
  };
  for (size_t c = 0; c < chunks.size(); ++c) {
    const std::shared_ptr<torch::nn::Module> chunk = chunks[c].ptr();
    for (const auto& item : chunk->named_children()) {
      LAUNCH_RETURN_IF_ERROR(claim(item.key(), c));
      joined->register_module(item.key(), item.value());
    }
    for (const auto& item : chunk->named_parameters(/*recurse=*/false)) {
      LAUNCH_RETURN_IF_ERROR(claim(item.key(), c));
      joined->register_parameter(item.key(), item.value(), item.value().requires_grad());
    }
    for (const auto& item : chunk->named_buffers(/*recurse=*/false)) {
      LAUNCH_RETURN_IF_ERROR(claim(item.key(), c));
      joined->register_buffer(item.key(), item.value());
    }
  }
  return joined;
}

StatusOr<torch::nn::AnyModule> SequentialStage(const torch::nn::Sequential& whole,
                                               const std::vector<int64_t>& layers_per_stage,
                                               int stage) {
  int64_t total = 0;
  for (int64_t n : layers_per_stage) {
    if (n < 1)
      return Status::InvalidArgument("SequentialStage: every stage needs at least one layer");
    total += n;
  }
  if (total != static_cast<int64_t>(whole->size()))
    return Status::InvalidArgument("SequentialStage: the partition covers " +
                                   std::to_string(total) + " layers but the model has " +
                                   std::to_string(whole->size()));
  if (stage < 0 || stage >= static_cast<int>(layers_per_stage.size()))
    return Status::InvalidArgument("SequentialStage: stage " + std::to_string(stage) +
                                   " is not in 0.." + std::to_string(layers_per_stage.size() - 1));
  int64_t first = 0;
  for (int s = 0; s < stage; ++s) first += layers_per_stage[static_cast<size_t>(s)];
  StageSequential part;
  for (int64_t i = first; i < first + layers_per_stage[static_cast<size_t>(stage)]; ++i) {
    // Keep the whole model's names ("3" stays "3"), so checkpoints and logs name layers alike.
    part->push_back(std::to_string(i), *(whole->begin() + i));
  }
  return torch::nn::AnyModule(part);
}

}  // namespace launch::trainer
