#include "trainer_runtime/compat/platform.h"

#include <ATen/Context.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/cuda.h>

#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {
namespace {

std::string Plural(int n, const char* one, const char* many) {
  return std::to_string(n) + " " + (n == 1 ? one : many);
}

std::string CudaVisibleDevices(const DistEnv& env) {
  if (!env.cuda_visible_devices) return "CUDA_VISIBLE_DEVICES unset";
  return "CUDA_VISIBLE_DEVICES='" + *env.cuda_visible_devices + "'";
}

// Why `env` on `facts` computes on the CPU, or "" when it uses CUDA.
std::string WhyCpu(const DistEnv& env, const PlatformFacts& facts) {
  if (env.use_cpu) return "launch --cpu: ACCELERATE_USE_CPU";
  if (!facts.libtorch_cuda) return "no CUDA in this LibTorch";
  if (!facts.nccl) return "this LibTorch has CUDA but no NCCL";
  if (facts.cuda_device_count <= 0) return "no CUDA device visible";
  return "";
}

}  // namespace

PlatformFacts PlatformFacts::Read() {
  PlatformFacts f;
  f.libtorch_cuda = at::hasCUDA();
  f.cuda_device_count = f.libtorch_cuda ? static_cast<int>(torch::cuda::device_count()) : 0;
  f.nccl = compat::HasNccl();
  // CPU autocast took float16 in PyTorch 2.x (1.13 disables itself for any dtype but bfloat16).
  f.cpu_fp16_autocast = TORCH_VERSION_MAJOR >= 2;
  return f;
}

std::string PlatformFacts::Describe() const {
  if (!libtorch_cuda) return "CPU-only LibTorch";
  return std::string("LibTorch with CUDA") + (nccl ? " and NCCL" : ", no NCCL") + ", " +
         Plural(cuda_device_count, "CUDA device", "CUDA devices") + " visible";
}

const char* ToString(DeviceKind kind) { return kind == DeviceKind::kCuda ? "cuda" : "cpu"; }

const char* ToString(CollectiveBackend backend) {
  return backend == CollectiveBackend::kNccl ? "nccl" : "gloo";
}

c10::ScalarType AutocastDtype(std::string_view mixed_precision) {
  if (mixed_precision == "bf16") return c10::ScalarType::BFloat16;
  if (mixed_precision == "fp16") return c10::ScalarType::Half;
  return c10::ScalarType::Undefined;
}

StatusOr<Platform> Platform::Create(const DistEnv& env, std::string_view mixed_precision,
                                    const PlatformFacts& facts) {
  Platform p;
  p.facts_ = facts;
  p.why_cpu_ = WhyCpu(env, facts);
  if (p.why_cpu_.empty()) {
    // torchrun's contract: one device per process of the node, cuda:LOCAL_RANK. A rank past the
    // devices used to fall back to the CPU on its own and wait forever in its first collective
    // with the ranks on NCCL.
    const int count = facts.cuda_device_count;
    if (env.test_share_gpu) {
      // Tests only (util/env.h): ranks share the devices, and Gloo, which allows that, carries
      // their CUDA tensors.
      p.device_ =
          c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(env.local_rank % count));
      p.backend_ = CollectiveBackend::kGloo;
    } else if (env.local_world_size > count || env.local_rank >= count) {
      const int nodes = env.local_world_size > 0 && env.world_size % env.local_world_size == 0
                            ? env.world_size / env.local_world_size
                            : 1;
      return Status::InvalidConfig(
          "LOCAL_WORLD_SIZE " + std::to_string(env.local_world_size) + ": " +
          Plural(env.local_world_size, "process", "processes") +
          " on this node, but this process sees " + Plural(count, "CUDA device", "CUDA devices") +
          " (" + CudaVisibleDevices(env) + "; rank " + std::to_string(env.rank) + ", LOCAL_RANK " +
          std::to_string(env.local_rank) + "); each process needs its own device: run at most " +
          std::to_string(count) + " per node (launch --num_processes " +
          std::to_string(count * nodes) + "), or launch --cpu to train on the CPU");
    } else {
      p.device_ = c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(env.local_rank));
      p.backend_ = CollectiveBackend::kNccl;
    }
  }
  Autocast& a = p.autocast_;
  a.mode = std::string(mixed_precision);
  a.device_type = p.device_.type();
  a.dtype = AutocastDtype(mixed_precision);
  if (a.dtype == c10::ScalarType::Undefined && mixed_precision != "fp8" &&
      mixed_precision != "no") {
    return Status::InvalidConfig("mixed_precision: expected no, bf16, fp16 or fp8, got '" + a.mode +
                                 "'");
  }
  a.enabled = mixed_precision != "no";
  return p;
}

Status Platform::CheckAutocast() const {
  const Autocast& a = autocast_;
  if (!a.enabled || a.mode == "bf16") return Status::Ok();  // model/autocast.h, CPU or CUDA
  if (a.mode == "fp16") {
    if (is_cuda() || facts_.cpu_fp16_autocast) return Status::Ok();  // with loss scaling
    return Status::InvalidConfig(
        "mixed_precision: fp16 on the CPU needs LibTorch 2.x (this LibTorch's CPU autocast is "
        "bfloat16 only); use bf16 or no");
  }
  return Status::InvalidConfig("mixed_precision: '" + a.mode +
                               "' needs Transformer Engine, which this trainer does not use; "
                               "use bf16 or no");
}

std::string Platform::Describe() const {
  std::string line = device_.str();
  if (!is_cuda()) line += " (" + why_cpu_ + ")";
  // Shared memory serves CPU tensors only, where every rank of a group shares the host.
  if (!is_cuda())
    line += ", Gloo or shared memory";
  else
    line += backend_ == CollectiveBackend::kNccl ? ", NCCL" : ", Gloo (LAUNCH_TEST_SHARE_GPU)";
  if (autocast_.enabled)
    line +=
        ", autocast " + autocast_.mode + " on " + c10::DeviceTypeName(autocast_.device_type, true);
  else
    line += ", no autocast";
  return line + " (" + facts_.Describe() + ")";
}

}  // namespace launch::trainer
