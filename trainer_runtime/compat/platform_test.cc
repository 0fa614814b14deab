// platform.h: the device path decided from the job (DistEnv), mixed_precision and stand-in facts,
// so that a CUDA machine is described on this CPU-only build.

#include "trainer_runtime/compat/platform.h"

#include <torch/csrc/api/include/torch/version.h>

#include <string>

#include "base/test_util.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

PlatformFacts CudaFacts(int devices) {
  PlatformFacts f;
  f.libtorch_cuda = true;
  f.cuda_device_count = devices;
  f.nccl = true;
  return f;
}

DistEnv Node(int local_rank, int local_world_size) {
  DistEnv env;
  env.rank = local_rank;
  env.world_size = local_world_size;
  env.local_rank = local_rank;
  env.local_world_size = local_world_size;
  return env;
}

using launch::testing::Contains;

TEST_CASE("PlatformDefaultsToTheCpuWithGlooAndNoAutocast") {
  auto p = Platform::Create(DistEnv(), "no", PlatformFacts());
  REQUIRE(p.ok());
  CHECK((p->device_kind() == DeviceKind::kCpu));
  CHECK(p->device() == c10::Device(c10::DeviceType::CPU));
  CHECK(p->cuda_device() == -1);
  CHECK((p->backend() == CollectiveBackend::kGloo));
  CHECK(p->shared_memory_transports());
  CHECK_FALSE(p->autocast().enabled);
  CHECK(p->CheckAutocast().ok());
  CHECK(Contains(p->Describe(), "cpu (no CUDA in this LibTorch), Gloo"));
  // A default-constructed Platform is the same CPU.
  CHECK((Platform().device_kind() == DeviceKind::kCpu));
}

TEST_CASE("PlatformReadsThisProcesssFacts") {
  const PlatformFacts f = PlatformFacts::Read();
  CHECK(f.nccl == compat::HasNccl());
  if (!f.libtorch_cuda) CHECK(f.cuda_device_count == 0);
}

TEST_CASE("PlatformPutsEachLocalRankOnItsOwnCudaDeviceOverNccl") {
  for (int local_rank : {0, 1}) {
    auto p = Platform::Create(Node(local_rank, 2), "no", CudaFacts(2));
    REQUIRE(p.ok());
    CHECK(p->is_cuda());
    CHECK(p->device() ==
          c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(local_rank)));
    CHECK(p->cuda_device() == local_rank);
    CHECK((p->backend() == CollectiveBackend::kNccl));
    CHECK_FALSE(p->shared_memory_transports());
    CHECK(p->why_cpu().empty());
  }
  CHECK(Contains(Platform::Create(Node(1, 2), "no", CudaFacts(2))->Describe(), "cuda:1, NCCL"));
}

TEST_CASE("PlatformRefusesMoreProcessesOnANodeThanVisibleCudaDevices") {
  DistEnv env = Node(1, 2);
  for (const bool visible_set : {false, true}) {
    if (visible_set) env.cuda_visible_devices = "0";
    auto p = Platform::Create(env, "no", CudaFacts(1));
    REQUIRE_FALSE(p.ok());
    CHECK((p.status().code() == Status::Code::kInvalidConfig));
    const std::string& m = p.status().message();
    INFO(m);
    CHECK(Contains(m, "LOCAL_WORLD_SIZE 2"));
    CHECK(Contains(m, "2 processes on this node"));
    CHECK(Contains(m, "sees 1 CUDA device"));
    CHECK(Contains(m, visible_set ? "CUDA_VISIBLE_DEVICES='0'" : "CUDA_VISIBLE_DEVICES unset"));
    CHECK(Contains(m, "--num_processes 1"));
    CHECK(Contains(m, "--cpu"));
  }
  // Rank 0 of the same node is refused too: it would wait for rank 1 forever.
  CHECK_FALSE(Platform::Create(Node(0, 2), "no", CudaFacts(1)).ok());
  // Two nodes of 2 processes on 1 device each: 2 processes in all.
  DistEnv two_nodes = Node(1, 2);
  two_nodes.rank = 3;
  two_nodes.world_size = 4;
  auto p = Platform::Create(two_nodes, "no", CudaFacts(1));
  REQUIRE_FALSE(p.ok());
  CHECK(Contains(p.status().message(), "--num_processes 2"));
}

TEST_CASE("PlatformKeepsTheCpuWhenTheJobAsksForIt") {
  DistEnv env = Node(1, 2);
  env.use_cpu = true;  // launch --cpu: ACCELERATE_USE_CPU=true
  auto p = Platform::Create(env, "no", CudaFacts(1));
  REQUIRE(p.ok());  // more processes than devices is fine on the CPU
  CHECK((p->device_kind() == DeviceKind::kCpu));
  CHECK((p->backend() == CollectiveBackend::kGloo));
  CHECK(Contains(p->why_cpu(), "launch --cpu"));
  // The environment launch --cpu sets reaches it through ParseDistEnv.
  auto parsed = ParseDistEnv({{"ACCELERATE_USE_CPU", "true"}});
  REQUIRE(parsed.ok());
  CHECK_FALSE(Platform::Create(*parsed, "no", CudaFacts(4))->is_cuda());
}

TEST_CASE("PlatformStaysOnTheCpuWithoutNcclOrVisibleDevices") {
  PlatformFacts no_nccl = CudaFacts(2);
  no_nccl.nccl = false;  // LibTorch 1.13 with CUDA
  auto p = Platform::Create(Node(0, 2), "no", no_nccl);
  REQUIRE(p.ok());
  CHECK_FALSE(p->is_cuda());
  CHECK(Contains(p->why_cpu(), "no NCCL"));
  p = Platform::Create(Node(0, 2), "no", CudaFacts(0));
  REQUIRE(p.ok());
  CHECK_FALSE(p->is_cuda());
  CHECK(p->why_cpu() == "no CUDA device visible");
}

TEST_CASE("PlatformAutocastFollowsTheDevice") {
  auto cpu = Platform::Create(DistEnv(), "bf16", PlatformFacts());
  REQUIRE(cpu.ok());
  CHECK(cpu->autocast().enabled);
  CHECK((cpu->autocast().device_type == c10::DeviceType::CPU));
  CHECK((cpu->autocast().dtype == c10::ScalarType::BFloat16));
  CHECK(cpu->CheckAutocast().ok());  // model/autocast.h

  auto cuda = Platform::Create(Node(0, 1), "bf16", CudaFacts(1));
  REQUIRE(cuda.ok());
  CHECK((cuda->autocast().device_type == c10::DeviceType::CUDA));
  CHECK((cuda->autocast().dtype == c10::ScalarType::BFloat16));
  CHECK(cuda->CheckAutocast().ok());  // torch.autocast("cuda", torch.bfloat16)
  CHECK(Contains(cuda->Describe(), "cuda:0, NCCL, autocast bf16 on cuda"));

  // fp16 (with loss scaling) on CUDA, and on a CPU whose LibTorch autocasts to float16;
  // fp8 needs Transformer Engine.
  PlatformFacts cpu_fp16;
  cpu_fp16.cpu_fp16_autocast = true;
  for (const PlatformFacts& facts : {PlatformFacts(), cpu_fp16, CudaFacts(1)}) {
    auto fp16 = Platform::Create(Node(0, 1), "fp16", facts);
    REQUIRE(fp16.ok());
    CHECK((fp16->autocast().dtype == c10::ScalarType::Half));
    const Status checked = fp16->CheckAutocast();
    if (facts.libtorch_cuda || facts.cpu_fp16_autocast) {
      CHECK(checked.ok());
    } else {
      CHECK((checked.code() == Status::Code::kInvalidConfig));
      CHECK(Contains(checked.message(), "mixed_precision: fp16 on the CPU needs LibTorch 2.x"));
    }
    CHECK(Contains(Platform::Create(Node(0, 1), "fp8", facts)->CheckAutocast().message(),
                   "mixed_precision: 'fp8' needs Transformer Engine"));
  }
  CHECK(PlatformFacts::Read().cpu_fp16_autocast == (TORCH_VERSION_MAJOR >= 2));

  auto bad = Platform::Create(DistEnv(), "fp32", PlatformFacts());
  REQUIRE_FALSE(bad.ok());
  CHECK(Contains(bad.status().message(),
                 "mixed_precision: expected no, bf16, fp16 or fp8, got 'fp32'"));
}

TEST_CASE("PlatformLetsTestRanksShareOneGpuOverGloo") {
  for (int local_rank : {0, 1, 2}) {
    DistEnv env = Node(local_rank, 3);
    auto refused = Platform::Create(env, "no", CudaFacts(2));
    if (local_rank == 0) CHECK_FALSE(refused.ok());  // three processes, two devices
    env.test_share_gpu = true;
    auto p = Platform::Create(env, "no", CudaFacts(2));
    REQUIRE(p.ok());
    CHECK(p->cuda_device() == local_rank % 2);
    CHECK((p->backend() == CollectiveBackend::kGloo));
    CHECK(Contains(p->Describe(), ", Gloo (LAUNCH_TEST_SHARE_GPU)"));
  }
  // Without CUDA the switch changes nothing.
  DistEnv env = Node(1, 2);
  env.test_share_gpu = true;
  auto cpu = Platform::Create(env, "no", PlatformFacts());
  REQUIRE(cpu.ok());
  CHECK_FALSE(cpu->is_cuda());
}

}  // namespace
}  // namespace launch::trainer
