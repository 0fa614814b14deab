// loss_watch.h: the watch fires once per arming when a newer recovery generation is announced or
// the store fails, never after Disarm; and CountingProcessGroup::Abandon fails a peer's blocked
// Gloo receive at once (a real group of two ranks on threads).

#include "trainer_runtime/comm/loss_watch.h"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/mutex.h"
#include "base/test_util.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header
#include "trainer_runtime/util/loop_util.h"

namespace launch::trainer {
namespace {

using launch::testing::Contains;
using std::chrono::milliseconds;

// What the watch's `abandon` was called with.
class Calls {
 public:
  LossWatch::Abandon Callback() {
    return [this](const std::string& why) {
      MutexLock lock(&mu_);
      whys_.push_back(why);
    };
  }
  std::vector<std::string> whys() {
    MutexLock lock(&mu_);
    return whys_;
  }
  // Until `n` calls were made, or 10 s passed.
  bool WaitFor(size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (whys().size() < n) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(milliseconds(2));
    }
    return true;
  }

 private:
  Mutex mu_;
  std::vector<std::string> whys_ GUARDED_BY(mu_);
};

TEST_CASE("LossWatchFiresOnceWhenANewerGenerationIsAnnounced") {
  auto store = c10::make_intrusive<c10d::HashStore>();
  Calls calls;
  LossWatch watch(milliseconds(5));
  watch.Arm(store, 0, calls.Callback());
  std::this_thread::sleep_for(milliseconds(60));
  CHECK(calls.whys().empty());  // nothing announced: nothing lost
  REQUIRE(AnnounceGeneration(*store, 1).ok());
  REQUIRE(calls.WaitFor(1));
  CHECK(Contains(calls.whys()[0], "recovery generation 1 was announced"));
  CHECK(watch.fired() == calls.whys()[0]);
  // Once per arming: a second announcement finds the group abandoned already.
  REQUIRE(AnnounceGeneration(*store, 2).ok());
  std::this_thread::sleep_for(milliseconds(60));
  CHECK(calls.whys().size() == 1);

  // Re-armed for the group of generation 2: generation 2 is no news; 3 is.
  watch.Arm(store, 2, calls.Callback());
  CHECK(watch.fired() == "");
  std::this_thread::sleep_for(milliseconds(60));
  CHECK(calls.whys().size() == 1);
  REQUIRE(AnnounceGeneration(*store, 3).ok());
  REQUIRE(calls.WaitFor(2));
  CHECK(Contains(calls.whys()[1], "recovery generation 3"));

  // Disarmed: nothing fires, whatever is announced.
  watch.Arm(store, 3, calls.Callback());
  watch.Disarm();
  REQUIRE(AnnounceGeneration(*store, 4).ok());
  std::this_thread::sleep_for(milliseconds(60));
  CHECK(calls.whys().size() == 2);
}

TEST_CASE("LossWatchFiresWhenTheStoreFails") {
  // The store's host (rank 0's worker) gone: its clients' requests fail. Both ends made as
  // the workers make them (ConnectStore), the host on any free port.
  DistEnv env;
  env.master_addr = "127.0.0.1";
  env.master_port = 0;
  env.world_size = 2;
  StatusOr<c10::intrusive_ptr<c10d::Store>> server =
      ConnectStore(env, /*host=*/true, std::chrono::seconds(10));
  REQUIRE(server.ok());
  env.rank = 1;
  env.master_port = dynamic_cast<c10d::TCPStore&>(**server).getPort();
  StatusOr<c10::intrusive_ptr<c10d::Store>> client =
      ConnectStore(env, /*host=*/false, std::chrono::seconds(10));
  REQUIRE(client.ok());
  Calls calls;
  LossWatch watch(milliseconds(5));
  watch.Arm(*client, 0, calls.Callback());
  std::this_thread::sleep_for(milliseconds(60));
  CHECK(calls.whys().empty());
  *server = c10::intrusive_ptr<c10d::Store>();
  REQUIRE(calls.WaitFor(1));
  CHECK(Contains(calls.whys()[0], "the job's store failed"));
}

// Two ranks of a Gloo group on threads (no shared memory: both ranks are this process),
// formed under a 60 s timeout; `collective_timeout` as Accelerator::Create sets it.
std::vector<c10::intrusive_ptr<CountingProcessGroup>> FormTwoRanks(
    std::chrono::milliseconds collective_timeout = std::chrono::milliseconds(0)) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<c10::intrusive_ptr<CountingProcessGroup>> groups(2);
  std::vector<std::string> errors(2);
  auto form = [&](int rank) {
    DistEnv env;
    env.rank = rank;
    env.world_size = 2;
    env.master_addr = "127.0.0.1";
    env.tuning.shm_allreduce = false;
    env.collective_timeout = collective_timeout;
    StatusOr<c10::intrusive_ptr<CountingProcessGroup>> pg =
        CreateGroupOver(store, "world", rank, 2, env, std::chrono::seconds(60));
    if (pg.ok())
      groups[rank] = *pg;
    else
      errors[rank] = pg.status().message();
  };
  std::thread peer(form, 1);
  form(0);
  peer.join();
  REQUIRE(errors[0] == "");
  REQUIRE(errors[1] == "");
  return groups;
}

TEST_CASE("AbandonFailsAPeersBlockedGlooReceiveAtOnce") {
  // Rank 1 waits for a message rank 0 never sends. Rank 0 abandons the group: rank 1's receive
  // fails long before the group's 60 s timeout, with the error a closed connection gives.
  std::vector<c10::intrusive_ptr<CountingProcessGroup>> groups = FormTwoRanks();

  std::string received_error;
  const auto started = std::chrono::steady_clock::now();
  std::thread receiver([&] {
    std::vector<at::Tensor> t = {at::zeros({4})};
    try {
      groups[1]->recv(t, 0, 0)->wait();
    } catch (const std::exception& e) {
      received_error = e.what();
    }
  });
  std::this_thread::sleep_for(milliseconds(100));
  groups[0]->Abandon();
  receiver.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO(received_error);
  CHECK(seconds < 30);  // the group's own timeout is 60 s
  CHECK(IsLostPeerError(received_error));
}

TEST_CASE("ACollectiveWaitsTheCollectiveTimeoutNotTheOneTheGroupFormedUnder") {
  // Formed under 60 s, collectives bounded at 1 s: rank 0's all-reduce, which rank 1 never
  // joins, fails with Gloo's timeout after about a second; the group was not changed for it.
  std::vector<c10::intrusive_ptr<CountingProcessGroup>> groups =
      FormTwoRanks(std::chrono::seconds(1));
  std::vector<at::Tensor> t = {at::ones({4})};
  std::string error;
  const auto started = std::chrono::steady_clock::now();
  try {
    groups[0]->allreduce(t, c10d::AllreduceOptions())->wait();
  } catch (const std::exception& e) {
    error = e.what();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  INFO(error);
  CHECK(seconds >= 0.9);
  CHECK(seconds < 20);  // the formation timeout, 60 s, would be the bound without the setting
  CHECK(Contains(error, "imed out"));
}

}  // namespace
}  // namespace launch::trainer
