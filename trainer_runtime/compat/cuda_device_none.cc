// cuda_device.h for a LibTorch without CUDA: nothing to ask.
#include "trainer_runtime/compat/cuda_device.h"

namespace launch::trainer::compat {

bool BuiltWithCudaDeviceQueries() { return false; }
std::string CudaDeviceName(int) { return ""; }
int64_t CudaPeakAllocatedBytes(int) { return -1; }

}  // namespace launch::trainer::compat
