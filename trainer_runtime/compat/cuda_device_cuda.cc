// cuda_device.h for a LibTorch with CUDA (LAUNCH_TORCH_CUDA): the device properties ATen
// caches and the caching allocator's statistics.
#include "trainer_runtime/compat/cuda_device.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#if !defined(LAUNCH_TORCH_CUDA)
#error "cuda_device_cuda.cc is for a LibTorch with CUDA (compat/CMakeLists.txt)"
#endif

namespace launch::trainer::compat {
namespace {

bool ValidDevice(int index) {
  return index >= 0 && index < static_cast<int>(c10::cuda::device_count());
}

}  // namespace

bool BuiltWithCudaDeviceQueries() { return true; }

std::string CudaDeviceName(int index) {
  try {
    if (!ValidDevice(index)) return "";
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(index);
    return prop != nullptr ? std::string(prop->name) : std::string();
  } catch (const c10::Error&) {
    return "";
  }
}

int64_t CudaPeakAllocatedBytes(int index) {
  try {
    if (!ValidDevice(index)) return -1;
    // allocated_bytes is indexed by StatType; AGGREGATE (every pool) is entry 0 in LibTorch
    // 1.13 (c10::cuda::CUDACachingAllocator::StatType) and 2.x (c10::CachingDeviceAllocator).
    const auto stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
    return stats.allocated_bytes[0].peak;
  } catch (const c10::Error&) {
    return -1;
  }
}

}  // namespace launch::trainer::compat
