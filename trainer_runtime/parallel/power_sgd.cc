#include "trainer_runtime/parallel/power_sgd.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>

#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {

void OrthogonalizePowerSgd(at::Tensor& matrices, double epsilon) {
  const int64_t rank = matrices.size(2);
  const bool half = matrices.scalar_type() == at::kHalf || matrices.scalar_type() == at::kBFloat16;
  if (rank <= 2 || half) {
    // Gram-Schmidt, column by column, with the same operations as PyTorch's (the same bits).
    for (int64_t i = 0; i < rank; ++i) {
      at::Tensor col = matrices.narrow(2, i, 1);
      at::Tensor norm = compat::TorchNormAlong(col, 1, /*keepdim=*/true);
      if (epsilon == 0) {
        col.div_(norm);
      } else {
        col.div_(norm + epsilon);
      }
      if (i + 1 < rank) {
        at::Tensor rest = matrices.narrow(2, i + 1, rank - i - 1);
        rest.sub_(at::sum(col * rest, std::vector<int64_t>{1}, /*keepdim=*/true) * col);
      }
    }
    return;
  }
  matrices.copy_(std::get<0>(at::linalg_qr(matrices)));
}

int64_t NumpyLegacyRandint(std::mt19937& mt, int64_t high, int64_t* draws) {
  const uint64_t rng = static_cast<uint64_t>(high - 1);
  if (rng == 0) return 0;
  uint32_t mask = static_cast<uint32_t>(rng);  // the smallest all-ones mask covering rng
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  uint32_t value;
  do {
    value = static_cast<uint32_t>(mt()) & mask;
    ++*draws;
  } while (value > rng);
  return value;
}

namespace {

// Runs tasks one at a time, in submission order, on its own thread.
class SerialWorker {
 public:
  SerialWorker() : thread_([this] { Run(); }) {}
  ~SerialWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void Submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stopping, nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the rest exists
};

}  // namespace

// Per-parameter vectors are sized once, so the hook's thread and the reducer's touch distinct
// elements (one bucket's parameters are no other bucket's) without a lock. The counters change
// on the hook's thread and are read between steps (after the reducer waited for every bucket).
struct PowerSgd::State {
  config::PowerSgdConfig cfg;
  std::vector<at::Tensor> params;
  std::unordered_map<const c10::TensorImpl*, size_t> index;  // parameter -> position
  std::vector<at::Tensor> error;                             // flat, per parameter
  std::vector<at::Tensor> q;                                 // [1, m, r], per parameter
  std::mt19937 mt;
  int64_t draws = 0;
  std::atomic<int64_t> iter{0};
  std::atomic<int64_t> numel_before{0};
  std::atomic<int64_t> numel_after{0};
  bool announced = false;
};

namespace {

std::string Key(const char* what, size_t i) { return std::string(what) + "." + std::to_string(i); }

// A gradient sent as factors: its n x cols matrix, a view of the bucket, and their rank r.
struct Matrix {
  at::Tensor m;  // [1, n, cols]
  size_t var;    // its parameter's position
  int64_t n, cols, r;
};

// One bucket's work from runHook (the reducer's thread) to Finish (the hook's thread).
struct Bucket {
  at::Tensor input;                // the bucket
  at::Tensor input_copy;           // with error feedback: the input before compression
  std::vector<at::Tensor> grads;   // views of the bucket, one per parameter
  std::vector<size_t> vars;        // their parameters' positions
  std::vector<at::Tensor> whole;   // the gradients all-reduced as they are
  std::vector<Matrix> compressed;  // the others, in PyTorch's order (grouped by shape)
  at::Tensor p_all, q_all;         // the factors of every compressed gradient, flat
  std::vector<at::Tensor> ps, qs;  // views of them, [1, n, r] and [1, cols, r]
  bool last = false;               // the reducer's last bucket of the step
};

class PowerSgdHook : public c10d::CommHookInterface {
 public:
  PowerSgdHook(std::shared_ptr<PowerSgd::State> s, c10::intrusive_ptr<CountingProcessGroup> pg,
               std::unique_ptr<c10d::CommHookInterface> before)
      : s_(std::move(s)), pg_(std::move(pg)), before_(std::move(before)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    State& s = *s_;
    if (s.iter.load() < s.cfg.start_powerSGD_iter) {
      if (bucket.isLast()) ++s.iter;
      return before_->runHook(bucket);
    }
    if (!s.announced) {
      s.announced = true;
      if (pg_->getRank() == 0) {
        std::printf("train: power_sgd: compressing from synchronised step %lld (rank %lld)\n",
                    static_cast<long long>(s.iter.load() + 1),
                    static_cast<long long>(s.cfg.matrix_approximation_rank));
        std::fflush(stdout);
      }
    }
    Bucket b;
    b.input = bucket.getBufferRef();
    b.grads = bucket.getGradients();
    b.last = bucket.isLast();
    for (const at::Tensor& p : bucket.getParameters())
      b.vars.push_back(s.index.at(p.unsafeGetTensorImpl()));
    const std::vector<at::Tensor>& grads = b.grads;
    const std::vector<size_t>& vars = b.vars;

    // Error feedback: the bucket plus what compression lost of this rank's last gradient.
    if (s.cfg.use_error_feedback) {
      for (size_t k = 0; k < grads.size(); ++k) {
        at::Tensor& e = s.error[vars[k]];
        if (e.defined()) {
          grads[k].view({-1}).add_(e);
        } else {
          e = at::zeros({grads[k].numel()}, b.input.options());
        }
      }
      b.input_copy = b.input.clone();
    }

    // Which gradients are compressed: as matrices of their first dimension by the rest.
    std::vector<Matrix> compressed;
    int64_t before = 0, after = 0;
    for (size_t k = 0; k < grads.size(); ++k) {
      const at::Tensor& g = grads[k];
      const int64_t n = g.dim() == 0 ? 1 : g.size(0);
      const int64_t cols = n == 0 ? 0 : g.numel() / n;
      const int64_t r = std::min({n, cols, s.cfg.matrix_approximation_rank});
      const int64_t full = n * cols, small = (n + cols) * r;
      before += full;
      if (static_cast<double>(small) * s.cfg.min_compression_rate < static_cast<double>(full)) {
        compressed.push_back({g.view({1, n, cols}), vars[k], n, cols, r});
        after += small;
      } else {
        b.whole.push_back(g);
        after += full;
      }
    }
    s.numel_before += before;
    s.numel_after += after;
    // PyTorch walks the compressed matrices grouped by shape (in the order each shape first
    // appears): the order of the Qs' random draws, so this one too.
    std::vector<Matrix>& ordered = b.compressed;
    std::vector<bool> taken(compressed.size(), false);
    for (size_t i = 0; i < compressed.size(); ++i) {
      if (taken[i]) continue;
      for (size_t j = i; j < compressed.size(); ++j) {
        if (!taken[j] && compressed[j].n == compressed[i].n &&
            compressed[j].cols == compressed[i].cols) {
          taken[j] = true;
          ordered.push_back(compressed[j]);
        }
      }
    }
    int64_t p_len = 0, q_len = 0;
    for (const Matrix& m : ordered) p_len += m.n * m.r, q_len += m.cols * m.r;
    b.p_all = at::empty({p_len}, b.input.options());
    b.q_all = at::empty({q_len}, b.input.options());
    std::vector<at::Tensor>& ps = b.ps;
    std::vector<at::Tensor>& qs = b.qs;
    int64_t p_at = 0, q_at = 0;
    bool fresh = !s.cfg.warm_start;
    for (const Matrix& m : ordered) {
      ps.push_back(b.p_all.narrow(0, p_at, m.n * m.r).view({1, m.n, m.r}));
      qs.push_back(b.q_all.narrow(0, q_at, m.cols * m.r).view({1, m.cols, m.r}));
      p_at += m.n * m.r;
      q_at += m.cols * m.r;
      if (!s.q[m.var].defined()) fresh = true;
    }
    if (!fresh) {
      for (size_t j = 0; j < ordered.size(); ++j) {
        qs[j].copy_(s.q[ordered[j].var]);
        OrthogonalizePowerSgd(qs[j], s.cfg.orthogonalization_epsilon);
      }
    } else {
      const int64_t seed = NumpyLegacyRandint(s.mt, 1000000000, &s.draws);
      at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
      for (at::Tensor& q : qs) {
        q.copy_(at::randn(q.sizes(), gen, at::TensorOptions().dtype(b.input.scalar_type())));
        OrthogonalizePowerSgd(q, s.cfg.orthogonalization_epsilon);
      }
    }
    for (size_t j = 0; j < ordered.size(); ++j) at::bmm_out(ps[j], ordered[j].m, qs[j]);

    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
    worker_.Submit([this, future, b]() mutable {
      try {
        Finish(b);
        future->markCompleted(c10::IValue(b.input));
      } catch (...) {
        future->setError(std::current_exception());
      }
    });
    return future;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isTensor()) return result.toTensor();
    return result.toTensorVector()[0];  // a Gloo all-reduce's future (the plain phase)
  }

 private:
  using State = PowerSgd::State;
  // The rest of the bucket's PowerSGD, on the hook's thread: the all-reduces and the products
  // between them, then this rank's error and the factors kept for the next step.
  void Finish(Bucket& b) {
    at::NoGradGuard no_grad;
    const std::vector<Matrix>& ordered = b.compressed;
    std::vector<at::Tensor>& ps = b.ps;
    std::vector<at::Tensor>& qs = b.qs;
    State& s = *s_;
    const int world = pg_->getSize();
    if (!b.whole.empty()) {
      std::vector<at::Tensor> flat_views;
      for (const at::Tensor& t : b.whole) flat_views.push_back(t.view({-1}));
      std::vector<at::Tensor> flat = {at::cat(flat_views)};
      AllReduce(flat);
      flat[0].div_(world);
      int64_t offset = 0;
      for (const at::Tensor& t : b.whole) {
        t.view({-1}).copy_(flat[0].narrow(0, offset, t.numel()));
        offset += t.numel();
      }
    }
    std::vector<at::Tensor> p = {b.p_all};
    AllReduce(p);
    for (at::Tensor& pj : ps) OrthogonalizePowerSgd(pj, s.cfg.orthogonalization_epsilon);
    for (size_t j = 0; j < ordered.size(); ++j)
      at::bmm_out(qs[j], ordered[j].m.transpose(1, 2), ps[j]);
    std::vector<at::Tensor> q = {b.q_all};
    AllReduce(q);
    b.q_all.div_(world);
    for (size_t j = 0; j < ordered.size(); ++j) {
      at::Tensor m = ordered[j].m;
      at::bmm_out(m, ps[j], qs[j].transpose(1, 2));
    }
    if (s.cfg.use_error_feedback) {
      for (size_t k = 0; k < b.grads.size(); ++k) {
        const at::Tensor& g = b.grads[k];
        const int64_t offset = g.storage_offset() - b.input.storage_offset();
        s.error[b.vars[k]] = b.input_copy.narrow(0, offset, g.numel()) - g.reshape({-1});
      }
    }
    // Without warm start PyTorch forgets the factors after every step (the next draws anew).
    for (size_t j = 0; j < ordered.size(); ++j)
      s.q[ordered[j].var] = s.cfg.warm_start ? qs[j].clone() : at::Tensor();
    // As PyTorch's hook: the products ran on this thread's stream, which the reducer's does
    // not wait for.
    if (b.input.is_cuda()) torch::cuda::synchronize(b.input.device().index());
    if (b.last) ++s.iter;
  }

  void AllReduce(std::vector<at::Tensor>& tensors) {
    auto work = pg_->allreduce(tensors, c10d::AllreduceOptions());
    work->wait();
  }

  std::shared_ptr<State> s_;
  c10::intrusive_ptr<CountingProcessGroup> pg_;
  std::unique_ptr<c10d::CommHookInterface> before_;
  SerialWorker worker_;  // last: its thread stops (and drains) before the rest goes
};

}  // namespace

PowerSgd::PowerSgd(const config::PowerSgdConfig& cfg, std::vector<at::Tensor> params)
    : state_(std::make_shared<State>()) {
  State& s = *state_;
  s.cfg = cfg;
  s.params = std::move(params);
  for (size_t i = 0; i < s.params.size(); ++i) s.index[s.params[i].unsafeGetTensorImpl()] = i;
  s.error.resize(s.params.size());
  s.q.resize(s.params.size());
  s.mt.seed(static_cast<std::mt19937::result_type>(cfg.random_seed));
}

PowerSgd::~PowerSgd() = default;

std::unique_ptr<c10d::CommHookInterface> PowerSgd::Hook(
    c10::intrusive_ptr<CountingProcessGroup> pg, std::unique_ptr<c10d::CommHookInterface> before) {
  return std::make_unique<PowerSgdHook>(state_, std::move(pg), std::move(before));
}

int64_t PowerSgd::iter() const { return state_->iter.load(); }
int64_t PowerSgd::numel_before() const { return state_->numel_before.load(); }
int64_t PowerSgd::numel_after() const { return state_->numel_after.load(); }

void PowerSgd::Save(torch::serialize::OutputArchive& archive) const {
  const State& s = *state_;
  archive.write("iter", torch::tensor(s.iter.load(), torch::kLong));
  archive.write("draws", torch::tensor(s.draws, torch::kLong));
  archive.write("numel",
                torch::tensor({s.numel_before.load(), s.numel_after.load()}, torch::kLong));
  for (size_t i = 0; i < s.params.size(); ++i) {
    if (s.error[i].defined()) archive.write(Key("error", i), s.error[i].cpu());
    if (s.q[i].defined()) archive.write(Key("q", i), s.q[i].cpu());
  }
}

Status PowerSgd::Load(torch::serialize::InputArchive& archive, bool with_error) {
  State& s = *state_;
  at::Tensor iter, draws, numel;
  if (!archive.try_read("iter", iter) || !archive.try_read("draws", draws) ||
      !archive.try_read("numel", numel))
    return Status::InvalidConfig("power_sgd: the state file lacks its counters");
  s.iter = iter.item<int64_t>();
  s.draws = draws.item<int64_t>();
  s.numel_before = numel[0].item<int64_t>();
  s.numel_after = numel[1].item<int64_t>();
  s.mt.seed(static_cast<std::mt19937::result_type>(s.cfg.random_seed));
  s.mt.discard(static_cast<unsigned long long>(s.draws));
  s.announced = s.iter.load() > s.cfg.start_powerSGD_iter;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const at::TensorOptions on = s.params[i].options().requires_grad(false);
    // A fresh tensor per read: try_read sets a defined one in place (set_), which would change
    // what an earlier read returned.
    at::Tensor error, q;
    s.error[i] = with_error && archive.try_read(Key("error", i), error) ? error.to(on) : error;
    s.q[i] = archive.try_read(Key("q", i), q) ? q.to(on) : q;
    // A rank new to the job starts its error at zero, as PyTorch's first compressed step does.
    if (!with_error && s.q[i].defined() && s.cfg.use_error_feedback)
      s.error[i] = at::zeros({s.params[i].numel()}, on);
  }
  return Status::Ok();
}

}  // namespace launch::trainer
