#include "base/host.h"

#include <dlfcn.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

#include "base/strings.h"

namespace launch {
namespace {

int CountNvmlGpus() {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return 0;
  using InitFn = int (*)();
  using CountFn = int (*)(unsigned int*);
  auto init = reinterpret_cast<InitFn>(::dlsym(lib, "nvmlInit_v2"));
  auto count = reinterpret_cast<CountFn>(::dlsym(lib, "nvmlDeviceGetCount_v2"));
  auto shutdown = reinterpret_cast<InitFn>(::dlsym(lib, "nvmlShutdown"));
  unsigned int n = 0;
  if (init && count && init() == 0) {
    if (count(&n) != 0) n = 0;
    if (shutdown) shutdown();
  }
  ::dlclose(lib);
  return static_cast<int>(n);
}

int CountCpuSlots() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = ::sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

HostFacts ProbeHost() {
  HostFacts facts;
  facts.cpu_slots = CountCpuSlots();
  facts.gpus = CountNvmlGpus();
  return facts;
}

int VisibleGpus(int gpus, const std::map<std::string, std::string>& env) {
  auto visible = env.find("CUDA_VISIBLE_DEVICES");
  if (visible == env.end()) return gpus;
  int listed = 0;
  for (std::string item : Split(visible->second, ',')) {
    item = Trim(item);
    const bool index = !item.empty() && item.find_first_not_of("0123456789") == std::string::npos;
    if (!index && !StartsWith(item, "GPU-") && !StartsWith(item, "MIG-")) break;
    ++listed;
  }
  return std::min(gpus, listed);
}

double PeakRssMb() {
  struct rusage usage {};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // Linux counts kilobytes
}

}  // namespace launch
