#pragma once

// What this machine offers workers, probed in one place: `launch`'s planner, `launch config`
// and `launch env` read the same facts, so they cannot disagree, and tests pass fake ones.
// No GPU library is linked: NVML is loaded with dlopen when present, so everything builds and
// runs on machines without a driver.

#include <map>
#include <string>

namespace launch {

struct HostFacts {
  int cpu_slots = 1;  // CPUs this process may run on (sched_getaffinity), at least 1
  int gpus = 0;       // NVIDIA GPUs NVML counts; 0 without NVML or a driver
};

// Probes this machine (a dlopen of libnvidia-ml.so.1: a few milliseconds when present).
HostFacts ProbeHost();

// The GPUs CUDA would show a worker: `gpus`, limited to the devices CUDA_VISIBLE_DEVICES in
// `env` lists (CUDA stops at the first entry that is not an index or a GPU-/MIG- UUID, so ""
// and "-1" hide every GPU), as torch.cuda.device_count() counts under torchrun.
int VisibleGpus(int gpus, const std::map<std::string, std::string>& env);

// This process's peak resident set size so far (getrusage's ru_maxrss), in MiB: what the
// trainer reports as each rank's peak host memory.
double PeakRssMb();

}  // namespace launch
