#include "trainer_runtime/parallel/local_sgd.h"

#include <cstdio>

#include "base/files.h"
#include "trainer_runtime/state/checkpoint.h"

namespace launch::trainer {
namespace {

// Local SGD at a world-size change: `files` are the old ranks' replicas (model_rank<r>.pt).
// Every new rank starts from their average, as the final average would have made them: the
// parameters and floating-point buffers are averaged (in file order, so every rank computes the
// same bits); the optimizer state and the other buffers stay those of `own`, this rank's file
// (or rank 0's for a rank that is new).
Status LoadAveragedReplicas(const std::vector<std::string>& files, const std::string& own,
                            const Model& model, torch::optim::Optimizer& optimizer) {
  std::vector<torch::Tensor> targets, sums;
  for (auto& [name, p] : model.NamedParameters()) targets.push_back(p);
  for (auto& [name, b] : model.NamedBuffers())
    if (b.is_floating_point()) targets.push_back(b);
  for (const std::string& file : files) {
    LAUNCH_RETURN_IF_ERROR(LoadModelState(file, model, optimizer));
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < targets.size(); ++i) {
      torch::Tensor v = targets[i].detach().to(torch::kDouble);
      if (sums.size() <= i) {
        sums.push_back(v.clone());
      } else {
        sums[i].add_(v);
      }
    }
  }
  LAUNCH_RETURN_IF_ERROR(LoadModelState(own, model, optimizer));
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i)
    targets[i].detach().copy_(sums[i].div_(static_cast<double>(files.size())));
  return Status::Ok();
}

constexpr char kOuterFile[] = "/local_sgd_outer.pt";

class LocalSgdStrategy : public ParallelStrategy {
 public:
  LocalSgdStrategy(Model* model, c10::intrusive_ptr<CountingProcessGroup> pg,
                   const config::TrainConfig& cfg)
      : k_(cfg.local_sgd_steps),
        nesterov_(cfg.local_sgd.outer == config::OuterOptimizer::kNesterov),
        outer_lr_(cfg.local_sgd.outer_lr),
        outer_momentum_(cfg.local_sgd.outer_momentum) {
    model_ = model;
    SetGroup(std::move(pg));
  }
  const char* Name() const override { return "local_sgd"; }
  bool ReplicasEqual() const override { return false; }
  // Between averages the replicas differ; Finish's last average makes them equal bit for bit.
  bool ReplicasBitEqual() const override { return true; }
  void Setup() override {
    if (pg_) BroadcastModel(pg_, model_);
    if (!nesterov_) return;
    torch::NoGradGuard no_grad;
    anchor_.clear();
    momentum_.clear();
    for (const torch::Tensor& p : model_->Parameters()) {
      anchor_.push_back(p.detach().clone());
      momentum_.push_back(torch::zeros_like(p));
    }
  }
  bool SyncGradients(bool) const override { return false; }

  // The replicas differ between averages: recovered from snapshots, the replicas, the inner
  // optimizers' states and the outer state. The outer state (DiLoCo's anchor and momentum) is
  // the same on every rank (each computes the outer step from the same average), so only the
  // images of the group's ranks 0 and 1 hold it: a lost rank's image comes from its keeper,
  // so one of those two images is always at hand when any is, and LoadImage hands it to all.
  bool RecoversFromSnapshots() const override { return true; }
  void Reform(c10::intrusive_ptr<CountingProcessGroup> pg) override {
    SetGroup(std::move(pg));
    if (!nesterov_ || !anchor_.empty()) return;
    // A replacement: LoadImage fills what Setup would have made.
    for (const torch::Tensor& p : model_->Parameters()) {
      anchor_.push_back(torch::empty_like(p));
      momentum_.push_back(torch::empty_like(p));
    }
  }
  void SaveImage(torch::serialize::OutputArchive& archive,
                 torch::optim::Optimizer& optimizer) override {
    ParallelStrategy::SaveImage(archive, optimizer);
    if (rank() < 2)
      for (const auto& [name, t] : OuterTensors()) archive.write("local_sgd/" + name, t);
    archive.write("local_sgd/last_averaged", torch::tensor({last_averaged_}, torch::kLong));
  }
  Status LoadImage(torch::serialize::InputArchive& archive,
                   torch::optim::Optimizer& optimizer) override {
    LAUNCH_RETURN_IF_ERROR(ParallelStrategy::LoadImage(archive, optimizer));
    try {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> outer;
      bool held = true;
      for (auto& [name, t] : OuterTensors()) {
        torch::Tensor saved;
        held = held && archive.try_read("local_sgd/" + name, saved);
        if (held) t.copy_(saved);
        outer.push_back(t);
      }
      if (!outer.empty()) {
        // From the lowest rank whose image held it. COLLECTIVE over the group.
        auto from = torch::tensor({static_cast<int64_t>(held ? rank() : world())}, torch::kLong);
        std::vector<at::Tensor> v = {from};
        c10d::AllreduceOptions min;
        min.reduceOp = c10d::ReduceOp::MIN;
        pg_->allreduce(v, min)->wait();
        const int root = static_cast<int>(from.item<int64_t>());
        if (root >= world())
          return Status::InvalidConfig(
              "this rank's snapshot: no rank's image holds the outer state (ranks 0 and 1 "
              "keep it)");
        BroadcastFromRank0(pg_, outer, root);
      }
      torch::Tensor last;
      archive.read("local_sgd/last_averaged", last);
      last_averaged_ = last.item<int64_t>();
    } catch (const c10::Error& e) {
      return Status::InvalidConfig(std::string("this rank's snapshot: the outer state: ") +
                                   e.what_without_backtrace());
    }
    return Status::Ok();
  }

  void BeforeForward(bool) override {}
  void BeforeBackward(const torch::Tensor&, bool) override {}
  void AfterBackward(bool) override {}
  void AfterOptimizerStep(int64_t steps_done) override {
    if (steps_done % k_ == 0) Average(steps_done);
  }
  void Finish(int64_t steps_done) override {
    if (steps_done != last_averaged_) Average(steps_done);
  }

  StateBytes MemoryBytes(const torch::optim::Optimizer& optimizer) const override {
    StateBytes bytes = ParallelStrategy::MemoryBytes(optimizer);
    for (size_t i = 0; i < anchor_.size(); ++i)
      bytes.optimizer += anchor_[i].nbytes() + momentum_[i].nbytes();
    return bytes;
  }

  Status SaveModelState(const std::string& dir, torch::optim::Optimizer& optimizer) override {
    LAUNCH_RETURN_IF_ERROR(ParallelStrategy::SaveModelState(dir, optimizer));
    if (!nesterov_ || rank() != 0) return Status::Ok();
    return SaveNamedTensors(dir + kOuterFile, OuterTensors());
  }

  Status LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                        int64_t written_by) override {
    LAUNCH_RETURN_IF_ERROR(LoadReplicas(dir, optimizer, written_by));
    if (!nesterov_) return Status::Ok();
    Status outer = LoadNamedTensors(dir + kOuterFile, OuterTensors());
    if (outer.code() != Status::Code::kNotFound) return outer;
    // Written by plain averaging (a resume with changed settings): the outer step starts here,
    // from the replicas' average, with no momentum. COLLECTIVE, as LoadState is.
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> mean;
    for (const torch::Tensor& p : model_->Parameters()) mean.push_back(p.detach().clone());
    if (pg_) AllReduceFlat(*pg_, mean, pg_->getSize());
    for (size_t i = 0; i < mean.size(); ++i) {
      anchor_[i].copy_(mean[i]);
      momentum_[i].zero_();
    }
    if (rank() == 0) {
      std::printf(
          "train: local_sgd: the checkpoint has no outer (nesterov) state: the outer "
          "step starts from the replicas' average with no momentum\n");
      std::fflush(stdout);
    }
    return Status::Ok();
  }

 private:
  Status LoadReplicas(const std::string& dir, torch::optim::Optimizer& optimizer,
                      int64_t written_by) {
    if (written_by == world()) return ParallelStrategy::LoadModelState(dir, optimizer, written_by);
    std::vector<std::string> replicas;
    for (int64_t r = 0; r < written_by; ++r)
      replicas.push_back(dir + "/model_rank" + std::to_string(r) + ".pt");
    std::string own = dir + "/model_rank" + std::to_string(rank()) + ".pt";
    if (!FileExists(own)) own = replicas.front();
    LAUNCH_RETURN_IF_ERROR(LoadAveragedReplicas(replicas, own, *model_, optimizer));
    if (rank() == 0) {
      std::printf(
          "train: local_sgd: the checkpoint holds %lld replicas and this run has %d ranks: every "
          "rank starts from their average (parameters and floating-point buffers, as the final "
          "average would), with its own optimizer state if it had a rank, rank 0's otherwise\n",
          static_cast<long long>(written_by), world());
      std::fflush(stdout);
    }
    return Status::Ok();
  }

  // The outer state by name, for checkpoint files: anchor/<param> and momentum/<param>.
  std::vector<std::pair<std::string, torch::Tensor>> OuterTensors() const {
    std::vector<std::pair<std::string, torch::Tensor>> out;
    const auto named = model_->NamedParameters();
    for (size_t i = 0; i < anchor_.size(); ++i) {
      out.emplace_back("anchor/" + named[i].first, anchor_[i]);
      out.emplace_back("momentum/" + named[i].first, momentum_[i]);
    }
    return out;
  }

  void Average(int64_t steps_done) {
    last_averaged_ = steps_done;
    auto start = Clock::now();
    torch::NoGradGuard no_grad;
    if (pg_) {
      // Floating-point buffers (BatchNorm's running statistics) are averaged with the
      // parameters: each replica's were estimated on its own data, and a model whose statistics
      // are one rank's would not score what an evaluation over all ranks reports. Counters
      // (num_batches_tracked) cannot be averaged: rank 0's are everyone's.
      std::vector<torch::Tensor> averaged = model_->Parameters(), counters;
      for (auto& [name, b] : model_->NamedBuffers())
        (b.is_floating_point() ? averaged : counters).push_back(b);
      // One flat all-reduce per dtype: per-call latency dominates on Gloo.
      AllReduceFlat(*pg_, averaged, pg_->getSize());
      BroadcastFromRank0(pg_, std::move(counters));
    }
    stats_.blocking_comm_ms += MsSince(start);
    if (nesterov_)
      OuterNesterovStep(model_->Parameters(), anchor_, momentum_, outer_lr_, outer_momentum_);
  }

  int k_;
  bool nesterov_;
  double outer_lr_, outer_momentum_;
  std::vector<torch::Tensor> anchor_, momentum_;  // nesterov: the outer state (see local_sgd.h)
  int64_t last_averaged_ = 0;
};

}  // namespace

void OuterNesterovStep(const std::vector<torch::Tensor>& params, std::vector<torch::Tensor>& anchor,
                       std::vector<torch::Tensor>& momentum, double lr, double mu) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor g = anchor[i] - params[i].detach();
    momentum[i].mul_(mu).add_(g);
    g = g.add(momentum[i], mu);
    anchor[i].add_(g, -lr);
    params[i].detach().copy_(anchor[i]);
  }
}

std::unique_ptr<ParallelStrategy> CreateLocalSgdStrategy(
    const config::TrainConfig& cfg, Model* model, c10::intrusive_ptr<CountingProcessGroup> pg) {
  return std::make_unique<LocalSgdStrategy>(model, std::move(pg), cfg);
}

Status LocalSgdSupports(const Platform& platform) { return platform.CheckAutocast(); }

}  // namespace launch::trainer
