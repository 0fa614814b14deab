#pragma once

// Models the trainer can train, behind one interface: a built-in MLP, a small causal
// transformer language model (character/byte level) and any TorchScript module saved from
// Python (torch.jit.script / torch.jit.trace; forward(x) -> logits).
//
// Internal to trainer_runtime (includes LibTorch). Not thread-safe: one training loop owns it.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "launcher/config.h"

namespace launch::trainer {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

class Model {
 public:
  virtual ~Model() = default;
  // Logits: [B, classes] for an MLP, [B, T, vocab] for a language model.
  virtual torch::Tensor Forward(const torch::Tensor& input) = 0;
  // In registration order, which is the forward order for the built-in models (DDP buckets
  // gradients in reverse of this order). The tensors alias the model's own storage.
  virtual NamedTensors NamedParameters() = 0;
  virtual NamedTensors NamedBuffers() = 0;
  virtual void SetTraining(bool training) = 0;

  std::vector<torch::Tensor> Parameters();
};

// Builds the configured model. Parameters are initialised from the current global torch seed
// (the trainer seeds it first), so every rank builds identical weights before the broadcast.
// TorchScript: loads `torchscript_path`; NotFound / InvalidConfig with the path on failure.
StatusOr<std::unique_ptr<Model>> CreateModel(const config::ModelConfig& cfg);

// The configured optimizer (sgd | adam | adamw) over `params`; shared by the data-parallel loop
// and the pipeline stages so both train with exactly the same update rule.
std::unique_ptr<torch::optim::Optimizer> MakeOptimizer(const config::OptimizerConfig& c,
                                                       std::vector<torch::Tensor> params);

}  // namespace launch::trainer
