#pragma once

// The peak FLOP/s one rank's device offers, and where the figure comes from: the denominator of
// the MFU `train` reports (model FLOPs achieved / peak; model/flops.h counts the numerator).
//   - CUDA: the vendor's datasheet figure for the device's name (cudaDeviceProp::name, from
//     compat/cuda_device.h), dense (without 2:4 sparsity), for the precision the run's matmuls
//     use: any mixed_precision but `no` (bf16, fp16; fp8, which this trainer does not run,
//     too) -> the bf16/fp16 tensor-core figure; `no` -> the plain fp32 (CUDA core) figure, or
//     the TF32 tensor-core figure when LibTorch lets cuBLAS use TF32
//     (at::globalContext().allowTF32CuBLAS(), off by default since PyTorch 1.12).
//     A device not in the table has no peak (unknown), not a guess.
//   - CPU: measured at start: square matmuls (torch::mm, 512 x 512, 1024 x 1024 from 8
//     threads on) for about `seconds`, with this process's LibTorch thread count, in float32,
//     or in bfloat16 (float16) when mixed_precision is bf16 (fp16): the dtype autocast gives the
//     model's matmuls.
//     The peak is the best single matmul's rate: the machine's attainable GEMM rate, which
//     other processes on the same cores lower as they lower training.
//
// Internal to trainer_runtime (includes LibTorch). The table is constant; MeasureCpuPeak uses
// LibTorch's intra-op threads, so concurrent calls slow each other down.

#include <optional>
#include <string>
#include <string_view>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace launch::trainer {

// The precision of a run's matrix multiplies, as the peak tables list them.
enum class MatmulPrecision {
  kFp32,  // float32 on CUDA cores (or the CPU's float32 GEMM)
  kTf32,  // float32 tensors through TF32 tensor cores
  kHalf,  // bfloat16 / float16 tensor cores (the same dense figure on the GPUs listed)
};
const char* ToString(MatmulPrecision p);  // "fp32", "tf32", "bf16/fp16"

struct PeakFlops {
  // Default 0: FLOP/s; 0 when unknown.
  double flops_per_s = 0;
  // Default "unknown": where the figure comes from, for logs and final.json's peak_source:
  // "table: NVIDIA H100 80GB HBM3 bf16/fp16 dense 989.5 TFLOP/s (H100 SXM datasheet)",
  // "measured: 512x512 fp32 GEMM, 2 threads", "unknown: no peak listed for 'NVIDIA T4' fp32".
  std::string source = "unknown";

  bool known() const { return flops_per_s > 0; }
};

// The datasheet's dense peak of the CUDA device called `device_name` for `precision`, or nullopt
// when the table has no entry for it. A table name matches a whole word run of the device's
// name ("L4" matches "NVIDIA L4", not "NVIDIA L40S"; "A100" matches "NVIDIA A100-SXM4-80GB").
std::optional<PeakFlops> TablePeak(std::string_view device_name, MatmulPrecision precision);

// The CPU's measured GEMM peak in `dtype` (float, bfloat16 or float16) over about `seconds`.
// REQUIRES: seconds > 0; dtype kFloat, kBFloat16, or kHalf where LibTorch's CPU matmul takes it
// (2.x).
PeakFlops MeasureCpuPeak(c10::ScalarType dtype, double seconds);

// This rank's peak on `device` for `mixed_precision` (no, bf16, fp16, fp8): the table on CUDA
// (unknown when the name is not listed or this build cannot ask), MeasureCpuPeak on the CPU
// (for `cpu_seconds`).
PeakFlops DevicePeak(c10::Device device, std::string_view mixed_precision,
                     double cpu_seconds = 0.2);

}  // namespace launch::trainer
