#include "base/host.h"

#include <doctest/doctest.h>

namespace launch {
namespace {

TEST_CASE("VisibleGpusFollowsCudaVisibleDevicesAsCudaDoes") {
  CHECK(VisibleGpus(4, {}) == 4);
  CHECK(VisibleGpus(4, {{"CUDA_VISIBLE_DEVICES", "2,0"}}) == 2);
  CHECK(VisibleGpus(1, {{"CUDA_VISIBLE_DEVICES", "0,1,2"}}) == 1);
  CHECK(VisibleGpus(4, {{"CUDA_VISIBLE_DEVICES", ""}}) == 0);
  CHECK(VisibleGpus(4, {{"CUDA_VISIBLE_DEVICES", "-1"}}) == 0);
  CHECK(VisibleGpus(4, {{"CUDA_VISIBLE_DEVICES", "1,x,2"}}) == 1);  // CUDA stops at 'x'
  CHECK(VisibleGpus(4, {{"CUDA_VISIBLE_DEVICES", "GPU-8e1c,MIG-12"}}) == 2);
  CHECK(VisibleGpus(0, {{"CUDA_VISIBLE_DEVICES", "0"}}) == 0);
}

TEST_CASE("ProbeHostSeesThisMachine") {
  HostFacts facts = ProbeHost();
  CHECK(facts.cpu_slots >= 1);
  CHECK(facts.gpus >= 0);
}

}  // namespace
}  // namespace launch
