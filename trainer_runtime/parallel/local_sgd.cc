#include "trainer_runtime/parallel/local_sgd.h"

namespace launch::trainer {
namespace {

class LocalSgdStrategy : public ParallelStrategy {
 public:
  LocalSgdStrategy(Model* model, c10::intrusive_ptr<CountingProcessGroup> pg, int k)
      : k_(k) {
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
