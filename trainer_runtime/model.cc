#include "trainer_runtime/model.h"

#include <torch/script.h>

#include <cmath>
#include <fstream>

#include "trainer_runtime/layers.h"

namespace launch::trainer {

std::vector<torch::Tensor> Model::Parameters() {
  std::vector<torch::Tensor> out;
  for (auto& [name, p] : NamedParameters()) out.push_back(p);
  return out;
}

namespace {

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
