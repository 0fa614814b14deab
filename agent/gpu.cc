#include "agent/gpu.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

namespace launch::agent {

int CountGpus() {
  void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return 0;
  using InitFn = int (*)();
  using CountFn = int (*)(unsigned int*);
  auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
  auto count = reinterpret_cast<CountFn>(dlsym(lib, "nvmlDeviceGetCount_v2"));
  auto shutdown = reinterpret_cast<InitFn>(dlsym(lib, "nvmlShutdown"));
  unsigned int n = 0;
  if (init && count && init() == 0) {
    if (count(&n) != 0) n = 0;
    if (shutdown) shutdown();
  }
  dlclose(lib);
  return static_cast<int>(n);
}

int CountCpuSlots() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace launch::agent
