#pragma once

// Tells a rank at once that a peer was lost somewhere in the job, where its own transport would
// tell it late or never (launch --recover in_place): a survivor blocked on a host that went
// silent, or on a survivor that is itself waiting in the broken group, would otherwise wait out
// Gloo's timeout.
//
// A lost rank's replacement announces a recovery generation in the job's store as soon as it
// starts (comm/recovery.h). The watch asks the store every `interval` for a generation newer
// than the running group's; when one shows, or when the store itself fails (its host, rank 0,
// is gone), it calls `abandon` once, which gives up the running group
// (CountingProcessGroup::Abandon): whatever blocks in it fails at once and the rank enters its
// recovery. Its requests go through a client of its own, never interleaved with the main
// thread's.
//
// Internal to trainer_runtime (includes LibTorch).

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/status.h"

namespace launch::trainer {

class LossWatch {
 public:
  // Called on the watch's thread with what it saw ("recovery generation 2 was announced", "the
  // store failed: ..."). Must return promptly.
  using Abandon = std::function<void(const std::string& why)>;

  // Starts the watch's thread, idle until Arm.
  explicit LossWatch(std::chrono::milliseconds interval = std::chrono::milliseconds(20));
  // Stops the thread. Never waits for a store request in flight (a store whose host went
  // silent answers nothing): the thread then finishes on its own, touching nothing of this
  // object, and `abandon` is not called again.
  ~LossWatch();
  LossWatch(const LossWatch&) = delete;
  LossWatch& operator=(const LossWatch&) = delete;

  // From now on watches `store` (a client the watch alone uses) for a generation newer than
  // `generation`, the one the running group formed in; calls `abandon` at most once for it.
  void Arm(c10::intrusive_ptr<c10d::Store> store, int generation, Abandon abandon);
  // Stops watching. Once it returns, `abandon` is neither running nor called again (the group it
  // gives up may be destroyed).
  void Disarm();
  // What the watch saw when it last called `abandon` since Arm; "" when it did not.
  std::string fired() const;

  struct State;  // shared with the thread (loss_watch.cc)

 private:
  std::shared_ptr<State> state_;
};

class CountingProcessGroup;
struct DistEnv;

// Arms `watch` for `groups` (the world and the layout's groups of this rank: a pipeline's
// stage and data groups), formed in generation `generation`: a client of its own to the job's
// store (env's MASTER_ADDR:MASTER_PORT, connecting within `timeout`), and every group's Abandon
// when the watch fires. Errors: the store could not be reached (ConnectStore's).
Status WatchGroup(LossWatch& watch, const DistEnv& env, std::chrono::milliseconds timeout,
                  std::vector<c10::intrusive_ptr<CountingProcessGroup>> groups, int generation);

}  // namespace launch::trainer
