#include "trainer_runtime/parallel/strategy_factory.h"

#include "base/environment.h"
#include "trainer_runtime/model/sync_batchnorm.h"
#include "trainer_runtime/parallel/ddp.h"
#include "trainer_runtime/parallel/dp.h"
#include "trainer_runtime/parallel/local_sgd.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/zero.h"

namespace launch::trainer {
namespace {

// parallel.mode none, or a single process: each process trains alone (nothing communicated).
class NoneStrategy : public ParallelStrategy {
 public:
  NoneStrategy(Model* model, int rank, int world) {
    model_ = model;
    rank_ = rank;
    world_ = world;
  }
  const char* Name() const override { return "none"; }
  // A pipeline stage or a tensor shard without replicas: nothing held between steps, no group.
  bool CanReform() const override { return true; }
  void Reform(c10::intrusive_ptr<CountingProcessGroup>) override {}
};

// none runs anywhere: it communicates nothing.
Status NoneSupports(const Platform& platform) { return platform.CheckAutocast(); }

}  // namespace

StatusOr<std::unique_ptr<ParallelStrategy>> CreateStrategy(
    const config::TrainConfig& cfg, Model* model, torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<CountingProcessGroup> pg, const Tuning& tuning) {
  using config::ParallelMode;
  // A pipeline's stages each take this strategy over their data group (pipeline_engine.h).
  const ParallelMode mode = cfg.parallel.data_mode();
  if (mode == ParallelMode::kDp) return CreateDpStrategy(cfg, model, tuning);
  if (cfg.local_sgd_steps > 0) return CreateLocalSgdStrategy(cfg, model, std::move(pg));
  if (mode == ParallelMode::kNone || !pg) {
    auto none =
        std::make_unique<NoneStrategy>(model, pg ? pg->getRank() : 0, pg ? pg->getSize() : 1);
    return std::unique_ptr<ParallelStrategy>(std::move(none));
  }
  if (mode == ParallelMode::kZero) return CreateZeroStrategy(cfg, model, optimizer, std::move(pg));
  if (cfg.parallel.sync_batchnorm) {
    // The statistics share DDP's group, as PyTorch's SyncBatchNorm (one process: none needed).
    LAUNCH_RETURN_IF_ERROR(AttachBatchNormGroup(model->module(), ProcessBatchNormGroup(pg)));
  }
  return CreateDdpStrategy(cfg, model, std::move(pg), tuning);
}

Status CheckPlatformSupport(const config::TrainConfig& cfg, const Platform& platform) {
  // The same order as CreateStrategy's.
  using config::ParallelMode;
  if (cfg.parallel.pipelined()) LAUNCH_RETURN_IF_ERROR(PipelineSupports(platform));
  const ParallelMode mode = cfg.parallel.data_mode();
  if (mode == ParallelMode::kDp) return DpSupports(platform);
  if (cfg.local_sgd_steps > 0) return LocalSgdSupports(platform);
  if (mode == ParallelMode::kNone) return NoneSupports(platform);
  if (mode == ParallelMode::kZero) return ZeroSupports(platform);
  return DdpSupports(platform);
}

}  // namespace launch::trainer
