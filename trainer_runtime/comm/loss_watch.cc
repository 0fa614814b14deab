#include "trainer_runtime/comm/loss_watch.h"

#include <thread>
#include <utility>

#include "base/mutex.h"
#include "base/thread_annotations.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"

namespace launch::trainer {

// Shared with the thread, which may outlive the LossWatch (a store request in flight).
struct LossWatch::State {
  Mutex mu;
  CondVar changed{&mu};
  bool stop GUARDED_BY(mu) = false;
  bool done GUARDED_BY(mu) = false;  // the thread ended
  bool armed GUARDED_BY(mu) = false;
  uint64_t epoch GUARDED_BY(mu) = 0;  // counts Arm and Disarm calls
  c10::intrusive_ptr<c10d::Store> store GUARDED_BY(mu);
  int generation GUARDED_BY(mu) = 0;
  Abandon abandon GUARDED_BY(mu);
  std::string fired GUARDED_BY(mu);
};

namespace {

// What the store says of a loss, "" when nothing: a newer generation, or its own failure.
std::string AskStore(c10d::Store& store, int generation) {
  try {
    StatusOr<int64_t> newest = AnnouncedGeneration(store);
    if (!newest.ok()) return newest.status().message();
    if (*newest > generation)
      return "recovery generation " + std::to_string(*newest) +
             " was announced: a lost rank's replacement started";
    return "";
  } catch (const std::exception& e) {
    // The store's host (rank 0's worker) is gone, or the network to it.
    std::string what = e.what();
    return "the job's store failed (" + what.substr(0, what.find('\n')) + ")";
  }
}

void Run(const std::shared_ptr<LossWatch::State>& s, std::chrono::milliseconds interval) {
  MutexLock lock(&s->mu);
  while (!s->stop) {
    if (!s->armed) {
      s->changed.Wait();
      continue;
    }
    const c10::intrusive_ptr<c10d::Store> store = s->store;
    const int generation = s->generation;
    const uint64_t epoch = s->epoch;
    lock.Unlock();
    const std::string why = AskStore(*store, generation);
    lock.Lock();
    if (s->stop) break;
    if (!why.empty() && s->armed && s->epoch == epoch) {
      // Under the lock: Disarm returns only once this is done.
      s->fired = why;
      s->armed = false;
      s->abandon(why);
      s->abandon = nullptr;
      s->store.reset();
      continue;
    }
    const auto until = std::chrono::steady_clock::now() + interval;
    s->changed.WaitUntil(until,
                         [&]() NO_THREAD_SAFETY_ANALYSIS { return s->stop || s->epoch != epoch; });
  }
  s->done = true;
  s->changed.NotifyAll();
}

}  // namespace

LossWatch::LossWatch(std::chrono::milliseconds interval) : state_(std::make_shared<State>()) {
  std::thread([s = state_, interval] { Run(s, interval); }).detach();
}

LossWatch::~LossWatch() {
  MutexLock lock(&state_->mu);
  state_->stop = true;
  state_->armed = false;
  // Dropped here, not on the thread: a request in flight holds nothing but its store client.
  state_->abandon = nullptr;
  state_->store.reset();
  state_->changed.NotifyAll();
  // An idle thread ends at once; one in a store request is left to end on its own.
  state_->changed.WaitUntil(std::chrono::steady_clock::now() + std::chrono::milliseconds(200),
                            [&]() NO_THREAD_SAFETY_ANALYSIS { return state_->done; });
}

void LossWatch::Arm(c10::intrusive_ptr<c10d::Store> store, int generation, Abandon abandon) {
  MutexLock lock(&state_->mu);
  state_->store = std::move(store);
  state_->generation = generation;
  state_->abandon = std::move(abandon);
  state_->fired.clear();
  state_->armed = true;
  ++state_->epoch;
  state_->changed.NotifyAll();
}

void LossWatch::Disarm() {
  MutexLock lock(&state_->mu);
  state_->armed = false;
  state_->abandon = nullptr;
  state_->store.reset();
  ++state_->epoch;
  state_->changed.NotifyAll();
}

std::string LossWatch::fired() const {
  MutexLock lock(&state_->mu);
  return state_->fired;
}

Status WatchGroup(LossWatch& watch, const DistEnv& env, std::chrono::milliseconds timeout,
                  std::vector<c10::intrusive_ptr<CountingProcessGroup>> groups, int generation) {
  LAUNCH_ASSIGN_OR_RETURN(c10::intrusive_ptr<c10d::Store> store,
                          ConnectStore(env, /*host=*/false, timeout));
  watch.Arm(std::move(store), generation, [groups = std::move(groups)](const std::string&) {
    for (const auto& group : groups) group->Abandon();
  });
  return Status::Ok();
}

}  // namespace launch::trainer
