#include "trainer_runtime/compat/peak_flops.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>

#include "trainer_runtime/compat/cuda_device.h"
#include "trainer_runtime/compat/platform.h"

namespace launch::trainer {
namespace {

// One device's dense peaks in TFLOP/s, from the vendor's datasheet (`source`). NVIDIA lists
// tensor-core figures "with sparsity" (2:4 structured); the dense figure, used here, is half of
// that. GeForce cards: the bf16/fp16 figure with FP32 accumulation (what cuBLAS uses for
// PyTorch's matmuls), half the FP16-accumulate one.
struct TableEntry {
  const char* name;    // a word run of cudaDeviceProp::name
  const char* source;  // the datasheet
  double fp32;         // CUDA cores, no tensor cores
  double tf32;         // tensor cores, dense
  double half;         // bf16 = fp16 tensor cores, dense
};

// More specific names first: "H100 PCIe" before "H100".
constexpr TableEntry kTable[] = {
    // H100 PCIe: FP32 51, TF32 756*, BF16 1,513* (* with sparsity).
    {"H100 PCIe", "H100 PCIe datasheet", 51, 378, 756},
    // H100 NVL: FP32 60, TF32 835*, BF16 1,671*.
    {"H100 NVL", "H100 NVL datasheet", 60, 417.5, 835.5},
    // H100 SXM ("NVIDIA H100 80GB HBM3"): FP32 67, TF32 989*, BF16 1,979*.
    {"H100", "H100 SXM datasheet", 67, 494.5, 989.5},
    // GH200's Hopper GPU: the H100 SXM figures.
    {"GH200", "GH200 datasheet", 67, 494.5, 989.5},
    // H200 NVL: FP32 60, TF32 835*, BF16 1,671*.
    {"H200 NVL", "H200 NVL datasheet", 60, 417.5, 835.5},
    // H200 SXM ("NVIDIA H200"): FP32 67, TF32 989*, BF16 1,979*.
    {"H200", "H200 SXM datasheet", 67, 494.5, 989.5},
    // A100 (SXM4 and PCIe, 40 and 80 GB): FP32 19.5, TF32 156 | 312*, BF16 312 | 624*.
    {"A100", "A100 datasheet", 19.5, 156, 312},
    // A10: FP32 31.2, TF32 62.5 | 125*, BF16 125 | 250*.
    {"A10", "A10 datasheet", 31.2, 62.5, 125},
    // L40S: FP32 91.6, TF32 183 | 366*, BF16 362.05 | 733*.
    {"L40S", "L40S datasheet", 91.6, 183, 362.05},
    // L40: FP32 90.5, TF32 90.5 | 181*, BF16 181.05 | 362.1*.
    {"L40", "L40 datasheet", 90.5, 90.5, 181.05},
    // L4: FP32 30.3, TF32 120*, BF16 242*.
    {"L4", "L4 datasheet", 30.3, 60, 121},
    // RTX 4090 (Ada Lovelace whitepaper): FP32 82.6, TF32 82.6, BF16 with FP32 accumulate 165.2.
    {"RTX 4090", "Ada Lovelace architecture whitepaper", 82.6, 82.6, 165.2},
    // RTX 3090 (GA102 whitepaper): FP32 35.6, TF32 35.6, BF16 with FP32 accumulate 71.
    {"RTX 3090", "NVIDIA Ampere GA102 GPU architecture whitepaper", 35.6, 35.6, 71},
};

bool IsWordChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; }

// Whether `word` occurs in `name` with no letter or digit right before or after it.
bool ContainsWordRun(std::string_view name, std::string_view word) {
  for (size_t at = name.find(word); at != std::string_view::npos; at = name.find(word, at + 1)) {
    const size_t end = at + word.size();
    if ((at == 0 || !IsWordChar(name[at - 1])) && (end == name.size() || !IsWordChar(name[end])))
      return true;
  }
  return false;
}

std::string Number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

const char* ToString(MatmulPrecision p) {
  switch (p) {
    case MatmulPrecision::kFp32:
      return "fp32";
    case MatmulPrecision::kTf32:
      return "tf32";
    case MatmulPrecision::kHalf:
      return "bf16/fp16";
  }
  return "?";
}

std::optional<PeakFlops> TablePeak(std::string_view device_name, MatmulPrecision precision) {
  for (const TableEntry& e : kTable) {
    if (!ContainsWordRun(device_name, e.name)) continue;
    const double tflops = precision == MatmulPrecision::kHalf   ? e.half
                          : precision == MatmulPrecision::kTf32 ? e.tf32
                                                                : e.fp32;
    PeakFlops peak;
    peak.flops_per_s = tflops * 1e12;
    peak.source = "table: " + std::string(device_name) + " " + ToString(precision) +
                  (precision == MatmulPrecision::kFp32 ? "" : " dense") + " " + Number(tflops) +
                  " TFLOP/s (" + e.source + ")";
    return peak;
  }
  return std::nullopt;
}

PeakFlops MeasureCpuPeak(c10::ScalarType dtype, double seconds) {
  using Clock = std::chrono::steady_clock;
  const int threads = at::get_num_threads();
  const int64_t n = threads >= 8 ? 1024 : 512;
  // Operands without the random generator: drawing from it would move the training's random
  // stream (dropout masks) and change the run. A dense GEMM's speed does not depend on values.
  const at::Tensor a = at::linspace(-1.0, 1.0, n * n).reshape({n, n}).to(dtype);
  const at::Tensor b = a.t().contiguous();
  at::Tensor c = at::mm(a, b);  // warm-up: allocation, kernel choice, thread pool start
  const double flops =
      2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  double best = 0;
  const auto start = Clock::now();
  do {
    const auto t0 = Clock::now();
    at::mm_out(c, a, b);
    best = std::max(best, flops / std::max(1e-9, Seconds(Clock::now() - t0)));
  } while (Seconds(Clock::now() - start) < seconds);
  PeakFlops peak;
  peak.flops_per_s = best;
  peak.source = "measured: " + std::to_string(n) + "x" + std::to_string(n) + " " +
                (dtype == at::kBFloat16 ? "bf16"
                 : dtype == at::kHalf   ? "fp16"
                                        : "fp32") +
                " GEMM, " + std::to_string(threads) + (threads == 1 ? " thread" : " threads");
  return peak;
}

PeakFlops DevicePeak(c10::Device device, std::string_view mixed_precision, double cpu_seconds) {
  const bool half = !mixed_precision.empty() && mixed_precision != "no";
  if (!device.is_cuda()) {
    // The dtype autocast gives the model's matmuls.
    const c10::ScalarType low = AutocastDtype(mixed_precision);
    return MeasureCpuPeak(low == c10::ScalarType::Undefined ? at::kFloat : low, cpu_seconds);
  }
  const MatmulPrecision precision = half ? MatmulPrecision::kHalf
                                    : at::globalContext().allowTF32CuBLAS()
                                        ? MatmulPrecision::kTf32
                                        : MatmulPrecision::kFp32;
  const int index = device.has_index() ? device.index() : 0;
  const std::string name = compat::CudaDeviceName(index);
  PeakFlops unknown;
  if (name.empty()) {
    unknown.source = compat::BuiltWithCudaDeviceQueries()
                         ? "unknown: cannot read the name of cuda:" + std::to_string(index)
                         : "unknown: built against a LibTorch without CUDA, cannot ask cuda:" +
                               std::to_string(index) + " its name";
    return unknown;
  }
  if (std::optional<PeakFlops> peak = TablePeak(name, precision)) return *peak;
  unknown.source =
      "unknown: no " + std::string(ToString(precision)) + " peak listed for '" + name + "'";
  return unknown;
}

}  // namespace launch::trainer
