#include "trainer_runtime/parallel/dp.h"

#include <ATen/CPUGeneratorImpl.h>
#include <dlfcn.h>

#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>  // LibTorch's generator lock
#include <optional>
#include <thread>

#include "base/mutex.h"
#include "base/strings.h"
#include "base/thread_annotations.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/autocast.h"
#include "trainer_runtime/model/sync_batchnorm.h"
#include "trainer_runtime/util/pipeline_schedule.h"

namespace launch::trainer {
namespace {

using Clock = std::chrono::steady_clock;

// omp_set_num_threads through the already-loaded libgomp (LibTorch's OpenMP runtime), so this
// file needs no -fopenmp. Null when LibTorch was built without OpenMP.
using OmpSetNumThreads = void (*)(int);
OmpSetNumThreads FindOmpSetNumThreads() {
  return reinterpret_cast<OmpSetNumThreads>(::dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
}

// K threads, each running the task of its replica when Run() is called. Run blocks until all
// finished and rethrows the first exception on the calling thread (no exception escapes a
// worker).
class ReplicaPool {
 public:
  ReplicaPool(int workers, int threads_per_worker) {
    const OmpSetNumThreads set_threads = FindOmpSetNumThreads();
    for (int k = 0; k < workers; ++k) {
      threads_.emplace_back([this, k, threads_per_worker, set_threads] {
        // The OpenMP thread budget is a per-thread setting: this replica's intra-op team.
        if (set_threads) set_threads(threads_per_worker);
        Loop(k);
      });
    }
  }
  ~ReplicaPool() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    for (auto& t : threads_) t.join();
  }

  // Runs task(k) on worker k for every k, in parallel.
  void Run(const std::function<void(int)>& task) {
    {
      MutexLock lock(&mu_);
      task_ = &task;
      pending_ = static_cast<int>(threads_.size());
      error_ = nullptr;
      ++generation_;
    }
    cv_.NotifyAll();
    MutexLock lock(&mu_);
    while (pending_ != 0) done_cv_.Wait();
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void Loop(int k) {
    uint64_t seen = 0;
    while (true) {
      const std::function<void(int)>* task = nullptr;
      {
        MutexLock lock(&mu_);
        while (!stop_ && generation_ == seen) cv_.Wait();
        if (stop_) return;
        seen = generation_;
        task = task_;
      }
      std::exception_ptr error;
      try {
        (*task)(k);
      } catch (...) {
        error = std::current_exception();
      }
      MutexLock lock(&mu_);
      if (error && !error_) error_ = error;
      if (--pending_ == 0) done_cv_.NotifyOne();
    }
  }

  std::vector<std::thread> threads_;
  Mutex mu_;
  CondVar cv_{&mu_}, done_cv_{&mu_};
  const std::function<void(int)>* task_ GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  int pending_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::exception_ptr error_ GUARDED_BY(mu_);
};

// Random numbers for replicas on threads. LibTorch has one CPU generator per process, and
// replica threads drawing from it concurrently (dropout) would interleave differently on every
// run. So each replica's forward pass runs alone (ForwardScope: one at a time, backward passes
// still in parallel) with the generator seeded for (call, replica); the call's base seed is one
// draw from the process's stream, which is checkpointed per rank, so runs and resumed runs draw
// the same masks. After the call the process's stream continues as if only that one draw had
// been made.
class ReplicaRandom {
 public:
  // Before the replicas run: draws the call's base seed.
  void BeginCall() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    base_ = at::check_generator<at::CPUGeneratorImpl>(gen)->random64();
    after_draw_ = gen.get_state();
  }
  // After the replicas: the process's stream as right after BeginCall's draw.
  void EndCall() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(after_draw_);
  }
  // Held by replica k around its forward pass (and the loss).
  class ForwardScope {
   public:
    ForwardScope(ReplicaRandom* r, int k) : lock_(&r->mu_) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> g(gen.mutex());
      gen.set_current_seed((r->base_ ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(k + 1))) *
                           0xBF58476D1CE4E5B9ull);
    }

   private:
    MutexLock lock_;
  };

 private:
  Mutex mu_;  // one forward pass at a time (ForwardScope); base_ is set before they start
  uint64_t base_ = 0;
  at::Tensor after_draw_;
};

class DpStrategy : public ParallelStrategy {
 public:
  DpStrategy(Model* model, std::vector<std::unique_ptr<Model>> extra, bool loss_in_replica,
             int threads_per_replica, bool seeded, c10::ScalarType autocast,
             std::unique_ptr<ThreadBatchNormGroup> bn_group)
      : replicas_(static_cast<int>(extra.size()) + 1),
        loss_in_replica_(loss_in_replica),
        seeded_(seeded),
        autocast_(autocast),
        extra_(std::move(extra)),
        bn_group_(std::move(bn_group)),
        pool_(replicas_, threads_per_replica) {
    model_ = model;
    models_.push_back(model);
    for (auto& m : extra_) models_.push_back(m.get());
  }

  const char* Name() const override { return "dp"; }
  void Setup() override {}
  bool SyncGradients(bool) const override { return false; }
  void BeforeForward(bool) override {}
  void BeforeBackward(const torch::Tensor&, bool) override {}
  void AfterBackward(bool) override {}
  bool RunsForwardBackward() const override { return true; }

  torch::Tensor ForwardBackward(const torch::Tensor& x, const torch::Tensor& y,
                                const ChunkLossFn& chunk_loss, const CriterionFn& criterion,
                                double scale) override {
    const int64_t batch = x.size(0);
    // The rows this batch really has (not train.batch_size): a replica without rows would
    // silently train the others on a mean with a missing part.
    const Status rows_ok = CheckRowsFor(batch, replicas_, "train.parallel.replicas");
    if (!rows_ok.ok()) throw compat::MakeError(rows_ok.message());
    const int used = replicas_;
    const auto chunks = SplitRows(batch, used);
    Replicate(used);
    if (bn_group_) bn_group_->SetActive(used);  // the replicas that meet in each SyncBatchNorm
    if (seeded_) random_.BeginCall();
    std::vector<double> losses(static_cast<size_t>(used), 0.0);
    std::vector<torch::Tensor> outputs(static_cast<size_t>(used));
    if (loss_in_replica_ || !criterion) {
      RunReplicas(used, [&](int k) {
        const auto [offset, rows] = chunks[static_cast<size_t>(k)];
        torch::Tensor loss;
        {
          std::optional<ReplicaRandom::ForwardScope> scope;
          if (seeded_) scope.emplace(&random_, k);
          loss = chunk_loss(*models_[static_cast<size_t>(k)], x.narrow(0, offset, rows),
                            y.narrow(0, offset, rows));
        }
        const double weight = static_cast<double>(rows) / static_cast<double>(batch);
        (loss * (scale * weight)).backward();
        losses[static_cast<size_t>(k)] = loss.item<double>() * weight;
      });
    } else {
      RunReplicas(used, [&](int k) {
        const auto [offset, rows] = chunks[static_cast<size_t>(k)];
        std::optional<ReplicaRandom::ForwardScope> scope;
        if (seeded_) scope.emplace(&random_, k);
        AutocastScope amp(c10::DeviceType::CPU, autocast_);  // per thread
        outputs[static_cast<size_t>(k)] =
            models_[static_cast<size_t>(k)]->Forward(x.narrow(0, offset, rows));
      });
      // Gather to the first "device" and compute the loss over the whole batch there (in
      // float32 under autocast, as autocast would).
      std::vector<torch::Tensor> detached;
      const bool cast = autocast_ != c10::ScalarType::Undefined;
      for (auto& o : outputs) detached.push_back(cast ? o.detach().to(torch::kFloat) : o.detach());
      torch::Tensor gathered = torch::cat(detached).requires_grad_(true);
      torch::Tensor loss = criterion(gathered, y);
      (loss * scale).backward();
      losses[0] = loss.item<double>();
      torch::Tensor grad = gathered.grad();
      RunReplicas(used, [&](int k) {
        const auto [offset, rows] = chunks[static_cast<size_t>(k)];
        torch::Tensor& out = outputs[static_cast<size_t>(k)];
        torch::autograd::backward({out}, {grad.narrow(0, offset, rows).to(out.scalar_type())});
      });
    }
    if (seeded_) random_.EndCall();
    Reduce(used);
    double total = 0;
    for (double l : losses) total += l;
    return torch::tensor(total, torch::kDouble);
  }

 private:
  // task(k) for the first `used` replicas on their threads. A replica that throws breaks the
  // SyncBatchNorm rendezvous, so the others fail too instead of waiting for it forever.
  void RunReplicas(int used, const std::function<void(int)>& task) {
    pool_.Run([&](int k) {
      if (k >= used) return;
      try {
        task(k);
      } catch (...) {
        if (bn_group_) bn_group_->Break();
        throw;
      }
    });
  }

  // Replicas 1..used-1 take replica 0's parameters and buffers; their gradients start at zero.
  void Replicate(int used) {
    torch::NoGradGuard no_grad;
    auto params0 = models_[0]->Parameters();
    auto buffers0 = models_[0]->NamedBuffers();
    for (int k = 1; k < used; ++k) {
      auto params = models_[static_cast<size_t>(k)]->Parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].copy_(params0[i]);
        if (params[i].grad().defined()) params[i].mutable_grad().zero_();
      }
      auto buffers = models_[static_cast<size_t>(k)]->NamedBuffers();
      for (size_t i = 0; i < buffers.size(); ++i) buffers[i].second.copy_(buffers0[i].second);
    }
  }

  // Replica 0's gradients += the others', in replica order.
  void Reduce(int used) {
    torch::NoGradGuard no_grad;
    auto params0 = models_[0]->Parameters();
    for (int k = 1; k < used; ++k) {
      auto params = models_[static_cast<size_t>(k)]->Parameters();
      for (size_t i = 0; i < params.size(); ++i) {
        if (!params[i].grad().defined()) continue;
        if (!params0[i].grad().defined()) {
          params0[i].mutable_grad() = params[i].grad().clone();
        } else {
          params0[i].mutable_grad().add_(params[i].grad());
        }
      }
    }
  }

  int replicas_;
  bool loss_in_replica_;
  bool seeded_;  // parallel.dp_seeded_replicas
  // mixed_precision bf16 or fp16: the replicas' forward passes under CPU autocast to it.
  c10::ScalarType autocast_;
  std::vector<std::unique_ptr<Model>> extra_;
  std::vector<Model*> models_;
  // parallel.sync_batchnorm: the replicas' SyncBatchNorm layers meet here (null when off).
  std::unique_ptr<ThreadBatchNormGroup> bn_group_;
  ReplicaPool pool_;
  ReplicaRandom random_;
};

}  // namespace

StatusOr<std::unique_ptr<ParallelStrategy>> CreateDpStrategy(const config::TrainConfig& cfg,
                                                             Model* model, const Tuning& tuning) {
  const int k = cfg.parallel.replicas;
  if (k < 1)
    return Status::InvalidConfig("train.parallel.replicas must be at least 1, got " +
                                 std::to_string(k));
  if (cfg.batch_size < k)
    return Status::InvalidConfig("train.batch_size " + std::to_string(cfg.batch_size) +
                                 " is smaller than train.parallel.replicas " + std::to_string(k) +
                                 "; every replica needs at least one row");
  // Cloning runs reset(), which draws from the global RNG (their initial values are overwritten
  // every step anyway): keep the loop's RNG stream (dropout masks) as it was.
  auto generator = at::detail::getDefaultCPUGenerator();
  torch::Tensor rng_state = generator.get_state();
  std::vector<std::unique_ptr<Model>> extra;
  for (int i = 1; i < k; ++i) {
    std::shared_ptr<torch::nn::Module> copy;
    try {
      copy = model->module().clone();
    } catch (const c10::Error& e) {
      generator.set_state(rng_state);
      return Status::InvalidConfig(
          "train.parallel.mode: dp copies the model onto its replicas with clone(), which this "
          "module does not implement (derive it from torch::nn::Cloneable): " +
          std::string(e.what_without_backtrace()));
    }
    auto replica = std::make_unique<Model>(std::move(copy));
    replica->SetTraining(true);
    extra.push_back(std::move(replica));
  }
  generator.set_state(rng_state);
  std::unique_ptr<ThreadBatchNormGroup> bn_group;
  if (cfg.parallel.sync_batchnorm) {
    // Each SyncBatchNorm waits for every replica's statistics: forwards one at a time would
    // wait forever.
    if (cfg.parallel.dp_seeded_replicas)
      return Status::InvalidConfig(
          "train.parallel.sync_batchnorm: under dp the replicas' forward passes must run "
          "together to share their statistics; set train.parallel.dp_seeded_replicas: false "
          "(for a model that draws no random numbers, e.g. no dropout)");
    bn_group = std::make_unique<ThreadBatchNormGroup>(k);
    LAUNCH_RETURN_IF_ERROR(AttachBatchNormGroup(model->module(), bn_group->member(0)));
    for (int i = 1; i < k; ++i)
      SetBatchNormGroup(extra[static_cast<size_t>(i - 1)]->module(), bn_group->member(i));
  }
  const int threads = tuning.dp_threads_per_replica > 0 ? tuning.dp_threads_per_replica
                                                        : std::max(1, at::get_num_threads() / k);
  return std::unique_ptr<ParallelStrategy>(std::make_unique<DpStrategy>(
      model, std::move(extra), cfg.parallel.loss_in_replica, threads,
      cfg.parallel.dp_seeded_replicas, AutocastDtype(cfg.mixed_precision), std::move(bn_group)));
}

Status DpSupports(const Platform& platform) {
  // The replicas are threads of one process that hand tensors to each other on the CPU.
  if (platform.is_cuda())
    return Status::InvalidConfig(
        "train.parallel.mode: dp runs on the CPU only; on GPUs use ddp or none, or run launch "
        "--cpu");
  return platform.CheckAutocast();
}

}  // namespace launch::trainer
