// A stand-in for NVIDIA's libnvidia-ml.so.1 with two fake GPUs, so that `launch env`'s NVML path
// (dlopen + dlsym) runs on machines without a GPU. Signatures follow nvml.h (return 0 = success).
#include <cstring>

namespace {
struct FakeDevice {
  const char* name;
  unsigned long long total, free, used;
};
FakeDevice devices[] = {{"NVIDIA H100 80GB HBM3", 85520809984ULL, 84000000000ULL, 1520809984ULL},
                        {"NVIDIA A100-SXM4-40GB", 42949672960ULL, 42949672960ULL, 0}};
bool initialised = false;
}  // namespace

extern "C" {
struct nvmlMemory_t {
  unsigned long long total, free, used;
};
int nvmlInit_v2() {
  initialised = true;
  return 0;
}
int nvmlShutdown() {
  initialised = false;
  return 0;
}
int nvmlDeviceGetCount_v2(unsigned int* count) {
  if (!initialised) return 1;
  *count = 2;
  return 0;
}
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (!initialised || index >= 2) return 2;
  *device = &devices[index];
  return 0;
}
int nvmlDeviceGetName(void* device, char* name, unsigned int length) {
  std::strncpy(name, static_cast<FakeDevice*>(device)->name, length - 1);
  name[length - 1] = '\0';
  return 0;
}
int nvmlDeviceGetMemoryInfo(void* device, nvmlMemory_t* memory) {
  auto* d = static_cast<FakeDevice*>(device);
  memory->total = d->total;
  memory->free = d->free;
  memory->used = d->used;
  return 0;
}
int nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  std::strncpy(version, "535.104.05", length - 1);
  version[length - 1] = '\0';
  return 0;
}
int nvmlSystemGetCudaDriverVersion(int* version) {
  *version = 12020;
  return 0;
}
}
