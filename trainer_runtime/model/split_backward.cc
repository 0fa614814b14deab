#include "trainer_runtime/model/split_backward.h"

#include <map>

namespace launch::trainer {
namespace {

thread_local WeightGradStore* active_store = nullptr;

// x W^T whose backward gives the input's gradient only and leaves the weight's to the store.
// (A bias is added outside: an undefined tensor cannot be an autograd function's input.)
class SplitLinearFunction : public torch::autograd::Function<SplitLinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& input,
                               const torch::Tensor& weight,
                               c10::intrusive_ptr<WeightGradStore> store) {
    ctx->save_for_backward({input, weight});
    // The graph keeps the store alive until the backward ran.
    ctx->saved_data["store"] = c10::IValue::make_capsule(std::move(store));
    return torch::nn::functional::linear(input, weight);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& input = saved[0];
    const torch::Tensor& weight = saved[1];
    const torch::Tensor& grad = grads[0];
    torch::Tensor grad_input;
    if (ctx->needs_input_grad(0)) grad_input = grad.matmul(weight);
    if (ctx->needs_input_grad(1)) {
      auto store =
          c10::static_intrusive_pointer_cast<WeightGradStore>(ctx->saved_data["store"].toCapsule());
      store->Record(input, grad, weight);
    }
    return {grad_input, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

WeightGradStore::Scope::Scope(WeightGradStore* store) : previous_(active_store) {
  active_store = store;
}

WeightGradStore::Scope::~Scope() { active_store = previous_; }

WeightGradStore* WeightGradStore::Active() { return active_store; }

void WeightGradStore::Record(torch::Tensor input, torch::Tensor grad_output, torch::Tensor weight) {
  MutexLock lock(&mu_);
  entries_.push_back({std::move(input), std::move(grad_output), std::move(weight)});
}

bool WeightGradStore::empty() const {
  MutexLock lock(&mu_);
  return entries_.empty();
}

int64_t WeightGradStore::bytes() const {
  MutexLock lock(&mu_);
  int64_t total = 0;
  for (const Entry& e : entries_)
    total += e.input.numel() * e.input.element_size() +
             e.grad_output.numel() * e.grad_output.element_size();
  return total;
}

void WeightGradStore::Flush() {
  std::vector<Entry> entries;
  {
    MutexLock lock(&mu_);
    entries.swap(entries_);
  }
  if (entries.empty()) return;
  // One gradient per parameter (a layer run twice in a chunk adds its two), then one backward
  // rooted at the parameters: their accumulators add into .grad and run their hooks.
  std::vector<torch::Tensor> roots, root_grads;
  std::map<const void*, size_t> slot;
  auto add = [&](const torch::Tensor& param, torch::Tensor g) {
    auto [it, fresh] = slot.emplace(param.unsafeGetTensorImpl(), roots.size());
    if (fresh) {
      roots.push_back(param);
      root_grads.push_back(std::move(g));
    } else {
      root_grads[it->second].add_(g);
    }
  };
  {
    torch::NoGradGuard no_grad;
    for (const Entry& e : entries) {
      // [..., in] and [..., out] as rows: dW = dY^T X over every row.
      const torch::Tensor x = e.input.reshape({-1, e.input.size(-1)});
      const torch::Tensor dy = e.grad_output.reshape({-1, e.grad_output.size(-1)});
      add(e.weight, dy.t().mm(x));
    }
  }
  entries.clear();  // the activations go before the accumulation allocates
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
}

torch::Tensor SplitLinear(const torch::Tensor& input, const torch::Tensor& weight,
                          const torch::Tensor& bias) {
  WeightGradStore* store = active_store;
  if (store == nullptr || !torch::GradMode::is_enabled() || !weight.requires_grad())
    return torch::nn::functional::linear(input, weight, bias);
  torch::Tensor out = SplitLinearFunction::apply(
      input, weight, c10::intrusive_ptr<WeightGradStore>::reclaim_copy(store));
  // The bias' gradient (a sum over rows) comes with the input's: too little work to defer.
  return bias.defined() ? out + bias : out;
}

}  // namespace launch::trainer
