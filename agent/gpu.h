#pragma once

// Local device inventory without linking anything GPU-related: NVML is loaded with dlopen
// when present, so `launch` builds and runs on machines without a driver.

#include <string>
#include <vector>

namespace launch::agent {

// Number of NVIDIA GPUs visible through NVML; 0 when NVML or a driver is absent.
int CountGpus();

// CPU slots this process may use (sched_getaffinity), at least 1.
int CountCpuSlots();

}  // namespace launch::agent
