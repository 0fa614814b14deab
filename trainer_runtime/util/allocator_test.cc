// allocator.h: after KeepFreedMemoryForReuse, memory a "step" freed is reused by the next one
// without faulting its pages in again (the kernel's count of this process's minor faults).

#include "trainer_runtime/util/allocator.h"

#include <sys/resource.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include <doctest/doctest.h>

namespace launch::trainer {
namespace {

long MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Allocates and writes `chunks` blocks of 8 MiB (a step's activations), then frees them.
void Step(int chunks) {
  std::vector<char*> blocks;
  for (int i = 0; i < chunks; ++i) {
    blocks.push_back(static_cast<char*>(std::malloc(8 << 20)));
    std::memset(blocks.back(), 1, 8 << 20);
  }
  for (char* b : blocks) std::free(b);
}

TEST_CASE("FreedMemoryIsReusedWithoutFaultingItInAgain") {
#if defined(__GLIBC__)
  REQUIRE(KeepFreedMemoryForReuse());
  CHECK(KeepFreedMemoryForReuse());  // idempotent
  Step(8);                           // the first step faults its 64 MiB in
  const long before = MinorFaults();
  Step(8);
  // 64 MiB is 16,384 pages of 4 KiB: given back at the free, they would all fault again.
  CHECK(MinorFaults() - before < 1000);
#endif
}

}  // namespace
}  // namespace launch::trainer
