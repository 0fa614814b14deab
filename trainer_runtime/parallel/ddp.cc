#include "trainer_runtime/parallel/ddp.h"

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <unordered_map>

#include "base/files.h"
#include "base/mutex.h"
#include "base/strings.h"
#include "base/thread_annotations.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/parallel/power_sgd.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace {

// PyTorch DDP's first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES): small, so communication
// starts as soon as the last layers' gradients exist.
constexpr size_t kFirstBucketBytes = 1u << 20;

// --- DDP communication hook ------------------------------------------------------------------
// Averages each bucket over the world. One special case, measured to matter when per-call
// latency dominates (small models): the LAST bucket of backward with two ranks. Nothing is left
// to overlap it with, so the training thread waits for it anyway; exchanging it directly (each
// rank sends its bucket to the peer and adds the peer's: one round trip, no thread hand-off)
// beats Gloo's ring all-reduce (reduce-scatter + all-gather: two round trips, each through a
// Gloo worker thread). Both ranks compute a + b and b + a, bit-identical in IEEE arithmetic,
// so replicas stay in lockstep. When the group has the shared-memory all-reduce
// (shm_allreduce.h), that bucket is all-reduced through it instead, inline on this thread
// (cheaper than a Gloo round trip; the same hand-off saved). Every other bucket goes to the
// group's asynchronous all-reduce (shared memory or Gloo) and overlaps with the rest of
// backward, as in PyTorch.

class AverageHook : public c10d::CommHookInterface {
 public:
  AverageHook(c10::intrusive_ptr<CountingProcessGroup> pg, size_t exchange_max_bytes)
      : pg_(std::move(pg)), exchange_max_bytes_(exchange_max_bytes) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buffer = bucket.getBufferRef();
    // Divide first (as PyTorch's default path does while copying into the bucket), so the
    // result equals sum_r(g_r / W) bit for bit whichever transport carried it.
    buffer.div_(pg_->getSize());
    const size_t bytes = static_cast<size_t>(buffer.numel() * buffer.element_size());
    // CPU buckets only: a GPU bucket's all-reduce is NCCL's, already one call on the device.
    if (pg_->getSize() == 2 && bucket.isLast() && bytes <= exchange_max_bytes_ && buffer.is_cpu())
      return pg_->shm() ? ShmNow(buffer) : Exchange(buffer);
    std::vector<at::Tensor> tensors = {buffer};
    return pg_->allreduce(tensors, c10d::AllreduceOptions())->getFuture();
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isTensor()) return result.toTensor();
    return result.toTensorVector()[0];  // Gloo's all-reduce future holds a tensor list
  }

 private:
  // Synchronous two-rank exchange; errors (a dead peer) become the future's error, which the
  // reducer rethrows on the training thread.
  c10::intrusive_ptr<c10::ivalue::Future> Exchange(const at::Tensor& buffer) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    pg_->RecordAllreduce(buffer.numel() * buffer.element_size());
    const uint64_t token =
        pg_->RingBegin(CollectiveOp::kAllReduce, buffer.numel() * buffer.element_size());
    const uint64_t trace = Timeline::Get().BeginAsync("allreduce", "last bucket (pair exchange)");
    try {
      const int peer = 1 - pg_->getRank();
      at::Tensor received = at::empty_like(buffer);
      std::vector<at::Tensor> out = {buffer}, in = {received};
      // Tags only need to pair this send with the peer's recv: both ranks exchange the same
      // sequence of last buckets.
      auto send = pg_->send(out, peer, kExchangeTag);
      auto recv = pg_->recv(in, peer, kExchangeTag);
      recv->wait();
      send->wait();
      received.add_(buffer);
      pg_->RingDone(token);
      future->markCompleted(c10::IValue(received));
    } catch (...) {
      pg_->RingDone(token, /*ok=*/false);
      future->setError(std::current_exception());
    }
    Timeline::Get().EndAsync(trace);
    return future;
  }

  // The shared-memory all-reduce on this thread, after the buckets issued before it. Its
  // errors (a dead peer) become the future's error, as Exchange's do.
  c10::intrusive_ptr<c10::ivalue::Future> ShmNow(const at::Tensor& buffer) {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    pg_->RecordAllreduce(buffer.numel() * buffer.element_size());
    const uint64_t trace = Timeline::Get().BeginAsync("allreduce", "last bucket (shared memory)");
    const uint64_t token =
        pg_->RingBegin(CollectiveOp::kAllReduce, buffer.numel() * buffer.element_size());
    const Status status = pg_->shm()->AllReduceNow(buffer);
    pg_->RingDone(token, status.ok());
    Timeline::Get().EndAsync(trace);
    if (status.ok()) {
      future->markCompleted(c10::IValue(buffer));
    } else {
      future->setError(compat::ErrorPtr(status.ToString()));
    }
    return future;
  }

  static constexpr int kExchangeTag = 7301;
  c10::intrusive_ptr<CountingProcessGroup> pg_;
  size_t exchange_max_bytes_;
};

// PyTorch's bf16_compress_hook and fp16_compress_hook (accelerate's `comm_hook: bf16` /
// `fp16`): each bucket is cast to `dtype`, divided by the world size there (first, so that
// float16's sum cannot overflow where the mean would not) and all-reduced in `dtype` (half the
// bytes), then cast back into the bucket. Replicas still agree bit for bit (every rank receives
// the same sum); the averaged gradient keeps the dtype's mantissa (bfloat16 8 bits, float16 11).
class CompressHook : public c10d::CommHookInterface {
 public:
  CompressHook(c10::intrusive_ptr<CountingProcessGroup> pg, at::ScalarType dtype)
      : pg_(std::move(pg)), dtype_(dtype) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    at::Tensor compressed = buffer.to(dtype_).div_(pg_->getSize());
    std::vector<at::Tensor> tensors = {compressed};
    return pg_->allreduce(tensors, c10d::AllreduceOptions())
        ->getFuture()
        ->then(
            [buffer, compressed](c10::ivalue::Future& done) {
              // then() runs this even when the all-reduce failed: keep its error.
              if (done.hasError()) std::rethrow_exception(done.exception_ptr());
              buffer.copy_(compressed);
              return c10::IValue(buffer);
            },
            c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

 private:
  c10::intrusive_ptr<CountingProcessGroup> pg_;
  at::ScalarType dtype_;
};

// This rank's PowerSGD state in checkpoint folder `dir`.
std::string PowerSgdFile(const std::string& dir, int rank) {
  return dir + "/power_sgd_rank" + std::to_string(rank) + ".pt";
}

// --- ddp ---------------------------------------------------------------------------------------
class DdpStrategy : public ParallelStrategy {
 public:
  DdpStrategy(Model* model, c10::intrusive_ptr<CountingProcessGroup> pg, double bucket_cap_mb,
              bool sync_each_batch, bool find_unused_parameters, config::CommHook comm_hook,
              const config::PowerSgdConfig& power_sgd, size_t exchange_max_bytes)
      : bucket_cap_bytes_(static_cast<size_t>(bucket_cap_mb * (1 << 20))),
        sync_each_batch_(sync_each_batch),
        find_unused_(find_unused_parameters),
        comm_hook_(comm_hook),
        exchange_max_bytes_(exchange_max_bytes) {
    model_ = model;
    SetGroup(std::move(pg));
    if (comm_hook_ == config::CommHook::kPowerSgd)
      power_sgd_ = std::make_unique<PowerSgd>(power_sgd, model_->Parameters());
  }

  const char* Name() const override { return "ddp"; }
  bool ReplicasEqual() const override { return true; }
  bool AveragesGradients() const override { return true; }
  bool ReplicasBitEqual() const override { return true; }

  void Setup() override {
    BroadcastModel(pg_, model_);
    BuildReducer();
  }

  // PowerSGD's error feedback is each rank's own: a lost rank's is gone with it.
  bool SupportsInPlaceRecovery() const override { return !power_sgd_; }
  std::string InPlaceRefusal() const override {
    return power_sgd_ ? "comm_hook power_sgd keeps each rank's own error feedback, which a lost "
                        "rank takes with it"
                      : "";
  }

  Status SaveModelState(const std::string& dir, torch::optim::Optimizer& optimizer) override {
    LAUNCH_RETURN_IF_ERROR(ParallelStrategy::SaveModelState(dir, optimizer));
    if (!power_sgd_) return Status::Ok();
    torch::serialize::OutputArchive archive;
    power_sgd_->Save(archive);
    return WriteArchive(archive, PowerSgdFile(dir, rank()));
  }

  Status LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                        int64_t written_by) override {
    LAUNCH_RETURN_IF_ERROR(ParallelStrategy::LoadModelState(dir, optimizer, written_by));
    if (!power_sgd_) return Status::Ok();
    // A rank the checkpoint did not have takes rank 0's factors and starts its error at zero.
    const bool own = FileExists(PowerSgdFile(dir, rank()));
    auto archive = ReadArchive(PowerSgdFile(dir, own ? rank() : 0));
    if (!archive.ok()) return archive.status();
    return power_sgd_->Load(**archive, own);
  }

  void Finish(int64_t steps_done) override {
    (void)steps_done;
    if (!power_sgd_ || rank() != 0 || power_sgd_->numel_before() == 0) return;
    std::printf(
        "train: power_sgd: compressed steps sent %lld of %lld gradient elements (%.1fx less)\n",
        static_cast<long long>(power_sgd_->numel_after()),
        static_cast<long long>(power_sgd_->numel_before()),
        static_cast<double>(power_sgd_->numel_before()) /
            static_cast<double>(std::max<int64_t>(1, power_sgd_->numel_after())));
    std::fflush(stdout);
  }

  void Reform(c10::intrusive_ptr<CountingProcessGroup> pg) override {
    // The old reducer goes first (it holds the broken group and the abandoned step's buckets);
    // the new one starts as the first one did, rebuilding its buckets after its first step on
    // every rank alike.
    reducer_.reset();
    SetGroup(std::move(pg));
    previous_forward_synced_ = true;
    BuildReducer();
  }

 private:
  // The reducer over pg_ and, once per strategy, the gradient-time hooks.
  void BuildReducer() {
    params_ = model_->Parameters();
    // Gradients are produced roughly in reverse parameter order, so assign buckets walking the
    // parameters backwards: the first (small) bucket holds the last layers and can be
    // all-reduced while the earlier layers still compute. Passing tensor_indices makes
    // compute_bucket_assignment_by_size keep that ready order instead of sorting.
    std::vector<at::Tensor> reversed(params_.rbegin(), params_.rend());
    std::vector<int64_t> indices;
    for (int64_t i = static_cast<int64_t>(params_.size()) - 1; i >= 0; --i) indices.push_back(i);
    // The reducer rebuilds its buckets after the first iteration (BeforeForward) with the
    // first-bucket size it is given, which must be this one: with another, the rebuild changed
    // the layout (with bucket_cap_mb under 1 MiB: several buckets before, one after), so a
    // resumed job ran its first step on another layout than the undisturbed run had there, and
    // over Gloo's ring, where the order in which an element's W contributions are summed
    // depends on its position in the bucket, got other bits (W >= 3: (a + b) + c != a + (b + c)).
    const size_t first_bucket_bytes = std::min(kFirstBucketBytes, bucket_cap_bytes_);
    auto [buckets, limits] =
        c10d::compute_bucket_assignment_by_size(reversed, {first_bucket_bytes, bucket_cap_bytes_},
                                                std::vector<bool>(params_.size(), false), indices);
    num_buckets_ = static_cast<int64_t>(buckets.size());
    std::unordered_map<size_t, std::string> names;
    size_t i = 0;
    for (auto& [name, p] : model_->NamedParameters()) names[i++] = name;
    reducer_ = compat::NewReducer(
        params_, buckets, limits, pg_, static_cast<int64_t>(bucket_cap_bytes_), find_unused_,
        // Gradients are views into the buckets (PyTorch's gradient_as_bucket_view=True): no
        // copy of every gradient into its bucket and back each step, which on 2 cores cost
        // as much as the all-reduce itself (large MLP: 1.2x -> 1.5x PyTorch's samples/s).
        // Gradients are zeroed in place (Accelerator::Step), which keeps the views, and are
        // handed to the user as plain aliases of the bucket memory (UnviewGradients).
        /*gradient_as_bucket_view=*/true, names, static_cast<int64_t>(first_bucket_bytes));
    // Every bucket goes through a hook that divides it by the world size in place, never
    // through the reducer's default path. That path divides differently depending on whether
    // a gradient is already a view of its bucket: in place (g / W) when it is, but while
    // copying (g * (1/W)) when it is not, as in the first iteration of every process
    // (gradients undefined), so also in the first step after a resume, where the undisturbed
    // run divided in place. For W = 2 or 4 both are exact; for W = 3, g * (1/3) != g / 3 in
    // the last bit for some g. With the hook the reducer only copies (exact) and every step
    // divides the same way. No cost in the steady state: with gradients as bucket views the
    // default path too makes one pass over the bucket to divide it.
    if (power_sgd_)
      reducer_->register_comm_hook(
          power_sgd_->Hook(pg_, std::make_unique<AverageHook>(pg_, exchange_max_bytes_)));
    else if (comm_hook_ != config::CommHook::kNone)
      reducer_->register_comm_hook(std::make_unique<CompressHook>(
          pg_, comm_hook_ == config::CommHook::kBf16 ? at::kBFloat16 : at::kHalf));
    else
      reducer_->register_comm_hook(std::make_unique<AverageHook>(pg_, exchange_max_bytes_));
    // Tensor hooks on every parameter record when backward produced its gradient; the last
    // one marks the end of gradient computation, against which bucket launch times are
    // compared to measure overlap. Once: they outlive reducers (Reform).
    if (hooked_) return;
    hooked_ = true;
    for (auto& p : params_) {
      p.register_hook([this](const at::Tensor& grad) {
        if (!in_backward_.load(std::memory_order_relaxed))
          stray_.store(true, std::memory_order_relaxed);
        MutexLock lock(&mu_);
        last_grad_time_ = Clock::now();
        return grad;
      });
    }
  }

 public:
  bool SyncGradients(bool window_closes) const override {
    return window_closes || sync_each_batch_;
  }

  void BeforeForward(bool sync) override {
    // As PyTorch's DDP does before each forward: after the first synchronised iteration the
    // reducer rebuilds its buckets in the observed gradient-ready order (a collective: every
    // rank reaches it at the same micro-batch); later calls are no-ops.
    reducer_->rebuild_buckets();
    UnviewGradients();  // a rebuild makes every defined gradient a view of its new bucket
    // PyTorch DDP (broadcast_buffers=True) makes rank 0's buffers (running statistics) every
    // rank's before a forward that follows a synchronised one: the first micro-batch of each
    // accumulation window, every micro-batch without accumulation.
    if (previous_forward_synced_) SyncBuffers();
    previous_forward_synced_ = sync;
  }

  void SyncBuffers() override { BroadcastBuffers(); }

  void BeforeBackward(const torch::Tensor& loss, bool sync) override {
    in_backward_.store(true, std::memory_order_relaxed);
    pg_->TakeLaunchTimes();  // forget launches outside this backward
    // With find_unused_parameters the reducer walks the graph back from the loss and marks the
    // parameters it does not reach ready at once (their gradients stay undefined when no rank
    // used them, as in PyTorch); without it, such a parameter stalls the reduction.
    if (sync) reducer_->prepare_for_backward({loss});
    // Not calling prepare_for_backward is no_sync: the reducer's hooks see
    // expect_autograd_hooks_ false and leave the gradients to accumulate locally.
  }

  void AfterBackward(bool sync) override {
    // backward() returns only after the reducer finalised: every bucket was all-reduced and
    // copied back into .grad. The time from the last gradient to here is communication the
    // backward pass could not hide.
    in_backward_.store(false, std::memory_order_relaxed);
    auto backward_end = Clock::now();
    Clock::time_point last_grad;
    {
      MutexLock lock(&mu_);
      last_grad = last_grad_time_;
    }
    if (!sync) return;
    UnviewGradients();
    stats_.blocking_comm_ms +=
        std::max(0.0, std::chrono::duration<double, std::milli>(backward_end - last_grad).count());
    for (const auto& t : pg_->TakeLaunchTimes()) {
      if (t < last_grad) ++stats_.launched_before_grads_done;
    }
  }

  int64_t num_buckets() const override { return num_buckets_; }

  bool TakeStrayGradients() override { return stray_.exchange(false, std::memory_order_relaxed); }

 private:
  // The reducer makes each gradient an autograd view of its bucket (narrow + view), which a
  // ported loop's optimizer.zero_grad() cannot take: it detach_()es every gradient, and
  // detaching a view in place aborts ("Can't detach views in-place"). A tensor set_() on the
  // same storage, offset, sizes and strides is the same memory without being a view: detach_
  // and zero_ work on it, in place in the bucket, and the reducer keeps it, as it keeps any
  // gradient that is_alias_of its bucket view (it copies only gradients that are not). An
  // undefined gradient (zero_grad(set_to_none), LibTorch 2's default) is produced anew by the
  // next backward; the reducer copies it into its bucket and makes it a view again, so this
  // runs after every reducer pass that assigns gradients: a synchronised backward and a
  // bucket rebuild. Cost: one TensorImpl per parameter per synchronised step.
  void UnviewGradients() {
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      const at::Tensor g = p.grad();
      if (!g.defined() || !g.is_view()) continue;
      p.mutable_grad() =
          at::empty({0}, g.options()).set_(g.storage(), g.storage_offset(), g.sizes(), g.strides());
    }
  }

  size_t bucket_cap_bytes_;
  bool sync_each_batch_;
  bool find_unused_;
  config::CommHook comm_hook_;           // parallel.comm_hook
  std::unique_ptr<PowerSgd> power_sgd_;  // comm_hook power_sgd: its state (the hooks')
  bool previous_forward_synced_ = true;  // the first forward broadcasts, as PyTorch's does
  bool hooked_ = false;                  // the gradient-time hooks are registered
  // Between BeforeBackward and AfterBackward (the hooks run on autograd's threads); a hook
  // outside that span sets stray_ (TakeStrayGradients).
  std::atomic<bool> in_backward_{false};
  std::atomic<bool> stray_{false};
  std::vector<at::Tensor> params_;
  std::unique_ptr<c10d::Reducer> reducer_;
  int64_t num_buckets_ = 0;
  Mutex mu_;  // the autograd engine may run hooks on its own thread
  Clock::time_point last_grad_time_ GUARDED_BY(mu_);
  // A last bucket up to this size takes the two-rank exchange (Tuning::ddp_exchange_max_bytes,
  // LAUNCH_DDP_EXCHANGE_MAX_KB; 0 = always the group's all-reduce, for comparisons).
  size_t exchange_max_bytes_;
};

}  // namespace

std::unique_ptr<ParallelStrategy> CreateDdpStrategy(const config::TrainConfig& cfg, Model* model,
                                                    c10::intrusive_ptr<CountingProcessGroup> pg,
                                                    const Tuning& tuning) {
  return std::make_unique<DdpStrategy>(model, std::move(pg), cfg.parallel.bucket_cap_mb,
                                       cfg.sync_each_batch, cfg.parallel.find_unused_parameters,
                                       cfg.parallel.comm_hook, cfg.parallel.power_sgd,
                                       tuning.ddp_exchange_max_bytes);
}

Status DdpSupports(const Platform& platform) { return platform.CheckAutocast(); }

}  // namespace launch::trainer
