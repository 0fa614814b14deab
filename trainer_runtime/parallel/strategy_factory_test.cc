// strategy_factory.h CheckPlatformSupport: each strategy's own answer (ddp.h, dp.h, local_sgd.h,
// zero.h; none in the factory) on a CPU platform and on a stand-in CUDA one.

#include "trainer_runtime/parallel/strategy_factory.h"

#include <string>

#include "trainer_runtime/parallel/ddp.h"
#include "trainer_runtime/parallel/local_sgd.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

using config::ParallelMode;

Platform Cpu(const char* mixed_precision = "no") {
  auto p = Platform::Create(DistEnv(), mixed_precision, PlatformFacts());
  REQUIRE(p.ok());
  return *p;
}

Platform Cuda(const char* mixed_precision = "no") {
  PlatformFacts facts;
  facts.libtorch_cuda = true;
  facts.cuda_device_count = 1;
  facts.nccl = true;
  auto p = Platform::Create(DistEnv(), mixed_precision, facts);
  REQUIRE(p.ok());
  REQUIRE(p->is_cuda());
  return *p;
}

config::TrainConfig Mode(ParallelMode mode, int local_sgd_steps = 0) {
  config::TrainConfig cfg;
  cfg.parallel.mode = mode;
  cfg.local_sgd_steps = local_sgd_steps;
  return cfg;
}

TEST_CASE("EveryStrategyRunsOnTheCpu") {
  for (ParallelMode mode : {ParallelMode::kNone, ParallelMode::kDdp, ParallelMode::kDp,
                            ParallelMode::kZero, ParallelMode::kPipeline}) {
    INFO(config::ToString(mode));
    CHECK(CheckPlatformSupport(Mode(mode), Cpu()).ok());
    CHECK(CheckPlatformSupport(Mode(mode), Cpu("bf16")).ok());
  }
  CHECK(CheckPlatformSupport(Mode(ParallelMode::kDdp, 4), Cpu()).ok());
}

TEST_CASE("OnCudaDdpNoneAndLocalSgdRunAndTheThreadAndShardStrategiesAreRefused") {
  CHECK(CheckPlatformSupport(Mode(ParallelMode::kDdp), Cuda()).ok());
  CHECK(CheckPlatformSupport(Mode(ParallelMode::kNone), Cuda()).ok());
  CHECK(CheckPlatformSupport(Mode(ParallelMode::kDdp, 4), Cuda()).ok());
  // A pipeline (mode pipeline, or stages > 1 with any data strategy): the engine refuses CUDA
  // first, naming train.parallel.stages.
  for (ParallelMode mode : {ParallelMode::kPipeline, ParallelMode::kDdp, ParallelMode::kZero}) {
    config::TrainConfig cfg = Mode(mode);
    cfg.parallel.stages = 2;
    const Status s = CheckPlatformSupport(cfg, Cuda());
    CHECK((s.code() == Status::Code::kInvalidConfig));
    CHECK(s.message().find("train.parallel.stages: the pipeline engine runs on the CPU only") == 0);
    CHECK(CheckPlatformSupport(cfg, Cpu()).ok());
  }
  CHECK_FALSE(PipelineSupports(Cuda()).ok());
  CHECK(PipelineSupports(Cpu()).ok());
  for (ParallelMode mode : {ParallelMode::kDp, ParallelMode::kZero}) {
    const Status s = CheckPlatformSupport(Mode(mode), Cuda());
    CHECK((s.code() == Status::Code::kInvalidConfig));
    CHECK(s.message() == std::string("train.parallel.mode: ") + config::ToString(mode) +
                             " runs on the CPU only; on GPUs use ddp or none, or run launch --cpu");
  }
  // dp is asked before local_sgd_steps, as CreateStrategy builds dp first.
  CHECK_FALSE(CheckPlatformSupport(Mode(ParallelMode::kDp, 4), Cuda()).ok());
}

TEST_CASE("Bf16IsRefusedOnCudaByTheStrategyCheckAndFineOnTheCpu") {
  for (ParallelMode mode : {ParallelMode::kNone, ParallelMode::kDdp}) {
    INFO(config::ToString(mode));
    CHECK(CheckPlatformSupport(Mode(mode), Cpu("bf16")).ok());
    const Status s = CheckPlatformSupport(Mode(mode), Cuda("bf16"));
    CHECK((s.code() == Status::Code::kInvalidConfig));
    CHECK(s.message() ==
          "mixed_precision: bf16 is CPU autocast here; on GPUs use no, or run launch --cpu");
  }
  CHECK_FALSE(CheckPlatformSupport(Mode(ParallelMode::kDdp, 4), Cuda("bf16")).ok());
  CHECK(DdpSupports(Cpu("bf16")).ok());
  CHECK_FALSE(DdpSupports(Cuda("bf16")).ok());
  CHECK(LocalSgdSupports(Cpu("bf16")).ok());
  CHECK_FALSE(LocalSgdSupports(Cuda("bf16")).ok());
}

TEST_CASE("Fp16IsRefusedByEveryStrategyOnACpuOnlyLibTorch") {
  for (ParallelMode mode : {ParallelMode::kNone, ParallelMode::kDdp, ParallelMode::kDp,
                            ParallelMode::kZero, ParallelMode::kPipeline}) {
    INFO(config::ToString(mode));
    const Status s = CheckPlatformSupport(Mode(mode), Cpu("fp16"));
    CHECK((s.code() == Status::Code::kInvalidConfig));
    CHECK(s.message() ==
          "mixed_precision: 'fp16' needs a GPU (CUDA autocast) and this LibTorch is CPU-only; use "
          "bf16 (CPU autocast) or no");
  }
}

}  // namespace
}  // namespace launch::trainer
