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

class LocalSgdStrategy : public ParallelStrategy {
 public:
  LocalSgdStrategy(Model* model, c10::intrusive_ptr<CountingProcessGroup> pg, int k) : k_(k) {
    model_ = model;
    SetGroup(std::move(pg));
  }
  const char* Name() const override { return "local_sgd"; }
  bool ReplicasEqual() const override { return false; }
  void Setup() override {
    if (pg_) BroadcastModel(pg_, model_);
  }
  bool SyncGradients(bool) const override { return false; }
  void BeforeForward(bool) override {}
  void BeforeBackward(const torch::Tensor&, bool) override {}
  void AfterBackward(bool) override {}
  void AfterOptimizerStep(int64_t steps_done) override {
    if (steps_done % k_ == 0) Average(steps_done);
  }
  void Finish(int64_t steps_done) override {
    if (steps_done != last_averaged_) Average(steps_done);
  }

  Status LoadModelState(const std::string& dir, torch::optim::Optimizer& optimizer,
                        int64_t written_by) override {
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

 private:
  void Average(int64_t steps_done) {
    last_averaged_ = steps_done;
    if (!pg_) return;
    auto start = Clock::now();
    torch::NoGradGuard no_grad;
    // One flat all-reduce per dtype: per-call latency dominates on Gloo.
    AllReduceFlat(*pg_, model_->Parameters(), pg_->getSize());
    stats_.blocking_comm_ms += MsSince(start);
  }

  int k_;
  int64_t last_averaged_ = 0;
};

}  // namespace

std::unique_ptr<ParallelStrategy> CreateLocalSgdStrategy(
    const config::TrainConfig& cfg, Model* model, c10::intrusive_ptr<CountingProcessGroup> pg) {
  return std::make_unique<LocalSgdStrategy>(model, std::move(pg), cfg.local_sgd_steps);
}

}  // namespace launch::trainer
