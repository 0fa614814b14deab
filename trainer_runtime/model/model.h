#pragma once

// The accelerator's view of a model (Model), the built-in models of `train` (an MLP, a small
// convolutional net, a small causal transformer language model, and any TorchScript module
// saved from Python), how `train` calls them (RunForward), the optimizer factory the YAML's
// `optimizer:` section describes, and the trained model written for PyTorch (SaveForPython).
//
// Internal to trainer_runtime (includes LibTorch). Not thread-safe: one training loop owns it.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/model/tensor_parallel.h"

namespace launch::trainer {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// A module that maps one tensor to one tensor: the built-in models, the TorchScript wrapper
// and the pipeline stages of `train` implement it so the loop can call any of them.
class TensorForward {
 public:
  virtual ~TensorForward() = default;
  virtual torch::Tensor Forward(const torch::Tensor& input) = 0;
};

// A torch::nn::Module as the parallel machinery sees it. Shares the module (the user keeps
// theirs). What is trained, communicated and checkpointed is the same set everywhere:
//   - parameters that require grad, in registration order (DDP buckets gradients in reverse of
//     this order), each tensor once even when modules share it (tied weights): PyTorch DDP
//     filters and de-duplicates the same way;
//   - every buffer (running statistics), each once.
class Model {
 public:
  explicit Model(std::shared_ptr<torch::nn::Module> module) : module_(std::move(module)) {}

  torch::nn::Module& module() { return *module_; }
  const torch::nn::Module& module() const { return *module_; }
  const std::shared_ptr<torch::nn::Module>& shared_module() const { return module_; }
  NamedTensors NamedParameters() const;
  NamedTensors NamedBuffers() const;
  std::vector<torch::Tensor> Parameters() const;
  void SetTraining(bool training) { module_->train(training); }
  // Calls TensorForward::Forward. REQUIRES: the module implements TensorForward.
  torch::Tensor Forward(const torch::Tensor& input);
  // Whether the parameter called `name` (as NamedParameters gives it) belongs to a
  // normalisation layer (BatchNorm, LayerNorm, GroupNorm, InstanceNorm, ... by module type, in
  // a TorchScript module too).
  bool InNormLayer(const std::string& name) const;

 private:
  std::shared_ptr<torch::nn::Module> module_;
};

// What one forward pass gave: the logits (undefined when the model returns only a loss) and
// the model's own loss (undefined unless it computed one).
struct ForwardOutput {
  torch::Tensor logits;
  torch::Tensor loss;
};

// Runs `module` on `batch` as train.model configures: a TorchScript module (LoadScriptModule)
// gets the batch fields cfg.inputs names, in order (`input` = batch.data, `target` =
// batch.target), and its output is read by cfg.output_logits / cfg.output_loss (tensor, tuple
// or dict; see config/train_config.h); any other module implements TensorForward and maps
// batch.data to logits. Throws c10::Error naming the problem for an output it cannot read.
ForwardOutput RunForward(torch::nn::Module& module, const torch::data::Example<>& batch,
                         const config::ModelConfig& cfg);

// Builds the configured built-in model (a Cloneable module implementing TensorForward).
// Parameters are initialised from the current global torch seed (the trainer seeds it first),
// so every rank builds identical weights before the broadcast.
// TorchScript: loads `torchscript_path`; NotFound / InvalidConfig with the path on failure.
// With a tensor group of more than one rank (the transformer only; InvalidConfig naming the key
// otherwise): this rank's shards of the model the seed gives whole (tensor_parallel.h), its
// blocks sequence-parallel if asked. With a context group of more than one rank (the transformer
// only): the model takes this rank's part of each sequence (Accelerator::ContextShard) and its
// attention exchanges heads for tokens over the group.
StatusOr<std::unique_ptr<Model>> CreateModel(const config::ModelConfig& cfg,
                                             const TensorGroupPtr& tensor = TensorGroupPtr(),
                                             bool sequence_parallel = false,
                                             const TensorGroupPtr& context = TensorGroupPtr());

// A TorchScript module (torch::jit::load) as a torch::nn::Module implementing TensorForward:
// its parameters and buffers are registered under their dotted names with '.' -> '_'
// (torch::nn::Module forbids dots), each tensor once, frozen parameters with requires_grad
// false. clone() deep-copies the script module (dp replicas). NotFound / InvalidConfig naming
// `key` (the YAML key) and the path.
StatusOr<torch::nn::AnyModule> LoadScriptModule(const std::string& path, const std::string& key);

// The configured optimizer (sgd | adam | adamw) over `params`; shared by the data-parallel loop
// and the pipeline stages so both train with exactly the same update rule. Adam and AdamW step
// as c.implementation says (fused_adam.h); InvalidConfig naming
// train.optimizer.implementation where this LibTorch cannot (fused without fused kernels).
// REQUIRES: c passed CheckTrainRules (sgd's implementation is auto or for_loop).
StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakeOptimizer(const config::OptimizerConfig& c,
                                                                 std::vector<torch::Tensor> params);
// The same over the model's trained parameters in two groups: weight_decay for most, 0 for
// those c.no_decay leaves out (a name containing a pattern; `norm` also takes normalisation
// layers' parameters). The first group decays; an empty group is left out.
StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakeOptimizer(const config::OptimizerConfig& c,
                                                                 const Model& model);
// Bytes of the per-parameter state `optimizer` holds (Adam's and AdamW's moments, SGD's and
// RMSprop's momentum, RMSprop's averages, Adagrad's sums); 0 before its first step.
int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer);

// The parameter names c.no_decay leaves out of weight decay, in NamedParameters order.
std::vector<std::string> NoDecayParameters(const config::OptimizerConfig& c, const Model& model);

// Writes the model for PyTorch in Python, atomically: a TorchScript module as itself with its
// current weights (torch.jit.load gives the trained model); any other module as a dict of
// every parameter and buffer name (dotted, as state_dict names them) to its tensor, which
// torch.load reads (torch::pickle_save's format). IoError naming `path` on failure.
Status SaveForPython(const Model& model, const std::string& path);
// The same for a state dict given by name (a tensor-parallel model's whole state: WholeStateOf).
Status SaveStateForPython(const NamedTensors& state, const std::string& path);
// One state-dict file from several that SaveStateForPython or SaveForPython wrote (a pipeline's
// stages, in order; their names do not overlap): the whole model. IoError naming the file.
Status MergeStatesForPython(const std::vector<std::string>& parts, const std::string& path);

// FNV-1a over the raw bytes of `params` in order (a GPU tensor's are read on the host): equal
// checksums mean bit-identical weights. final.json's param_checksum, Accelerator::Finish's
// check that replicas agree.
uint64_t ParameterChecksum(const std::vector<torch::Tensor>& params);

}  // namespace launch::trainer
