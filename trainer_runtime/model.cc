#include "trainer_runtime/model.h"

#include <torch/script.h>

#include <cmath>
#include <fstream>

namespace launch::trainer {

std::vector<torch::Tensor> Model::Parameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : NamedParameters()) out.push_back(p);
  return out;
}

namespace {

NamedTensors FromDict(const torch::OrderedDict<std::string, torch::Tensor>& dict) {
  NamedTensors out;
  for (const auto& item : dict) out.emplace_back(item.key(), item.value());
  return out;
}

// --- MLP: Linear -> ReLU -> ... -> Linear. --------------------------------------------------
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(const std::vector<int64_t>& widths, double dropout) : dropout_(dropout) {
    for (size_t i = 0; i + 1 < widths.size(); ++i)
      layers_.push_back(
          register_module("fc" + std::to_string(i), torch::nn::Linear(widths[i], widths[i + 1])));
  }
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
  std::vector<torch::nn::Linear> layers_;
  double dropout_;
};
TORCH_MODULE(Mlp);

// --- Causal transformer LM (pre-LayerNorm GPT block). ---------------------------------------
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl(int64_t d_model, int64_t heads, double dropout) : heads_(heads), dropout_(dropout) {
    ln1_ = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    qkv_ = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
    proj_ = register_module("proj", torch::nn::Linear(d_model, d_model));
    ln2_ = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    fc1_ = register_module("fc1", torch::nn::Linear(d_model, 4 * d_model));
    fc2_ = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask) {
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

 private:
  int64_t heads_;
  double dropout_;
  torch::nn::LayerNorm ln1_{nullptr}, ln2_{nullptr};
  torch::nn::Linear qkv_{nullptr}, proj_{nullptr}, fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(Block);

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const config::ModelConfig& cfg) : context_(cfg.context) {
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
  int64_t context_;
  torch::nn::Embedding tok_{nullptr}, pos_{nullptr};
  std::vector<Block> blocks_;
  torch::nn::LayerNorm ln_{nullptr};
  torch::nn::Linear head_{nullptr};
};
TORCH_MODULE(Transformer);

// Adapts a torch::nn::Module holder (Mlp, Transformer) to Model.
template <typename Holder>
class NativeModel : public Model {
 public:
  explicit NativeModel(Holder module) : module_(std::move(module)) {}
  torch::Tensor Forward(const torch::Tensor& input) override { return module_->forward(input); }
  NamedTensors NamedParameters() override { return FromDict(module_->named_parameters()); }
  NamedTensors NamedBuffers() override { return FromDict(module_->named_buffers()); }
  void SetTraining(bool training) override { module_->train(training); }

 private:
  Holder module_;
};

class ScriptModel : public Model {
 public:
  explicit ScriptModel(torch::jit::Module module) : module_(std::move(module)) {}
  torch::Tensor Forward(const torch::Tensor& input) override {
    return module_.forward({input}).toTensor();
  }
  NamedTensors NamedParameters() override {
    NamedTensors out;
    // The parameter_list iterator is not STL-compatible (PLATFORM.md): plain loop.
    for (const auto& item : module_.named_parameters(/*recurse=*/true))
      out.emplace_back(item.name, item.value);
    return out;
  }
  NamedTensors NamedBuffers() override {
    NamedTensors out;
    for (const auto& item : module_.named_buffers(/*recurse=*/true))
      out.emplace_back(item.name, item.value);
    return out;
  }
  void SetTraining(bool training) override {
    if (training) {
      module_.train();
    } else {
      module_.eval();
    }
  }

 private:
  torch::jit::Module module_;
};

}  // namespace

StatusOr<std::unique_ptr<Model>> CreateModel(const config::ModelConfig& cfg) {
  switch (cfg.type) {
    case config::ModelType::kMlp:
      return std::unique_ptr<Model>(
          std::make_unique<NativeModel<Mlp>>(Mlp(cfg.mlp_layers, cfg.dropout)));
    case config::ModelType::kTransformer:
      return std::unique_ptr<Model>(std::make_unique<NativeModel<Transformer>>(Transformer(cfg)));
    case config::ModelType::kTorchScript: {
      if (cfg.torchscript_path.empty())
        return Status::InvalidConfig(
            "train.model.torchscript: pipeline stage lists are not supported by this trainer "
            "yet; give one file");
      if (!std::ifstream(cfg.torchscript_path))
        return Status::NotFound("train.model.torchscript: cannot read '" + cfg.torchscript_path +
                                "'");
      try {
        torch::jit::Module m = torch::jit::load(cfg.torchscript_path);
        // A module saved in eval mode loads in eval mode (PLATFORM.md).
        m.train();
        auto model = std::make_unique<ScriptModel>(std::move(m));
        if (model->NamedParameters().empty())
          return Status::InvalidConfig("train.model.torchscript: '" + cfg.torchscript_path +
                                       "' has no parameters to train");
        return std::unique_ptr<Model>(std::move(model));
      } catch (const c10::Error& e) {
        return Status::InvalidConfig("train.model.torchscript: cannot load '" +
                                     cfg.torchscript_path + "': " + e.what_without_backtrace());
      }
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
