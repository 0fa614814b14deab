#include "trainer_runtime/model/sync_batchnorm.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <stdexcept>

#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace launch::trainer {
namespace {

// The sum over the group as an autograd function: the gradient of a sum over the members with
// respect to each member's part is the sum over the members of the gradients that came back,
// so the backward is the same all-reduce. Everything else in the layer is plain autograd, which
// makes its backward exactly the gradient of batch normalisation over the whole global batch
// (the all-reduced gradient terms of torch.nn.SyncBatchNorm's backward, derived by autograd).
class AllReduceSumFunction : public torch::autograd::Function<AllReduceSumFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& local,
                               c10::intrusive_ptr<BatchNormGroup> group) {
    torch::Tensor sum = local.clone();
    group->AllReduceSum(sum);
    // The graph keeps the group alive until the backward ran.
    ctx->saved_data["group"] = c10::IValue::make_capsule(std::move(group));
    return sum;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto group =
        c10::static_intrusive_pointer_cast<BatchNormGroup>(ctx->saved_data["group"].toCapsule());
    torch::Tensor sum = grads[0].contiguous().clone();
    group->AllReduceSum(sum);
    return {sum, torch::Tensor()};
  }
};

class ProcessGroupBatchNormGroup : public BatchNormGroup {
 public:
  explicit ProcessGroupBatchNormGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg)
      : pg_(std::move(pg)) {}
  void AllReduceSum(torch::Tensor& values) override {
    std::vector<at::Tensor> v = {values};
    pg_->allreduce(v, c10d::AllreduceOptions())->wait();
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
};

// BatchNorm's own rule for the running statistics' factor, advancing num_batches_tracked: the
// momentum, or with none 1 / batches seen (a cumulative average).
double AdvanceRunningFactor(SyncBatchNormImpl& bn) {
  double factor = bn.options.momentum() ? *bn.options.momentum() : 0.0;
  if (bn.is_training() && bn.options.track_running_stats() && bn.num_batches_tracked.defined()) {
    bn.num_batches_tracked += 1;
    if (!bn.options.momentum()) factor = 1.0 / bn.num_batches_tracked.item<double>();
  }
  return factor;
}

template <typename BatchNormT>
std::shared_ptr<SyncBatchNormImpl> FromBatchNorm(const BatchNormT& bn) {
  auto sync = std::make_shared<SyncBatchNormImpl>(bn.options);
  torch::NoGradGuard no_grad;
  auto copy = [](torch::Tensor& dst, const torch::Tensor& src) {
    if (!src.defined()) return;
    dst.copy_(src);
    dst.set_requires_grad(src.requires_grad());
  };
  copy(sync->weight, bn.weight);
  copy(sync->bias, bn.bias);
  copy(sync->running_mean, bn.running_mean);
  copy(sync->running_var, bn.running_var);
  copy(sync->num_batches_tracked, bn.num_batches_tracked);
  sync->train(bn.is_training());
  return sync;
}

// `module` as a SyncBatchNorm when it is a BatchNorm1d/2d/3d; null otherwise.
std::shared_ptr<SyncBatchNormImpl> AsSync(const std::shared_ptr<torch::nn::Module>& module) {
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm1dImpl*>(module.get())) return FromBatchNorm(*bn);
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm2dImpl*>(module.get())) return FromBatchNorm(*bn);
  if (auto* bn = dynamic_cast<torch::nn::BatchNorm3dImpl*>(module.get())) return FromBatchNorm(*bn);
  return nullptr;
}

// A Sequential runs its own list of modules (not its registered children), so it is rebuilt
// with the converted entries; null when it holds nothing to convert.
std::shared_ptr<torch::nn::SequentialImpl> ConvertSequential(torch::nn::SequentialImpl& seq,
                                                             int* converted);

// Converts `child` (registered as `name` under `parent`), or what lies below it.
void ConvertChild(torch::nn::Module& parent, const std::string& name,
                  const std::shared_ptr<torch::nn::Module>& child, int* converted) {
  if (auto sync = AsSync(child)) {
    parent.replace_module(name, sync);
    ++*converted;
  } else if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(child.get())) {
    if (auto rebuilt = ConvertSequential(*seq, converted)) parent.replace_module(name, rebuilt);
  } else {
    for (const auto& item : child->named_children())
      ConvertChild(*child, item.key(), item.value(), converted);
  }
}

std::shared_ptr<torch::nn::SequentialImpl> ConvertSequential(torch::nn::SequentialImpl& seq,
                                                             int* converted) {
  const int before = *converted;
  auto rebuilt = std::make_shared<torch::nn::SequentialImpl>();
  const auto names = seq.named_children();
  size_t i = 0;
  for (const torch::nn::AnyModule& entry : seq) {
    const std::string& name = names[i++].key();
    std::shared_ptr<torch::nn::Module> module = entry.ptr();
    if (auto sync = AsSync(module)) {
      rebuilt->push_back(name, sync);
      ++*converted;
    } else {
      // Deeper levels are converted in place (a Sequential cannot hold a Sequential).
      for (const auto& item : module->named_children())
        ConvertChild(*module, item.key(), item.value(), converted);
      rebuilt->push_back(name, torch::nn::AnyModule(entry));  // the same module
    }
  }
  if (*converted == before) return nullptr;
  rebuilt->train(seq.is_training());
  return rebuilt;
}

}  // namespace

// --- Groups ----------------------------------------------------------------------------------

c10::intrusive_ptr<BatchNormGroup> ProcessBatchNormGroup(
    c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  return c10::make_intrusive<ProcessGroupBatchNormGroup>(std::move(pg));
}

// The replicas meet in rounds: each deposits its vector; the last to arrive sums them in
// member order (the same bits whichever thread is last) and opens the next round. A member
// copies the result before it can start another round, and no round completes without it, so
// a result is never overwritten while someone still needs it. A replica that fails breaks the
// rendezvous (Break), so the others throw instead of waiting for it forever.
struct ThreadBatchNormGroup::Rendezvous {
  Mutex mu;
  CondVar cv{&mu};
  int active GUARDED_BY(mu) = 0;
  int arrived GUARDED_BY(mu) = 0;
  uint64_t round GUARDED_BY(mu) = 0;
  bool broken GUARDED_BY(mu) = false;
  std::vector<torch::Tensor> slots GUARDED_BY(mu);
  torch::Tensor result GUARDED_BY(mu);

  [[noreturn]] static void ThrowBroken() {
    throw std::runtime_error(
        "SyncBatchNorm: another replica failed in this step (its error follows)");
  }

  void AllReduceSum(int member, torch::Tensor& values) {
    MutexLock lock(&mu);
    if (broken) ThrowBroken();
    slots[static_cast<size_t>(member)] = values;
    if (++arrived == active) {
      torch::Tensor sum = slots[0].clone();
      for (int k = 1; k < active; ++k) sum.add_(slots[static_cast<size_t>(k)]);
      result = sum;
      arrived = 0;
      ++round;
      cv.NotifyAll();
    } else {
      const uint64_t mine = round;
      while (round == mine && !broken) cv.Wait();
      if (round == mine) ThrowBroken();
    }
    values.copy_(result);
  }
};

namespace {
class ThreadMember : public BatchNormGroup {
 public:
  ThreadMember(std::shared_ptr<ThreadBatchNormGroup::Rendezvous> rendezvous, int k)
      : rendezvous_(std::move(rendezvous)), k_(k) {}
  void AllReduceSum(torch::Tensor& values) override { rendezvous_->AllReduceSum(k_, values); }

 private:
  std::shared_ptr<ThreadBatchNormGroup::Rendezvous> rendezvous_;
  int k_;
};
}  // namespace

ThreadBatchNormGroup::ThreadBatchNormGroup(int members)
    : rendezvous_(std::make_shared<Rendezvous>()) {
  rendezvous_->slots.resize(static_cast<size_t>(members));
  rendezvous_->active = members;
  for (int k = 0; k < members; ++k)
    members_.push_back(c10::make_intrusive<ThreadMember>(rendezvous_, k));
}

ThreadBatchNormGroup::~ThreadBatchNormGroup() = default;

c10::intrusive_ptr<BatchNormGroup> ThreadBatchNormGroup::member(int k) const {
  return members_[static_cast<size_t>(k)];
}

void ThreadBatchNormGroup::SetActive(int n) {
  MutexLock lock(&rendezvous_->mu);
  rendezvous_->active = n;
  rendezvous_->arrived = 0;
  rendezvous_->broken = false;
}

void ThreadBatchNormGroup::Break() {
  {
    MutexLock lock(&rendezvous_->mu);
    rendezvous_->broken = true;
  }
  rendezvous_->cv.NotifyAll();
}

// --- The module ------------------------------------------------------------------------------

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options)
    : options(options) {
  reset();
}

void SyncBatchNormImpl::reset() {
  // BatchNorm's parameters and buffers, under BatchNorm's names.
  const int64_t c = options.num_features();
  if (options.affine()) {
    weight = register_parameter("weight", torch::ones({c}));
    bias = register_parameter("bias", torch::zeros({c}));
  } else {
    weight = register_parameter("weight", torch::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", torch::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", torch::zeros({c}));
    running_var = register_buffer("running_var", torch::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
  } else {
    running_mean = register_buffer("running_mean", torch::Tensor());
    running_var = register_buffer("running_var", torch::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", torch::Tensor());
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "launch::trainer::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", affine=" << options.affine() << ", group=" << (group_ ? "set" : "none") << ")";
}

torch::Tensor SyncBatchNormImpl::forward(const torch::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2 && input.size(1) == options.num_features(),
              "SyncBatchNorm: expected an N x ", options.num_features(), " x ... input, got ",
              input.sizes());
  const double factor = AdvanceRunningFactor(*this);
  if (!is_training() || !group_) {
    // BatchNorm exactly (LibTorch's BatchNorm forward, the same call).
    return torch::nn::functional::detail::batch_norm(
        input, running_mean, running_var, weight, bias,
        is_training() || !options.track_running_stats(), factor, options.eps());
  }
  const int64_t c = input.size(1);
  std::vector<int64_t> reduce = {0};
  std::vector<int64_t> shape = {1, c};
  for (int64_t d = 2; d < input.dim(); ++d) {
    reduce.push_back(d);
    shape.push_back(1);
  }
  // Sums in float64: the variance is E[x^2] - mean^2 over the global batch, which float32 sums
  // would leave with rounding a two-pass variance does not have.
  const torch::Tensor x = input.to(torch::kDouble);
  const double local_count = static_cast<double>(input.numel() / c);
  const torch::Tensor local =
      torch::cat({x.sum(reduce), (x * x).sum(reduce), torch::full({1}, local_count, x.options())});
  const torch::Tensor global = AllReduceSumFunction::apply(local, group_);
  const torch::Tensor count = global.narrow(0, 2 * c, 1);
  const torch::Tensor mean = global.narrow(0, 0, c) / count;
  const torch::Tensor var = global.narrow(0, c, c) / count - mean * mean;
  if (options.track_running_stats()) {
    torch::NoGradGuard no_grad;
    const double n = count.item<double>();
    // BatchNorm's rule: the running variance is the unbiased estimate.
    running_mean.mul_(1 - factor).add_(mean.detach().to(running_mean.scalar_type()), factor);
    running_var.mul_(1 - factor)
        .add_((var.detach() * (n / std::max(n - 1, 1.0))).to(running_var.scalar_type()), factor);
  }
  torch::Tensor y = (x - mean.view(shape)) * torch::rsqrt(var + options.eps()).view(shape);
  y = y.to(input.scalar_type());
  if (options.affine()) y = y * weight.view(shape) + bias.view(shape);
  return y;
}

// --- Conversion ------------------------------------------------------------------------------

std::shared_ptr<torch::nn::Module> ConvertSyncBatchNorm(std::shared_ptr<torch::nn::Module> module,
                                                        int* converted) {
  int count = 0;
  std::shared_ptr<torch::nn::Module> out = module;
  if (auto sync = AsSync(module)) {
    out = sync;
    count = 1;
  } else if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(module.get())) {
    if (auto rebuilt = ConvertSequential(*seq, &count)) out = rebuilt;
  } else {
    for (const auto& item : module->named_children())
      ConvertChild(*module, item.key(), item.value(), &count);
  }
  if (converted) *converted = count;
  return out;
}

int SetBatchNormGroup(torch::nn::Module& module, const c10::intrusive_ptr<BatchNormGroup>& group) {
  int n = 0;
  if (auto* own = dynamic_cast<SyncBatchNormImpl*>(&module)) {
    own->set_group(group);
    ++n;
  }
  for (const auto& child : module.modules(/*include_self=*/false))
    if (auto* sync = dynamic_cast<SyncBatchNormImpl*>(child.get())) {
      sync->set_group(group);
      ++n;
    }
  return n;
}

Status AttachBatchNormGroup(torch::nn::Module& module,
                            const c10::intrusive_ptr<BatchNormGroup>& group) {
  if (SetBatchNormGroup(module, group) > 0) return Status::Ok();
  return Status::InvalidConfig(
      "train.parallel.sync_batchnorm: the model has no SyncBatchNorm layers (build it with "
      "SyncBatchNorm, or convert its BatchNorm layers with ConvertSyncBatchNorm before Prepare: "
      "trainer_runtime/model/sync_batchnorm.h; a TorchScript model's cannot be converted)");
}

}  // namespace launch::trainer
