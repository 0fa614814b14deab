// device_agreement.h: ranks on different kinds of device are named at start, over a real Gloo
// group of two ranks on threads (one of them on a stand-in CUDA platform).

#include "trainer_runtime/comm/device_agreement.h"

#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "base/test_util.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

Platform CudaPlatform() {
  PlatformFacts facts;
  facts.libtorch_cuda = true;
  facts.cuda_device_count = 1;
  facts.nccl = true;
  auto p = Platform::Create(DistEnv(), "no", facts);
  REQUIRE(p.ok());
  return *p;
}

using launch::testing::Contains;

constexpr int64_t kCpu = static_cast<int64_t>(DeviceKind::kCpu);
constexpr int64_t kCuda = static_cast<int64_t>(DeviceKind::kCuda);

TEST_CASE("DeviceKindsAgreeWhenEveryRankIsOnTheSameKind") {
  CHECK(DeviceKindsAgree({kCpu, kCpu, kCpu}, 1, Platform()).ok());
  CHECK(DeviceKindsAgree({kCuda, kCuda}, 0, CudaPlatform()).ok());
  CHECK(DeviceKindsAgree({kCpu}, 0, Platform()).ok());
}

TEST_CASE("DeviceKindsDisagreeingNameTheRanksOfEachKind") {
  const Status s = DeviceKindsAgree({kCuda, kCuda, kCpu, kCpu, kCuda, kCpu}, 2, Platform());
  CHECK((s.code() == Status::Code::kInvalidConfig));
  const std::string& m = s.message();
  INFO(m);
  CHECK(Contains(m, "ranks disagree on their device: ranks 2-3, 5 on cpu, ranks 0-1, 4 on cuda"));
  CHECK(Contains(m, "this rank, 2: cpu, no CUDA in this LibTorch"));
  CHECK(Contains(m, "CUDA_VISIBLE_DEVICES"));
  CHECK(Contains(m, "launch --cpu"));
  // A rank that wrote nothing (0) is named as such.
  CHECK(Contains(DeviceKindsAgree({kCpu, 0}, 0, Platform()).message(),
                 "rank 1 on an unknown device"));
}

TEST_CASE("CheckDeviceKindsAgreeComparesTheRanksOverTheGroup") {
  // Two ranks on threads of this process meeting through one in-memory store, once on the same
  // kind and once on different kinds (rank 1 posing as a CUDA rank; the check's tensors are CPU
  // tensors on Gloo either way).
  for (const bool mixed : {false, true}) {
    INFO("mixed " << mixed);
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<Status> results(2);
    std::vector<std::string> errors(2);
    auto rank_main = [&](int rank) {
      try {
        compat::GroupOptions options;
        options.timeout = std::chrono::seconds(30);
        options.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
        options.gloo_threads = 1;
        auto group = compat::NewProcessGroup(store, rank, 2, options);
        const Platform platform = mixed && rank == 1 ? CudaPlatform() : Platform();
        results[rank] = CheckDeviceKindsAgree(*group, platform);
      } catch (const std::exception& e) {
        errors[rank] = e.what();
      }
    };
    std::thread peer(rank_main, 1);
    rank_main(0);
    peer.join();
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << ": " << results[r].message());
      REQUIRE(errors[r] == "");
      if (!mixed) {
        CHECK(results[r].ok());
        continue;
      }
      CHECK((results[r].code() == Status::Code::kInvalidConfig));
      CHECK(Contains(results[r].message(), "rank 0 on cpu, rank 1 on cuda"));
      CHECK(Contains(results[r].message(),
                     "this rank, " + std::to_string(r) + ": " + (r == 0 ? "cpu" : "cuda")));
    }
  }
}

}  // namespace
}  // namespace launch::trainer
