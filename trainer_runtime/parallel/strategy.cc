#include "trainer_runtime/parallel/strategy.h"

namespace launch::trainer {

double ParallelStrategy::MsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

void ParallelStrategy::BroadcastModel(const c10::intrusive_ptr<CountingProcessGroup>& pg,
                                      Model* model) {
  std::vector<at::Tensor> tensors;
  for (auto& [name, p] : model->NamedParameters()) tensors.push_back(p);
  for (auto& [name, b] : model->NamedBuffers()) tensors.push_back(b);
  BroadcastFromRank0(pg, std::move(tensors));
}

StepCommStats ParallelStrategy::TakeStepStats() {
  StepCommStats out = stats_;
  if (pg_) {
    const int64_t now = pg_->allreduce_count();
    out.allreduces = now - allreduces_at_step_start_;
    allreduces_at_step_start_ = now;
  }
  stats_ = StepCommStats();
  return out;
}

void AllReduceSum(const c10::intrusive_ptr<CountingProcessGroup>& pg, torch::Tensor& values) {
  if (!pg) return;
  std::vector<at::Tensor> v = {values};
  pg->allreduce(v, c10d::AllreduceOptions())->wait();
}

}  // namespace launch::trainer
