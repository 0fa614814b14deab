// strategy_factory.h CheckPlatformSupport: each strategy's own answer (ddp.h, dp.h, local_sgd.h,
// zero.h; none in the factory) on a CPU platform and on a stand-in CUDA one.

#include "trainer_runtime/parallel/strategy_factory.h"

#include <string>

#include "trainer_runtime/parallel/ddp.h"
#include "trainer_runtime/parallel/local_sgd.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/zero.h"
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

TEST_CASE("OnCudaEveryStrategyButDpRunsAndDpIsRefused") {
  for (ParallelMode mode :
       {ParallelMode::kNone, ParallelMode::kDdp, ParallelMode::kZero, ParallelMode::kPipeline}) {
    INFO(config::ToString(mode));
    CHECK(CheckPlatformSupport(Mode(mode), Cuda()).ok());
    CHECK(CheckPlatformSupport(Mode(mode), Cuda("bf16")).ok());  // CUDA autocast
  }
  CHECK(CheckPlatformSupport(Mode(ParallelMode::kDdp, 4), Cuda()).ok());
  // A pipeline of stages with any data strategy.
  for (ParallelMode mode : {ParallelMode::kPipeline, ParallelMode::kDdp, ParallelMode::kZero}) {
    config::TrainConfig cfg = Mode(mode);
    cfg.parallel.stages = 2;
    CHECK(CheckPlatformSupport(cfg, Cuda("bf16")).ok());
  }
  CHECK(PipelineSupports(Cuda()).ok());
  CHECK(ZeroSupports(Cuda("bf16")).ok());
  CHECK(LocalSgdSupports(Cuda("bf16")).ok());
  const Status s = CheckPlatformSupport(Mode(ParallelMode::kDp), Cuda());
  CHECK((s.code() == Status::Code::kInvalidConfig));
  CHECK(s.message() ==
        "train.parallel.mode: dp runs on the CPU only; on GPUs use ddp or none, or run launch "
        "--cpu");
  // dp is asked before local_sgd_steps, as CreateStrategy builds dp first.
  CHECK_FALSE(CheckPlatformSupport(Mode(ParallelMode::kDp, 4), Cuda()).ok());
}

TEST_CASE("Fp16RunsWhereItsAutocastDoesAndFp8Nowhere") {
  PlatformFacts cpu_fp16;
  cpu_fp16.cpu_fp16_autocast = true;
  auto cpu2 = Platform::Create(DistEnv(), "fp16", cpu_fp16);
  REQUIRE(cpu2.ok());
  for (ParallelMode mode :
       {ParallelMode::kNone, ParallelMode::kDdp, ParallelMode::kZero, ParallelMode::kPipeline}) {
    INFO(config::ToString(mode));
    CHECK(CheckPlatformSupport(Mode(mode), Cuda("fp16")).ok());
    CHECK(CheckPlatformSupport(Mode(mode), *cpu2).ok());
    CHECK(CheckPlatformSupport(Mode(mode, 4), *cpu2).ok());  // Local SGD
    // LibTorch 1.13's CPU autocast is bfloat16 only.
    const Status s = CheckPlatformSupport(Mode(mode), Cpu("fp16"));
    CHECK((s.code() == Status::Code::kInvalidConfig));
    CHECK(s.message().find("mixed_precision: fp16 on the CPU needs LibTorch 2.x") == 0);
    CHECK_FALSE(CheckPlatformSupport(Mode(mode), Cuda("fp8")).ok());
  }
  CHECK(CheckPlatformSupport(Mode(ParallelMode::kDp), *cpu2).ok());
  CHECK_FALSE(CheckPlatformSupport(Mode(ParallelMode::kDp), Cpu("fp16")).ok());
}

}  // namespace
}  // namespace launch::trainer
