#pragma once

// The device path of one worker, decided once: where it computes (the CPU or cuda:i), which
// collective backend carries its tensors (Gloo or NCCL), what autocast mixed_precision asks for
// there, and whether the shared-memory transports of comm/ apply (they carry CPU tensors only).
// Every layer above asks this object instead of probing LibTorch, the machine or the
// environment on its own: strategies declare what they support against it (parallel/*.h
// "Supports"), comm/ checks that all ranks agree on it (comm/device_agreement.h).
//
//   LAUNCH_ASSIGN_OR_RETURN(DistEnv env, ParseDistEnv(CurrentEnvironment()));
//   LAUNCH_ASSIGN_OR_RETURN(Platform platform,
//                           Platform::Create(env, cfg.mixed_precision, PlatformFacts::Read()));
//   std::printf("train: %s\n", platform.Describe().c_str());
//
// The rules (torchrun's contract, as PyTorch's scripts apply it):
//   - CUDA is used when LibTorch has CUDA and NCCL (compat::HasNccl), this process sees at least
//     one CUDA device, and the job did not ask for the CPU (`launch --cpu`, accelerate's use_cpu:
//     ACCELERATE_USE_CPU, DistEnv::use_cpu). Otherwise the CPU, with Gloo.
//   - With CUDA, rank LOCAL_RANK computes on cuda:LOCAL_RANK (of the visible devices) and its
//     CUDA tensors travel over NCCL; a node with more processes (LOCAL_WORLD_SIZE) than visible
//     devices is refused (PyTorch's own scripts fail there with "invalid device ordinal").
//     Tests on a machine with fewer GPUs than ranks set LAUNCH_TEST_SHARE_GPU=1
//     (DistEnv::test_share_gpu): ranks share the devices and Gloo carries their CUDA tensors.
//   - Autocast runs on the device's type, in bfloat16 (bf16) or float16 (fp16, with dynamic loss
//     scaling: model/loss_scaler.h), on the CPU and on CUDA (model/autocast.h); CPU float16 needs
//     LibTorch 2.x. Whether a configuration may run
//     on what was decided is the strategies' question (parallel/strategy_factory.h
//     CheckPlatformSupport), which CheckAutocast answers for the autocast part.
//
// Thread-safety: a Platform is an immutable value once created; copies and concurrent const
// use are safe. PlatformFacts::Read touches the CUDA runtime (first call initialises it).
//
// Internal to trainer_runtime (includes LibTorch).

#include <string>
#include <string_view>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "base/status.h"
#include "trainer_runtime/util/env.h"

namespace launch::trainer {

// What this process's LibTorch and machine offer: Platform::Create's inputs besides the job's.
// Plain data, so that a test can stand in a CUDA machine on a CPU-only build.
struct PlatformFacts {
  // Default false: this LibTorch was built with CUDA and its CUDA library is loaded.
  bool libtorch_cuda = false;
  // Default 0: the CUDA devices this process sees (after CUDA_VISIBLE_DEVICES).
  int cuda_device_count = 0;
  // Default false: NCCL is built in, so process groups carry CUDA tensors over it
  // (compat::HasNccl; false on LibTorch 1.13 even with CUDA).
  bool nccl = false;
  // Default false: LibTorch's CPU autocast runs float16 (LibTorch 2.x; 1.13's is bfloat16 only).
  bool cpu_fp16_autocast = false;

  // This process's real facts: at::hasCUDA(), torch::cuda::device_count(), compat::HasNccl().
  static PlatformFacts Read();
  // "LibTorch with CUDA and NCCL, 2 CUDA devices visible", "CPU-only LibTorch".
  std::string Describe() const;
};

// The kind of device a rank computes on. The values are a wire format: comm/device_agreement
// all-reduces them between ranks.
enum class DeviceKind { kCpu = 1, kCuda = 2 };
const char* ToString(DeviceKind kind);  // "cpu", "cuda"

// The backend that carries collectives of the device's tensors (a process group always has Gloo
// for CPU tensors besides: compat/torch_compat.h NewProcessGroup).
enum class CollectiveBackend { kGloo, kNccl };
const char* ToString(CollectiveBackend backend);  // "gloo", "nccl"

// What mixed_precision asks for, on the decided device.
struct Autocast {
  // Default "no": mixed_precision as given: no | bf16 | fp16 | fp8.
  std::string mode = "no";
  // Default false: mode is not "no".
  bool enabled = false;
  // Default CPU: where autocast runs, the device's type (torch.autocast(device_type)).
  c10::DeviceType device_type = c10::DeviceType::CPU;
  // Default Undefined: bf16 BFloat16, fp16 Half; Undefined when off and for fp8 (which is no
  // autocast dtype: it needs Transformer Engine).
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

// The autocast dtype `mixed_precision` names: BFloat16 for bf16, Half for fp16, Undefined for
// anything else (no, fp8, unknown).
c10::ScalarType AutocastDtype(std::string_view mixed_precision);

class Platform {
 public:
  // Decides the device path of the worker `env` describes, for `mixed_precision` (no, bf16,
  // fp16, fp8: config/train_config.h), on `facts` (PlatformFacts::Read() outside tests).
  // InvalidConfig:
  //   - with CUDA in use, LOCAL_WORLD_SIZE (or LOCAL_RANK) beyond the visible devices: the
  //     message names both counts, CUDA_VISIBLE_DEVICES (its value or "unset") and the ways out
  //     (`launch --num_processes N`, `launch --cpu`);
  //   - an unknown mixed_precision.
  // Whether the configuration may run on the result is not checked here: CheckAutocast, and the
  // strategies' (parallel/strategy_factory.h CheckPlatformSupport).
  static StatusOr<Platform> Create(const DistEnv& env, std::string_view mixed_precision,
                                   const PlatformFacts& facts);

  // The CPU, Gloo, no autocast, on a CPU-only LibTorch: what a single-process tool or test that
  // decides nothing runs on.
  Platform() = default;

  // Where this rank computes: cpu, or cuda:LOCAL_RANK.
  c10::Device device() const { return device_; }
  DeviceKind device_kind() const {
    return device_.is_cuda() ? DeviceKind::kCuda : DeviceKind::kCpu;
  }
  bool is_cuda() const { return device_.is_cuda(); }
  // The CUDA device index (compat::GroupOptions::cuda_device), or -1 on the CPU.
  int cuda_device() const { return device_.is_cuda() ? device_.index() : -1; }
  CollectiveBackend backend() const { return backend_; }
  const Autocast& autocast() const { return autocast_; }
  // Whether comm/'s shared-memory all-reduce, send/recv and hierarchical all-reduce can carry
  // this rank's tensors: only CPU tensors (on CUDA they go to NCCL; the group still has the
  // transports for CPU control tensors).
  bool shared_memory_transports() const { return !device_.is_cuda(); }
  // The facts it was decided on.
  const PlatformFacts& facts() const { return facts_; }
  // Why the CPU was chosen ("launch --cpu: ACCELERATE_USE_CPU", "no CUDA device visible", ...),
  // or "" on CUDA.
  const std::string& why_cpu() const { return why_cpu_; }

  // Whether this trainer implements the autocast asked for on this device: off, bf16 (CPU or
  // CUDA autocast, model/autocast.h), or fp16 on CUDA and on a CPU whose LibTorch autocasts to
  // float16. InvalidConfig naming mixed_precision and the way out otherwise (fp16 on 1.13's CPU,
  // fp8: Transformer Engine).
  // Strategies call it from their Supports functions.
  Status CheckAutocast() const;

  // One line for logs: "cuda:1, NCCL, no autocast (LibTorch with CUDA and NCCL, 2 CUDA devices
  // visible)", "cpu (launch --cpu: ACCELERATE_USE_CPU), Gloo or shared memory, autocast bf16 on
  // cpu (CPU-only LibTorch)".
  std::string Describe() const;

 private:
  c10::Device device_{c10::DeviceType::CPU};
  CollectiveBackend backend_ = CollectiveBackend::kGloo;
  Autocast autocast_;
  PlatformFacts facts_;
  std::string why_cpu_ = "no CUDA in this LibTorch";
};

}  // namespace launch::trainer
