#pragma once

// What the files of the Accelerator (accelerator.h) share and no program of a user's sees:
// what `train` and the tests read of it (AcceleratorInternals), the guard of in-place recovery
// around collective work, the signal flag's stop test and the seeds a resumed or replacement
// rank draws from, the forked children of checkpoints and snapshots. Not installed.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>

#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/comm/loss_watch.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/loop_util.h"

namespace launch::trainer {

class CountingProcessGroup;
class Model;
class PipelineEngine;

// For `train` and tests: the totals, the engine and the groups behind an Accelerator. Holds a
// reference: REQUIRES `accel` outlives it.
class AcceleratorInternals {
 public:
  explicit AcceleratorInternals(Accelerator& accel) : a_(accel) {}
  // Collectives over the gradient group since the start: all-reduces, pair exchanges
  // (ddp's two-rank last bucket), zero's gradient reduce-scatters and parameter all-gathers.
  int64_t allreduces_total() const;
  int64_t pair_exchanges_total() const;
  int64_t reduce_scatters_total() const;
  int64_t allgathers_total() const;
  int64_t alltoalls_total() const;  // the context group's all-to-alls (parallel.context)
  // Bytes of parameters, gradients and optimizer state this rank holds ({parameters,
  // gradients, optimizer}; zero: its shards).
  std::vector<int64_t> StateBytes() const;
  // The pipeline engine when this rank is a pipeline stage, else null.
  PipelineEngine* pipeline() const;
  CountingProcessGroup* process_group() const;  // the world's (null for one process)
  Model* model() const;                         // the prepared model's view (model.h)
  // Stages x fields of PipelineEngine::Stats from the first replica of every stage, on every
  // rank. COLLECTIVE.
  std::vector<double> GatherPipelineStats(uint64_t checksum);

 private:
  Accelerator& a_;
};

// Whether the last signal received asks to stop (SIGTERM, SIGINT): a recovery stops waiting.
bool StopRequested();

// Forks a child that runs `body` on its copy-on-write view of this moment and exits with what
// it returns: it dies with this process (PR_SET_PDEATHSIG), and never returns into the program
// (_exit skips every destructor and atexit handler). Stdio is flushed first, so nothing
// buffered is written twice. Returns the child's pid, or -1 with errno set.
pid_t ForkChild(const std::function<int()>& body);

// How long in-place recovery waits for the group of a new generation to fill: across machines
// a replacement may be a whole new node, so the agent sizes it from the rendezvous' own
// deadlines (LAUNCH_RECOVER_WAIT_S); otherwise the group's `timeout`.
inline std::chrono::milliseconds RecoverWait(const DistEnv& env,
                                             std::chrono::milliseconds timeout) {
  return env.recover_wait_s > 0 ? std::chrono::milliseconds(env.recover_wait_s * 1000LL) : timeout;
}

// The seed of the CPU generator of a rank that resumes a checkpoint holding no RNG state of its
// own (it joined at a world-size change): distinct per rank and per resume step, and distinct
// from the streams `train` seeds at start (seed + 1000003 * (rank + 1)).
uint64_t NewRankSeed(uint64_t seed, int rank, int64_t step);

// In-place recovery's per-micro-batch stream: a function of where the micro-batch is in the
// run, so a replacement draws what the rank it replaces would have drawn (nothing keeps a dead
// rank's generator state). Distinct from NewRankSeed's streams for the same (rank, step).
uint64_t MicroBatchSeed(uint64_t seed, int rank, int64_t step, int64_t micro);

template <typename Fn>
bool Accelerator::Guarded(Fn&& fn) {
  if (!recover_) {
    fn();
    return true;
  }
  if (peer_lost_) return false;
  try {
    fn();
    return true;
  } catch (const std::exception& e) {
    // c10::Error from the transports and the reducer, gloo's own exceptions from Gloo.
    const auto* c10 = dynamic_cast<const c10::Error*>(&e);
    const std::string what = c10 ? c10->what_without_backtrace() : e.what();
    if (!IsLostPeerError(what)) throw;
    peer_lost_ = true;
    lost_at_ = std::chrono::steady_clock::now();
    // Told by the watch, the error is only the echo of its own Abandon: say what it saw.
    const std::string watched = loss_watch_ ? loss_watch_->fired() : "";
    lost_what_ = watched.empty() ? what.substr(0, what.find('\n')) : watched;
    // Every survivor blocked on this rank fails at once, not only its ring neighbours, in
    // every group of the layout (a pipeline's stage and data groups).
    AbandonGroups();
    return false;
  }
}

}  // namespace launch::trainer
