// peak_flops.h: the datasheet table by device name and precision (the names CUDA gives), and
// the CPU's measured GEMM peak on this machine.

#include "trainer_runtime/compat/peak_flops.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "base/test_util.h"
#include "trainer_runtime/compat/cuda_device.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

double Tflops(std::string_view name, MatmulPrecision p) {
  const std::optional<PeakFlops> peak = TablePeak(name, p);
  return peak ? peak->flops_per_s / 1e12 : -1;
}

TEST_CASE("TablePeakPicksTheDeviceByNameAndTheFigureByPrecision") {
  const auto kHalf = MatmulPrecision::kHalf, kFp32 = MatmulPrecision::kFp32,
             kTf32 = MatmulPrecision::kTf32;
  CHECK(Tflops("NVIDIA H100 80GB HBM3", kHalf) == doctest::Approx(989.5));
  CHECK(Tflops("NVIDIA H100 80GB HBM3", kFp32) == doctest::Approx(67));
  CHECK(Tflops("NVIDIA H100 80GB HBM3", kTf32) == doctest::Approx(494.5));
  CHECK(Tflops("NVIDIA H100 PCIe", kHalf) == doctest::Approx(756));
  CHECK(Tflops("NVIDIA H100 NVL", kHalf) == doctest::Approx(835.5));
  CHECK(Tflops("NVIDIA H200", kHalf) == doctest::Approx(989.5));
  CHECK(Tflops("NVIDIA H200 NVL", kFp32) == doctest::Approx(60));
  CHECK(Tflops("NVIDIA GH200 480GB", kHalf) == doctest::Approx(989.5));
  CHECK(Tflops("NVIDIA A100-SXM4-80GB", kHalf) == doctest::Approx(312));
  CHECK(Tflops("NVIDIA A100-PCIE-40GB", kFp32) == doctest::Approx(19.5));
  CHECK(Tflops("NVIDIA A10", kHalf) == doctest::Approx(125));
  CHECK(Tflops("NVIDIA L4", kHalf) == doctest::Approx(121));
  CHECK(Tflops("NVIDIA L40", kHalf) == doctest::Approx(181.05));
  CHECK(Tflops("NVIDIA L40S", kHalf) == doctest::Approx(362.05));
  CHECK(Tflops("NVIDIA GeForce RTX 4090", kHalf) == doctest::Approx(165.2));
  // Names not listed, or only a prefix of a listed one, have no peak.
  CHECK(Tflops("Tesla T4", kFp32) == -1);
  CHECK(Tflops("NVIDIA A10G", kHalf) == -1);
  CHECK(Tflops("NVIDIA L4000", kHalf) == -1);
  CHECK(Tflops("", kHalf) == -1);
}

TEST_CASE("TablePeakSaysWhereTheFigureComesFrom") {
  const std::optional<PeakFlops> peak = TablePeak("NVIDIA H100 80GB HBM3", MatmulPrecision::kHalf);
  REQUIRE(peak.has_value());
  CHECK(peak->known());
  CHECK(peak->source ==
        "table: NVIDIA H100 80GB HBM3 bf16/fp16 dense 989.5 TFLOP/s (H100 SXM datasheet)");
  CHECK(TablePeak("NVIDIA A100-SXM4-40GB", MatmulPrecision::kFp32)->source ==
        "table: NVIDIA A100-SXM4-40GB fp32 19.5 TFLOP/s (A100 datasheet)");
}

TEST_CASE("CpuPeakIsAMeasuredGemmRateAtThisThreadCount") {
  torch::manual_seed(7);
  const int64_t expected = torch::randint(1 << 30, {1}).item<int64_t>();
  torch::manual_seed(7);
  const PeakFlops peak = DevicePeak(c10::Device(c10::DeviceType::CPU), "no", 0.05);
  // The measurement leaves the random stream alone (the run's dropout masks stay the same).
  CHECK(torch::randint(1 << 30, {1}).item<int64_t>() == expected);
  CHECK(peak.known());
  CHECK(std::isfinite(peak.flops_per_s));
  const std::string threads = std::to_string(at::get_num_threads());
  // The GEMM's size grows with the threads (1024 from 8 on): the prefix and the count matter.
  CHECK(peak.source.rfind("measured: ", 0) == 0);
  CHECK(testing::Contains(peak.source, " fp32 GEMM, " + threads + " thread"));
  const PeakFlops bf16 = MeasureCpuPeak(at::kBFloat16, 0.02);
  CHECK(bf16.known());
  CHECK(bf16.source.find(" bf16 GEMM") != std::string::npos);
  // fp16 measures a float16 GEMM where CPU autocast runs float16 (LibTorch 2.x).
  if (PlatformFacts::Read().cpu_fp16_autocast) {
    const PeakFlops fp16 = DevicePeak(c10::Device(c10::DeviceType::CPU), "fp16", 0.02);
    CHECK(fp16.known());
    CHECK(fp16.source.find(" fp16 GEMM") != std::string::npos);
  }
}

TEST_CASE("CudaPeakOfABuildWithoutCudaIsUnknownAndSaysWhy") {
  if (compat::BuiltWithCudaDeviceQueries()) return;  // a CUDA build answers for its device
  CHECK(compat::CudaDeviceName(0).empty());
  CHECK(compat::CudaPeakAllocatedBytes(0) == -1);
  const PeakFlops peak = DevicePeak(c10::Device(c10::DeviceType::CUDA, 0), "no");
  CHECK_FALSE(peak.known());
  CHECK(peak.source.rfind("unknown: ", 0) == 0);
}

}  // namespace
}  // namespace launch::trainer
