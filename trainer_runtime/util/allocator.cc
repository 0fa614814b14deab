#include "trainer_runtime/util/allocator.h"

#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace launch::trainer {
namespace {

bool UserChose() {
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("MALLOC_MMAP_THRESHOLD_")) return true;
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables && std::strstr(tunables, "glibc.malloc.")) return true;
  const char* keep = std::getenv("LAUNCH_KEEP_FREED_MEMORY");
  return keep && std::strcmp(keep, "0") == 0;
}

}  // namespace

bool KeepFreedMemoryForReuse() {
#if defined(__GLIBC__)
  static const bool applied = [] {
    if (UserChose()) return false;
    // Setting either turns off glibc's own raising of the mmap threshold: set both.
    return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
  }();
  return applied;
#else
  return false;
#endif
}

}  // namespace launch::trainer
