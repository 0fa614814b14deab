#include "trainer_runtime/model.h"

#include <torch/script.h>

#include <cmath>
#include <fstream>
#include <unordered_set>

#include "trainer_runtime/layers.h"

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
class MlpImpl : public torch::nn::Cloneable<MlpImpl>, public TensorForward {
 public:
  MlpImpl(const std::vector<int64_t>& widths, double dropout) : widths_(widths), dropout_(dropout) {
    reset();
  }
  void reset() override {
    layers_.clear();
    for (size_t i = 0; i + 1 < widths_.size(); ++i)
      layers_.push_back(
          register_module("fc" + std::to_string(i), torch::nn::Linear(widths_[i], widths_[i + 1])));
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(torch::Tensor x) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      x = layers_[i]->forward(x);
      if (i + 1 < layers_.size()) {
        x = torch::relu(x);
        if (dropout_ > 0) x = torch::dropout(x, dropout_, is_training());
      }
    }
    return x;
  }

 private:
  std::vector<int64_t> widths_;
  std::vector<torch::nn::Linear> layers_;
  double dropout_;
};
TORCH_MODULE(Mlp);

class TransformerImpl : public torch::nn::Cloneable<TransformerImpl>, public TensorForward {
 public:
  explicit TransformerImpl(const config::ModelConfig& cfg) : cfg_(cfg), context_(cfg.context) {
    reset();
  }
  void reset() override {
    const config::ModelConfig& cfg = cfg_;
    blocks_.clear();
    tok_ = register_module("tok", torch::nn::Embedding(cfg.vocab_size, cfg.d_model));
    pos_ = register_module("pos", torch::nn::Embedding(cfg.context, cfg.d_model));
    for (int64_t i = 0; i < cfg.transformer_layers; ++i)
      blocks_.push_back(
          register_module("block" + std::to_string(i), Block(cfg.d_model, cfg.heads, cfg.dropout)));
    ln_ = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.d_model})));
    head_ = register_module("head", torch::nn::Linear(cfg.d_model, cfg.vocab_size));
    // GPT-style small init keeps the first losses near log(vocab).
    for (auto& p : parameters()) {
      if (p.dim() == 2) torch::nn::init::normal_(p, 0.0, 0.02);
    }
  }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
  torch::Tensor forward(const torch::Tensor& tokens) {
    const int64_t t = tokens.size(1);
    TORCH_CHECK(t <= context_, "sequence length ", t, " exceeds the model context ", context_);
    auto positions = torch::arange(t, torch::kLong);
    auto x = tok_->forward(tokens) + pos_->forward(positions);
    // True above the diagonal: position i may not look at j > i.
    auto mask = torch::ones({t, t}, torch::kBool).triu(1);
    for (auto& block : blocks_) x = block->forward(x, mask);
    return head_->forward(ln_->forward(x));
  }

 private:
  config::ModelConfig cfg_;
  int64_t context_;
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Transformer);

// A TorchScript module behind torch::nn::Module (see LoadScriptModule).
class ScriptModuleImpl : public torch::nn::Module, public TensorForward {
 public:
  explicit ScriptModuleImpl(torch::jit::Module script) : script_(std::move(script)) {
    std::unordered_set<const void*> seen;
    // The parameter_list iterator is not STL-compatible (PLATFORM.md): plain loops.
    for (const auto& item : script_.named_parameters(/*recurse=*/true)) {
      if (!seen.insert(item.value.unsafeGetTensorImpl()).second) continue;  // tied weights
      register_parameter(Flat(item.name), item.value, item.value.requires_grad());
    }
    for (const auto& item : script_.named_buffers(/*recurse=*/true)) {
      if (!seen.insert(item.value.unsafeGetTensorImpl()).second) continue;
      register_buffer(Flat(item.name), item.value);
    }
  }
  torch::Tensor forward(const torch::Tensor& x) { return script_.forward({x}).toTensor(); }
  torch::Tensor Forward(const torch::Tensor& x) override { return forward(x); }
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

 private:
  static std::string Flat(std::string name) {
    for (char& c : name)
      if (c == '.') c = '_';
    return name;
  }
  torch::jit::Module script_;
};

}  // namespace

StatusOr<torch::nn::AnyModule> LoadScriptModule(const std::string& path, const std::string& key) {
  if (!std::ifstream(path)) return Status::NotFound(key + ": cannot read '" + path + "'");
  try {
    torch::jit::Module m = torch::jit::load(path);
    // A module saved in eval mode loads in eval mode (PLATFORM.md).
    m.train();
    return torch::nn::AnyModule(std::make_shared<ScriptModuleImpl>(std::move(m)));
  } catch (const c10::Error& e) {
    return Status::InvalidConfig(key + ": cannot load '" + path +
                                 "': " + e.what_without_backtrace());
  }
}

StatusOr<std::unique_ptr<Model>> CreateModel(const config::ModelConfig& cfg) {
  switch (cfg.type) {
    case config::ModelType::kMlp:
      return std::make_unique<Model>(Mlp(cfg.mlp_layers, cfg.dropout).ptr());
    case config::ModelType::kTransformer:
      return std::make_unique<Model>(Transformer(cfg).ptr());
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

std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const config::OptimizerConfig& c,
                                                       std::vector<torch::Tensor> params) {
  using config::OptimizerType;
  switch (c.type) {
    case OptimizerType::kSgd:
      return std::make_unique<torch::optim::SGD>(
          params, torch::optim::SGDOptions(c.lr).momentum(c.momentum).weight_decay(c.weight_decay));
    case OptimizerType::kAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(c.lr)
                                                              .betas({c.beta1, c.beta2})
                                                              .eps(c.eps)
                                                              .weight_decay(c.weight_decay));
    case OptimizerType::kAdamW:
      return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(c.lr)
                                                               .betas({c.beta1, c.beta2})
                                                               .eps(c.eps)
                                                               .weight_decay(c.weight_decay));
  }
  return nullptr;
}

}  // namespace launch::trainer
