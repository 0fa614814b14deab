#include "trainer_runtime/model/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {
namespace {

thread_local int g_recomputing = 0;

// What backward needs to run the block again as it ran in forward.
struct CheckpointState : torch::CustomClassHolder {
  std::function<torch::Tensor(const torch::Tensor&)> fn;
  // The device the block ran on: its generator and its autocast are the ones restored.
  c10::Device device{c10::DeviceType::CPU};
  torch::Tensor rng;  // that device's default generator's state before the block's forward
  bool autocast = false;
  at::ScalarType autocast_dtype = at::kBFloat16;
  bool input_requires_grad = false;
  torch::Tensor output;  // handed from CheckpointedForward to Function::forward, then dropped
};

// The default generator of `device` (the CPU's, or one CUDA device's: dropout there draws
// from it), through ATen's context so that no CUDA header is needed.
at::Generator DefaultGenerator(c10::Device device) {
  return device.is_cpu() ? at::detail::getDefaultCPUGenerator()
                         : at::globalContext().defaultGenerator(device);
}

torch::Tensor GetRngState(c10::Device device) {
  at::Generator gen = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void SetRngState(c10::Device device, const torch::Tensor& state) {
  at::Generator gen = DefaultGenerator(device);
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// This thread's autocast for `device` as it was in the block's forward, for the recomputation.
class AutocastAs {
 public:
  AutocastAs(c10::DeviceType device, bool enabled, at::ScalarType dtype)
      : device_(device),
        enabled_(enabled),
        previous_enabled_(compat::AutocastEnabled(device)),
        previous_dtype_(compat::AutocastDtype(device)) {
    compat::SetAutocast(device_, enabled, enabled ? dtype : previous_dtype_);
    if (enabled_) at::autocast::increment_nesting();
  }
  ~AutocastAs() {
    // Outermost scope: drop the cached low-precision weight copies, as AutocastScope does.
    if (enabled_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    compat::SetAutocast(device_, previous_enabled_, previous_dtype_);
  }
  AutocastAs(const AutocastAs&) = delete;
  AutocastAs& operator=(const AutocastAs&) = delete;

 private:
  c10::DeviceType device_;
  bool enabled_;
  bool previous_enabled_;
  at::ScalarType previous_dtype_;
};

// The leaves of the graph behind `output` that need gradients (the parameters the block used),
// each once, `except` left out.
std::vector<torch::Tensor> GraphLeaves(const torch::Tensor& output, const torch::Tensor& except) {
  std::vector<torch::Tensor> leaves;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo;
  if (output.grad_fn()) todo.push_back(output.grad_fn().get());
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      if (!acc->variable.is_same(except)) leaves.push_back(acc->variable);
      continue;
    }
    for (const torch::autograd::Edge& edge : node->next_edges())
      if (edge.function) todo.push_back(edge.function.get());
  }
  return leaves;
}

// Its inputs are the block's input and the parameters the block used, so autograd (and DDP's
// find_unused_parameters walk) sees the edges to their AccumulateGrad nodes, and their
// gradients accumulate there as in a plain backward: DDP's hooks fire unchanged.
class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               c10::intrusive_ptr<CheckpointState> state,
                               const torch::Tensor& input, at::TensorList parameters) {
    torch::autograd::variable_list saved = {input};
    saved.insert(saved.end(), parameters.begin(), parameters.end());
    ctx->save_for_backward(saved);
    torch::Tensor output = std::move(state->output);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto state =
        c10::static_intrusive_pointer_cast<CheckpointState>(ctx->saved_data["state"].toCapsule());
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    torch::Tensor x = saved[0].detach().requires_grad_(state->input_requires_grad);
    torch::Tensor output;
    {
      // The same dropout masks as in forward; the stream afterwards as if nothing ran here.
      const torch::Tensor now = GetRngState(state->device);
      SetRngState(state->device, state->rng);
      ++g_recomputing;
      try {
        torch::AutoGradMode grad(true);
        AutocastAs amp(state->device.type(), state->autocast, state->autocast_dtype);
        output = state->fn(x);
      } catch (...) {
        --g_recomputing;
        SetRngState(state->device, now);
        throw;
      }
      --g_recomputing;
      SetRngState(state->device, now);
    }
    // Gradients for the Function's inputs: the block's input and the parameters it used
    // (saved[1..], the same tensors the recomputed graph reaches). torch::autograd::grad
    // returns them without accumulating; the engine then accumulates them through the
    // parameters' AccumulateGrad nodes, where DDP's hooks are.
    torch::autograd::variable_list out(saved.size() + 1);  // state, input, parameters...
    if (!output.requires_grad()) return out;
    torch::autograd::variable_list wrt(saved.begin() + 1, saved.end());
    if (state->input_requires_grad) wrt.insert(wrt.begin(), x);
    if (wrt.empty()) return out;
    torch::autograd::variable_list grads =
        torch::autograd::grad({output}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                              /*create_graph=*/false, /*allow_unused=*/true);
    size_t next = 0;
    if (state->input_requires_grad) out[1] = grads[next++];
    for (size_t i = 2; i < out.size(); ++i) out[i] = grads[next++];
    return out;
  }
};

}  // namespace

bool RecomputingForCheckpoint() { return g_recomputing > 0; }

torch::Tensor CheckpointedForward(std::function<torch::Tensor(const torch::Tensor&)> fn,
                                  const torch::Tensor& input) {
  TORCH_CHECK(input.defined(), "CheckpointedForward: undefined input");
  if (!torch::GradMode::is_enabled()) return fn(input);
  auto state = c10::make_intrusive<CheckpointState>();
  state->device = input.device();
  state->rng = GetRngState(state->device);
  state->autocast = compat::AutocastEnabled(state->device.type());
  state->autocast_dtype = compat::AutocastDtype(state->device.type());
  state->input_requires_grad = input.requires_grad();
  // Recorded once to find the parameters (activation_checkpoint.h); the graph and its
  // activations go at the end of this scope.
  std::vector<torch::Tensor> parameters;
  {
    torch::Tensor x = input.detach().requires_grad_(state->input_requires_grad);
    torch::Tensor output = fn(x);
    if (!output.requires_grad()) return output;  // nothing to differentiate
    parameters = GraphLeaves(output, x);
    state->output = output.detach();
  }
  state->fn = std::move(fn);
  return CheckpointFunction::apply(state, input, at::TensorList(parameters));
}

}  // namespace launch::trainer
