#pragma once

// What `train` asks a CUDA device about itself: its name (to look its peak FLOP/s up,
// peak_flops.h) and the caching allocator's peak of allocated bytes (final.json's per-rank peak
// device memory). The only CUDA headers of the trainer are behind this header:
//   - cuda_device_cuda.cc, compiled when the LibTorch CMake found has CUDA (it defines
//     LAUNCH_TORCH_CUDA for it): ATen/cuda/CUDAContext.h, c10/cuda/CUDACachingAllocator.h;
//   - cuda_device_none.cc otherwise (a CPU-only LibTorch): every answer is "unknown".
// Both answer "unknown" rather than throw (no driver, a bad index, a CUDA error), so a report
// never fails a run.
//
// Thread-safe as far as the CUDA runtime and the caching allocator are.

#include <cstdint>
#include <string>

namespace launch::trainer::compat {

// Whether this build has the CUDA implementation (LAUNCH_TORCH_CUDA).
bool BuiltWithCudaDeviceQueries();

// cudaDeviceProp::name of CUDA device `index` ("NVIDIA H100 80GB HBM3"), or "" when unknown.
std::string CudaDeviceName(int index);

// The caching allocator's peak of allocated bytes on CUDA device `index` since the process
// started (torch.cuda.max_memory_allocated(index)), or -1 when unknown: a bad index, no CUDA,
// or before this process's first allocation on the device (LibTorch 2.11's allocator answers
// only once it is initialised: seen on an H200).
int64_t CudaPeakAllocatedBytes(int index);

}  // namespace launch::trainer::compat
