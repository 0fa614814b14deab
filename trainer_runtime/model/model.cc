#include "trainer_runtime/model/model.h"

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/script.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <string_view>
#include <unordered_set>

#include "base/check.h"
#include "base/files.h"
#include "base/strings.h"
#include "trainer_runtime/model/activation_checkpoint.h"
#include "trainer_runtime/model/fused_adam.h"
#include "trainer_runtime/model/layers.h"
#include "trainer_runtime/model/sync_batchnorm.h"

namespace launch::trainer {

NamedTensors Model::NamedParameters() const {
  NamedTensors out;
  std::unordered_set<const void*> seen;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    const torch::Tensor& p = item.value();
    if (!p.requires_grad() || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    out.emplace_back(item.key(), p);
  }
  return out;
}

NamedTensors Model::NamedBuffers() const {
  NamedTensors out;
  std::unordered_set<const void*> seen;
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    if (!item.value().defined() || !seen.insert(item.value().unsafeGetTensorImpl()).second)
      continue;
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

std::vector<torch::Tensor> Model::Parameters() const {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : NamedParameters()) out.push_back(p);
  return out;
}

torch::Tensor Model::Forward(const torch::Tensor& input) {
  auto* f = dynamic_cast<TensorForward*>(module_.get());
  TORCH_CHECK(f != nullptr, "this module has no one-tensor forward (TensorForward)");
  return f->Forward(input);
}

namespace {

// --- MLP: Linear -> ReLU -> ... -> Linear. --------------------------------------------------
// With activation checkpointing the hidden layers run in runs of ceil(sqrt(hidden layers))
// (torch.utils.checkpoint_sequential's rule), each run checkpointed. Per layer would save
// nothing without dropout: ReLU's backward keeps its output, which is also the next Linear's
// saved input, so a plain forward already keeps one activation per layer. Runs keep one per
// run, plus one run's activations while backward recomputes it.
class MlpImpl : public torch::nn::Cloneable<MlpImpl>, public TensorForward {
 public:
  MlpImpl(const std::vector<int64_t>& widths, double dropout, bool checkpoint)
      : widths_(widths), dropout_(dropout), checkpoint_(checkpoint) {
    reset();
  }
  void reset() override {
    layers_.clear();
    for (size_t i = 0; i + 1 < widths_.size(); ++i)
      layers_.push_back(
          register_module("fc" + std::to_string(i), UnitLinear(widths_[i], widths_[i + 1])));
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(torch::Tensor x) {
    if (x.dim() > 2) x = x.flatten(1);  // images [B, C, H, W] -> [B, C*H*W]
    if (layers_.empty()) return x;
    const size_t hidden = layers_.size() - 1;
    const size_t run = checkpoint_
                           ? static_cast<size_t>(std::ceil(std::sqrt(static_cast<double>(hidden))))
                           : hidden;
    for (size_t first = 0; first < hidden; first += run) {
      const size_t last = std::min(hidden, first + run);
      if (checkpoint_) {
        x = CheckpointedForward(
            [this, first, last](const torch::Tensor& h) { return Hidden(h, first, last); }, x);
      } else {
        x = Hidden(x, first, last);
      }
    }
    return layers_.back()->forward(x);
  }

 private:
  // Hidden layers [first, last): Linear, ReLU, dropout.
  torch::Tensor Hidden(torch::Tensor x, size_t first, size_t last) {
    for (size_t i = first; i < last; ++i) {
      x = torch::relu(layers_[i]->forward(x));
      if (dropout_ > 0) x = torch::dropout(x, dropout_, is_training());
    }
    return x;
  }

  std::vector<int64_t> widths_;
  std::vector<UnitLinear> layers_;  // each a ZeRO stage-3 unit
  double dropout_;
  bool checkpoint_;
};
TORCH_MODULE(Mlp);

// --- CNN: [conv 3x3 -> batch norm -> ReLU -> max pool 2x2] per block, then a classifier. -------
// Names follow PyTorch's usual spelling (conv1, bn1, ..., fc, head), so the state dict
// SaveForPython writes loads into the same architecture written in Python.
class CnnImpl : public torch::nn::Cloneable<CnnImpl>, public TensorForward {
 public:
  explicit CnnImpl(const config::ModelConfig& cfg) : cfg_(cfg) { reset(); }
  void reset() override {
    convs_.clear();
    norms_.clear();
    int64_t c = cfg_.input_shape[0], h = cfg_.input_shape[1], w = cfg_.input_shape[2];
    for (size_t i = 0; i < cfg_.cnn_channels.size(); ++i) {
      const int64_t out = cfg_.cnn_channels[i];
      const std::string n = std::to_string(i + 1);
      // A bias before batch norm is cancelled by its mean subtraction: leave it out.
      convs_.push_back(register_module(
          "conv" + n, torch::nn::Conv2d(
                          torch::nn::Conv2dOptions(c, out, 3).padding(1).bias(!cfg_.batch_norm))));
      // BatchNorm2d exactly until train.parallel.sync_batchnorm gives it a group.
      if (cfg_.batch_norm) norms_.push_back(register_module("bn" + n, SyncBatchNorm(out)));
      c = out;
      h /= 2;
      w /= 2;
    }
    const int64_t flat = c * h * w;
    fc_ = nullptr;
    if (cfg_.cnn_hidden > 0) fc_ = register_module("fc", torch::nn::Linear(flat, cfg_.cnn_hidden));
    head_ = register_module(
        "head", torch::nn::Linear(cfg_.cnn_hidden > 0 ? cfg_.cnn_hidden : flat, cfg_.classes));
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < convs_.size(); ++i) {
      if (cfg_.activation_checkpointing) {
        x = CheckpointedForward([this, i](const torch::Tensor& h) { return ConvBlock(i, h); }, x);
      } else {
        x = ConvBlock(i, x);
      }
    }
    x = x.flatten(1);  // back to NCHW order for the classifier (state dicts match PyTorch's)
    if (fc_) x = torch::relu(fc_->forward(x));
    if (cfg_.dropout > 0) x = torch::dropout(x, cfg_.dropout, is_training());
    return head_->forward(x);
  }

 private:
  torch::Tensor ConvBlock(size_t i, torch::Tensor x) {
    // Activations in channels-last (NHWC) layout: LibTorch's CPU max-pool and its backward
    // are several times faster on it than on NCHW, and oneDNN's convolution keeps the layout.
    // BatchNorm too, unless model.channels_last is false: LibTorch 1.13's CPU batch norm on
    // channels-last input sums its statistics less exactly (the gradient of bn1's weight on 64
    // Fashion-MNIST images, against the same model in float64: 3.5e-3 relative error, 3.9e-7
    // on NCHW; trainer_runtime_test checks both), and converting around it costs the
    // quickstart's CNN about a quarter of its throughput on 2 cores. A 1-channel input cannot
    // carry the layout, hence the conversion after each convolution.
    const bool nchw_norm = !norms_.empty() && !cfg_.channels_last;
    x = convs_[i]->forward(x);
    x = x.contiguous(nchw_norm ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast);
    if (!norms_.empty()) {
      SyncBatchNorm& bn = norms_[i];
      if (RecomputingForCheckpoint() && bn->is_training()) {
        // The same batch statistics, but the running ones were updated in forward already.
        x = torch::batch_norm(x, bn->weight, bn->bias, /*running_mean=*/{}, /*running_var=*/{},
                              /*training=*/true, /*momentum=*/0.0, bn->options.eps(),
                              at::globalContext().userEnabledCuDNN());
      } else {
        x = bn->forward(x);
      }
      if (nchw_norm) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    }
    return torch::max_pool2d(torch::relu(x), 2);
  }

  config::ModelConfig cfg_;
  std::vector<torch::nn::Conv2d> convs_;
  std::vector<SyncBatchNorm> norms_;
  torch::nn::Linear fc_{nullptr}, head_{nullptr};
};
TORCH_MODULE(Cnn);

// With a tensor group (tensor_parallel.h): Megatron's GPT. The vocabulary is split in the token
// embedding and the head (whose logits are gathered: the loss sees the whole vocabulary), the
// blocks are tensor-parallel, and with sequence parallelism everything between them runs on this
// rank's 1/T of the sequence. With a context group of G ranks (Ulysses) the model takes this
// rank's part of each sequence (part `context rank` of G equal parts) and gives their logits.
class TransformerImpl : public torch::nn::Cloneable<TransformerImpl>, public TensorForward {
 public:
  explicit TransformerImpl(const config::ModelConfig& cfg, TensorGroupPtr tensor = TensorGroupPtr(),
                           bool sequence_parallel = false,
                           TensorGroupPtr context_group = TensorGroupPtr())
      : cfg_(cfg),
        context_(cfg.context),
        tensor_(std::move(tensor)),
        sequence_parallel_(sequence_parallel && TensorSize(tensor_) > 1),
        context_group_(std::move(context_group)) {
    reset();
  }
  void reset() override {
    const config::ModelConfig& cfg = cfg_;
    blocks_.clear();
    tok_ = register_module("tok", VocabParallelEmbedding(cfg.vocab_size, cfg.d_model, tensor_));
    pos_ = register_module("pos", torch::nn::Embedding(cfg.context, cfg.d_model));
    for (int64_t i = 0; i < cfg.transformer_layers; ++i)
      blocks_.push_back(
          register_module("block" + std::to_string(i),
                          Block(cfg.d_model, cfg.heads, cfg.dropout, cfg.activation_checkpointing,
                                tensor_, sequence_parallel_, context_group_)));
    ln_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
    head_ = register_module(
        "head", ColumnParallelLinear(cfg.d_model, cfg.vocab_size, tensor_,
                                     ColumnParallelOptions().gather_output(true).sequence_parallel(
                                         sequence_parallel_)));
    // GPT-style small init keeps the first losses near log(vocab).
    for (auto& p : parameters()) {
      if (p.dim() == 2) torch::nn::init::normal_(p, 0.0, 0.02);
    }
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(const torch::Tensor& tokens) {
    // This rank's part of the sequence, and the whole sequence's length.
    const int64_t part = tokens.size(1), t = part * TensorSize(context_group_);
    TORCH_CHECK(t <= context_, "sequence length ", t, " exceeds the model context ", context_);
    // On the tokens' device: the model may be on a GPU.
    const auto on = torch::TensorOptions().device(tokens.device());
    auto positions =
        torch::arange(part, on.dtype(torch::kLong)) + part * TensorRank(context_group_);
    auto x = tok_->forward(tokens) + pos_->forward(positions);
    if (sequence_parallel_) {
      TORCH_CHECK(part % TensorSize(tensor_) == 0,
                  "train.parallel.sequence_parallel: a sequence of ", part,
                  " tokens does not split over ", TensorSize(tensor_), " tensor-parallel ranks");
      x = ScatterToTensorRegion(x, tensor_, 1);
    }
    // True above the diagonal: position i may not look at j > i.
    auto mask = torch::ones({t, t}, on.dtype(torch::kBool)).triu(1);
    for (auto& block : blocks_) x = block->forward(x, mask);
    return head_->forward(SequenceParallelNorm(ln_, x, tensor_, sequence_parallel_));
  }

 private:
  config::ModelConfig cfg_;
  int64_t context_;
  TensorGroupPtr tensor_;
  bool sequence_parallel_;
  TensorGroupPtr context_group_;
  VocabParallelEmbedding tok_{nullptr};
  torch::nn::Embedding pos_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_{nullptr};
  ColumnParallelLinear head_{nullptr};
};
TORCH_MODULE(Transformer);

// Whether a module type name (torch::nn's "torch::nn::BatchNorm2dImpl", TorchScript's
// "__torch__.torch.nn.modules.batchnorm.BatchNorm2d") is a normalisation layer.
bool IsNormType(const std::string& type) { return type.find("Norm") != std::string::npos; }

// A TorchScript module behind torch::nn::Module (see LoadScriptModule).
class ScriptModuleImpl : public torch::nn::Module, public TensorForward {
 public:
  explicit ScriptModuleImpl(torch::jit::Module script) : script_(std::move(script)) {
    std::unordered_set<const void*> seen;
    // The parameter_list iterator is not STL-compatible: plain loops.
    for (const auto& item : script_.named_parameters(/*recurse=*/true)) {
      if (!seen.insert(item.value.unsafeGetTensorImpl()).second) continue;  // tied weights
      register_parameter(Flat(item.name), item.value, item.value.requires_grad());
    }
    for (const auto& item : script_.named_buffers(/*recurse=*/true)) {
      if (!seen.insert(item.value.unsafeGetTensorImpl()).second) continue;
      register_buffer(Flat(item.name), item.value);
    }
    for (const auto& sub : script_.named_modules()) {
      const auto type = sub.value.type()->name();
      if (!type || !IsNormType(type->qualifiedName())) continue;
      for (const auto& item : sub.value.named_parameters(/*recurse=*/false))
        norm_parameters_.insert(Flat(sub.name.empty() ? item.name : sub.name + "." + item.name));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return Output(Call({x}), "", "").logits; }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  c10::IValue Call(std::vector<c10::IValue> args) { return script_.forward(std::move(args)); }
  void train(bool on) override {
    torch::nn::Module::train(on);
    script_.train(on);
  }
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device = c10::nullopt) const override {
    auto copy = std::make_shared<ScriptModuleImpl>(script_.deepcopy());
    copy->train(is_training());
    return copy;
  }
  bool InNormLayer(const std::string& flat_name) const {
    return norm_parameters_.count(flat_name) > 0;
  }
  void Save(const std::function<size_t(const void*, size_t)>& write) const {
    torch::jit::ExportModule(script_, write);
  }

  // Reads logits and loss out of what forward returned (see ModelConfig::output_logits).
  static ForwardOutput Output(const c10::IValue& out, const std::string& logits_at,
                              const std::string& loss_at) {
    ForwardOutput r;
    if (out.isTensor()) {
      const torch::Tensor& t = out.toTensor();
      (t.dim() == 0 && logits_at.empty() ? r.loss : r.logits) = t;
      return r;
    }
    if (out.isTuple() || out.isList()) {
      std::vector<c10::IValue> items;
      if (out.isTuple()) {
        items = out.toTupleRef().elements().vec();
      } else {
        for (const c10::IValue& v : out.toListRef()) items.push_back(v);
      }
      auto pick = [&](const std::string& at, const char* what) -> torch::Tensor {
        long long i = 0;
        TORCH_CHECK(ParseInt64(at, &i) && i >= 0 && i < static_cast<int64_t>(items.size()),
                    "train.model.outputs.", what, ": '", at, "' is not an index of the ",
                    items.size(), "-element tuple the model returns");
        TORCH_CHECK(items[static_cast<size_t>(i)].isTensor(), "train.model.outputs.", what,
                    ": element ", i, " of the model's output is a ",
                    items[static_cast<size_t>(i)].tagKind(), ", not a tensor");
        return items[static_cast<size_t>(i)].toTensor();
      };
      r.logits = pick(logits_at.empty() ? "0" : logits_at, "logits");
      if (!loss_at.empty()) r.loss = pick(loss_at, "loss");
      return r;
    }
    if (out.isGenericDict()) {
      std::vector<std::string> keys;
      auto get = [&](const std::string& key) -> torch::Tensor {
        for (const auto& entry : out.toGenericDict()) {
          if (!entry.key().isString() || entry.key().toStringRef() != key) continue;
          if (entry.value().isNone()) return {};
          TORCH_CHECK(entry.value().isTensor(), "the model's output '", key, "' is a ",
                      entry.value().tagKind(), ", not a tensor");
          return entry.value().toTensor();
        }
        return {};
      };
      r.logits = get(logits_at.empty() ? "logits" : logits_at);
      r.loss = get(loss_at.empty() ? "loss" : loss_at);
      TORCH_CHECK(r.logits.defined() || r.loss.defined(), "the model returns a dict without '",
                  logits_at.empty() ? "logits" : logits_at, "' or '",
                  loss_at.empty() ? "loss" : loss_at,
                  "' (set train.model.outputs: {logits: KEY, loss: KEY})");
      return r;
    }
    TORCH_CHECK(false, "the model returns a ", out.tagKind(),
                "; train reads a tensor, a tuple or a dict of tensors");
    return r;
  }

 private:
  static std::string Flat(std::string name) {
    for (char& c : name)
      if (c == '.') c = '_';
    return name;
  }
  torch::jit::Module script_;
  std::unordered_set<std::string> norm_parameters_;
};

}  // namespace

StatusOr<torch::nn::AnyModule> LoadScriptModule(const std::string& path, const std::string& key) {
  if (!std::ifstream(path)) return Status::NotFound(key + ": cannot read '" + path + "'");
  try {
    // No graph fusion on CPU: Debian 13's LibTorch 2.6 compiles fused TorchScript kernels with
    // LLVM on the third forward, and in this program that compile never returned (a 6-32-3
    // MLP, minutes at 100% CPU, no system call). Training the interpreted graph costs little:
    // the model's time is in its linear and convolution kernels, which fusion leaves alone.
    torch::jit::setTensorExprFuserEnabled(false);
    torch::jit::Module m = torch::jit::load(path);
    // A module saved in eval mode loads in eval mode (torch::jit::load keeps its training flag).
    m.train();
    return torch::nn::AnyModule(std::make_shared<ScriptModuleImpl>(std::move(m)));
  } catch (const c10::Error& e) {
    return Status::InvalidConfig(key + ": cannot load '" + path +
                                 "': " + e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<Model>> CreateModel(const config::ModelConfig& cfg,
                                             const TensorGroupPtr& tensor, bool sequence_parallel,
                                             const TensorGroupPtr& context) {
  if (TensorSize(tensor) > 1 || TensorSize(context) > 1) {
    if (cfg.type != config::ModelType::kTransformer)
      return Status::InvalidConfig(
          std::string(TensorSize(tensor) > 1 ? "train.parallel.tensor" : "train.parallel.context") +
          ": the built-in " + config::ToString(cfg.type) +
          " has no tensor- or context-parallel layers (the transformer has)");
    try {
      // Context ranks hold the whole layers: the one-process model, drawn as it draws.
      if (TensorSize(tensor) <= 1)
        return std::make_unique<Model>(Transformer(cfg, tensor, false, context).ptr());
      // The whole model from the seed, then this rank's shards of it: the same initial weights
      // as in one process, whatever the split.
      auto whole = Transformer(cfg);
      auto split = Transformer(cfg, tensor, sequence_parallel, context);
      LoadShardsFromWhole(*split, *whole);
      return std::make_unique<Model>(split.ptr());
    } catch (const c10::Error& e) {
      return Status::InvalidConfig(e.what_without_backtrace());
    }
  }
  switch (cfg.type) {
    case config::ModelType::kMlp:
      return std::make_unique<Model>(
          Mlp(cfg.mlp_layers, cfg.dropout, cfg.activation_checkpointing).ptr());
    case config::ModelType::kTransformer:
      return std::make_unique<Model>(Transformer(cfg).ptr());
    case config::ModelType::kCnn:
      return std::make_unique<Model>(Cnn(cfg).ptr());
    case config::ModelType::kTorchScript: {
      if (cfg.torchscript_path.empty())
        return Status::InvalidConfig(
            "train.model.torchscript: a list of TorchScript files is for pipeline mode (one per "
            "stage); give one file");
      LAUNCH_ASSIGN_OR_RETURN(auto module,
                              LoadScriptModule(cfg.torchscript_path, "train.model.torchscript"));
      auto model = std::make_unique<Model>(module.ptr());
      if (model->NamedParameters().empty())
        return Status::InvalidConfig("train.model.torchscript: '" + cfg.torchscript_path +
                                     "' has no parameters to train");
      return model;
    }
  }
  return Status::Internal("unknown model type");
}

namespace {

// The two groups of one optimizer: `decay` with the options as configured, `plain` with
// weight_decay 0 (PyTorch's param_groups, in that order; an empty group is left out).
template <typename Options>
std::vector<torch::optim::OptimizerParamGroup> Groups(std::vector<torch::Tensor> decay,
                                                      std::vector<torch::Tensor> plain,
                                                      const Options& options) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (!decay.empty()) groups.emplace_back(std::move(decay), std::make_unique<Options>(options));
  if (!plain.empty()) {
    auto no_decay = std::make_unique<Options>(options);
    no_decay->weight_decay(0.0);
    groups.emplace_back(std::move(plain), std::move(no_decay));
  }
  return groups;
}

StatusOr<std::unique_ptr<torch::optim::Optimizer>> BuildGroups(const config::OptimizerConfig& c,
                                                               std::vector<torch::Tensor> decay,
                                                               std::vector<torch::Tensor> plain) {
  using config::OptimizerImplementation;
  using config::OptimizerType;
  namespace optim = torch::optim;
  switch (c.type) {
    case OptimizerType::kSgd: {
      LAUNCH_CHECK(c.implementation == OptimizerImplementation::kAuto ||
                       c.implementation == OptimizerImplementation::kForLoop,
                   "CheckTrainRules lets sgd have auto or for_loop only");
      const auto options =
          optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay);
      return std::unique_ptr<optim::Optimizer>(std::make_unique<optim::SGD>(
          Groups(std::move(decay), std::move(plain), options), options));
    }
    case OptimizerType::kAdam: {
      const auto options = optim::AdamOptions(c.lr)
                               .betas({c.beta1, c.beta2})
                               .eps(c.eps)
                               .weight_decay(c.weight_decay);
      return NewAdam(Groups(std::move(decay), std::move(plain), options), options,
                     c.implementation);
    }
    case OptimizerType::kAdamW: {
      const auto options = optim::AdamWOptions(c.lr)
                               .betas({c.beta1, c.beta2})
                               .eps(c.eps)
                               .weight_decay(c.weight_decay);
      return NewAdam(Groups(std::move(decay), std::move(plain), options), options,
                     c.implementation);
    }
  }
  return Status::Internal("unknown optimizer type");
}

}  // namespace

StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakeOptimizer(
    const config::OptimizerConfig& c, std::vector<torch::Tensor> params) {
  return BuildGroups(c, std::move(params), {});
}

int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  int64_t bytes = 0;
  auto add = [&bytes](const torch::Tensor& t) {
    if (t.defined()) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  };
  for (const auto& [key, state] : optimizer.state()) {
    if (auto* adam = dynamic_cast<const o::AdamParamState*>(state.get())) {
      add(adam->exp_avg()), add(adam->exp_avg_sq()), add(adam->max_exp_avg_sq());
    } else if (auto* adamw = dynamic_cast<const o::AdamWParamState*>(state.get())) {
      add(adamw->exp_avg()), add(adamw->exp_avg_sq()), add(adamw->max_exp_avg_sq());
    } else if (auto* sgd = dynamic_cast<const o::SGDParamState*>(state.get())) {
      add(sgd->momentum_buffer());
    } else if (auto* rms = dynamic_cast<const o::RMSpropParamState*>(state.get())) {
      add(rms->square_avg()), add(rms->momentum_buffer()), add(rms->grad_avg());
    } else if (auto* ada = dynamic_cast<const o::AdagradParamState*>(state.get())) {
      add(ada->sum());
    }
  }
  return bytes;
}

std::vector<std::string> NoDecayParameters(const config::OptimizerConfig& c, const Model& model) {
  std::vector<std::string> out;
  const bool norm = std::find(c.no_decay.begin(), c.no_decay.end(), "norm") != c.no_decay.end();
  for (const auto& [name, p] : model.NamedParameters()) {
    bool excluded = norm && model.InNormLayer(name);
    for (const std::string& pattern : c.no_decay)
      excluded = excluded || name.find(pattern) != std::string::npos;
    if (excluded) out.push_back(name);
  }
  return out;
}

StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakeOptimizer(const config::OptimizerConfig& c,
                                                                 const Model& model) {
  const std::vector<std::string> excluded = NoDecayParameters(c, model);
  const std::unordered_set<std::string> plain_names(excluded.begin(), excluded.end());
  std::vector<torch::Tensor> decay, plain;
  for (const auto& [name, p] : model.NamedParameters())
    (plain_names.count(name) ? plain : decay).push_back(p);
  return BuildGroups(c, std::move(decay), std::move(plain));
}

bool Model::InNormLayer(const std::string& name) const {
  if (const auto* script = dynamic_cast<const ScriptModuleImpl*>(module_.get()))
    return script->InNormLayer(name);
  for (const auto& item : module_->named_modules()) {
    if (!IsNormType(item.value()->name())) continue;
    for (const auto& param : item.value()->named_parameters(/*recurse=*/false)) {
      if ((item.key().empty() ? param.key() : item.key() + "." + param.key()) == name) return true;
    }
  }
  return false;
}

ForwardOutput RunForward(torch::nn::Module& module, const torch::data::Example<>& batch,
                         const config::ModelConfig& cfg) {
  if (auto* script = dynamic_cast<ScriptModuleImpl*>(&module)) {
    std::vector<c10::IValue> args;
    for (const std::string& field : cfg.inputs)
      args.emplace_back(field == "target" ? batch.target : batch.data);
    return ScriptModuleImpl::Output(script->Call(std::move(args)), cfg.output_logits,
                                    cfg.output_loss);
  }
  auto* f = dynamic_cast<TensorForward*>(&module);
  TORCH_CHECK(f != nullptr, "this module has no one-tensor forward (TensorForward)");
  return {f->Forward(batch.data), torch::Tensor()};
}

namespace {

// torch::pickle_save's format (a torch.save zip: data.pkl and one record per tensor), with the
// dict written as a plain dict. pickle_save tags it with torch.jit._pickle.restore_type_tag,
// which PyTorch 2.6's torch.load refuses by default (weights_only=True allows no such global).
// The zip goes to `write` as it is produced; tensors are written from their own storage.
void SaveAsTorchSave(const c10::IValue& value,
                     const std::function<size_t(const void*, size_t)>& write) {
  std::vector<char> pickled;  // the pickle alone: names and tensor references, small
  torch::jit::Pickler pickler(
      [&](const char* bytes, size_t size) { pickled.insert(pickled.end(), bytes, bytes + size); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  caffe2::serialize::PyTorchStreamWriter writer(write);
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
}

}  // namespace

namespace {

// A state dict as torch.load gives it, on the CPU whatever device trained it: model.pt loads
// on any machine.
c10::IValue StateDict(const NamedTensors& state) {
  c10::Dict<std::string, torch::Tensor> dict;
  for (const auto& [name, tensor] : state) dict.insert(name, tensor.detach().cpu());
  return c10::IValue(dict);
}

}  // namespace

Status SaveStateForPython(const NamedTensors& state, const std::string& path) {
  AtomicFileWriter file(path);
  try {
    SaveAsTorchSave(StateDict(state), [&file](const void* bytes, size_t size) -> size_t {
      file.Append(std::string_view(static_cast<const char*>(bytes), size));
      return size;  // errors are kept by `file` (see SaveForPython)
    });
  } catch (const c10::Error& e) {
    return Status::IoError("writing " + path + ": " + e.what_without_backtrace());
  }
  return file.Commit();
}

Status MergeStatesForPython(const std::vector<std::string>& parts, const std::string& path) {
  NamedTensors state;
  for (const std::string& part : parts) {
    LAUNCH_ASSIGN_OR_RETURN(std::string bytes, ReadFile(part));
    try {
      const c10::IValue dict = torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
      for (const auto& item : dict.toGenericDict())
        state.emplace_back(item.key().toStringRef(), item.value().toTensor());
    } catch (const c10::Error& e) {
      return Status::IoError("reading " + part + ": " + e.what_without_backtrace());
    }
  }
  return SaveStateForPython(state, path);
}

Status SaveForPython(const Model& model, const std::string& path) {
  // Streamed into the temp file of an atomic write: no copy of the model in memory. A write
  // error is kept by `file` and reported by Commit; the zip writer is told every write worked,
  // because LibTorch 1.13's writer, told otherwise, throws again from its destructor while the
  // first exception unwinds (std::terminate).
  AtomicFileWriter file(path);
  auto write = [&file](const void* bytes, size_t size) -> size_t {
    file.Append(std::string_view(static_cast<const char*>(bytes), size));
    return size;
  };
  try {
    if (const auto* script = dynamic_cast<const ScriptModuleImpl*>(&model.module())) {
      script->Save(write);
    } else {
      // Every name, tied and frozen parameters included, as PyTorch's state_dict lists them.
      NamedTensors state;
      for (const auto& item : model.module().named_parameters(/*recurse=*/true))
        state.emplace_back(item.key(), item.value());
      for (const auto& item : model.module().named_buffers(/*recurse=*/true))
        state.emplace_back(item.key(), item.value());
      SaveAsTorchSave(StateDict(state), write);
    }
  } catch (const c10::Error& e) {
    return Status::IoError("writing " + path + ": " + e.what_without_backtrace());
  }
  return file.Commit();
}

uint64_t ParameterChecksum(const std::vector<torch::Tensor>& params) {
  uint64_t h = kFnv1aInit;
  for (const auto& p : params) {
    auto t = p.detach().cpu().contiguous();
    const size_t n = static_cast<size_t>(t.numel()) * t.element_size();
    h = Fnv1a64(std::string_view(static_cast<const char*>(t.data_ptr()), n), h);
  }
  return h;
}

}  // namespace launch::trainer
