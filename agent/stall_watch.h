#pragma once

// Hang forensics on the agent's side: StallWatch reads the collective rings of this node's
// workers (base/collective_ring.h) and explains a hang.
//
// The stall rule (`launch --stall_timeout S`): no watched rank has completed a collective for S
// seconds (counted from the latest completion, or from the rings' creation before any) while at
// least one of them is inside one or is stopped (SIGSTOP: on a node of its own, a stopped rank is
// in no collective while its peers wait on other nodes). Then StallWatch builds ONE report: which
// ranks wait in which collective (op, group, sequence number, bytes, for how long), which ranks
// have not entered it and the last collective each of them completed, a desync when two ranks are
// in different collectives at the same sequence number of a group, and for the ranks to blame
// (those that have not entered, and the stopped; else those waiting) their process state from /proc
// ("stopped (state T)") and their main thread's native stack (the worker's StackDumpSignal handler;
// a stopped worker is sent SIGCONT after the signal, so the handler runs where it was stopped). It
// then calls `on_stall` with the report and the ranks to blame; the owner makes that a failure of
// the job (worker_group.h).
//
// Report() gives the same report on demand, for a running job: it blames nobody, sends no
// SIGCONT, and fires nothing.
//
// Scope: the ranks of this node. A collective whose missing ranks run on another node shows as
// every local rank waiting; the report says so.
//
// Thread-safety: none; everything runs on the io_context's thread. Lifecycle: owned through a
// shared_ptr (its timers hold weak references); the destructor removes the ring and stack
// files, whatever state their workers are in.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/collective_ring.h"
#include "base/status.h"

namespace boost::asio {
class io_context;
}

namespace launch::agent {

// One rank as the agent saw it: its ring (or why there is none).
struct RankView {
  int rank = 0;
  StatusOr<RingSnapshot> ring = Status::NotFound("not read");
  bool stopped = false;  // its process is stopped (SIGSTOP): it takes part in nothing
};

// What the rings say at `now_ns` (CLOCK_MONOTONIC), pure: the report's body and whom to blame.
struct RingAnalysis {
  // The stall rule holds for `timeout_ns` (never when it is 0): no completion for that long
  // while a rank has waited in a collective that long, or a rank is stopped.
  bool stalled = false;
  double idle_s = 0;         // since the latest completion (or the rings' creation)
  bool desync = false;       // two ranks in different collectives at one sequence number
  std::vector<int> waiting;  // ranks inside a collective, ascending
  std::vector<int> lagging;  // ranks that have not entered the collective others wait in
  // The lagging and the stopped ranks (a stopped rank may have entered the collective and
  // still hold it up); if none, the waiting ranks.
  std::vector<int> blamed;
  // Every rank here waits, none lags, none is stopped, no desync: the cause is on another node.
  // StallWatch then waits max(3 s, S / 2) longer, so that node's agent reports it first.
  bool remote = false;
  std::vector<std::string> lines;  // one per finding, no trailing newline
};
RingAnalysis AnalyzeRings(const std::vector<RankView>& ranks, uint64_t now_ns, uint64_t timeout_ns);

// "stopped (state T: SIGSTOP, SIGTSTP or a debugger)", "running (state R)", "sleeping in
// futex_wait_queue (state S)" from /proc/<pid>/{stat,wchan}; "gone" when there is no such
// process.
std::string DescribeProcessState(pid_t pid);
// Whether /proc/<pid>/stat says 'T' (stopped by a signal; not 't', traced).
bool IsStopped(pid_t pid);

// The frames of a stack file (InstallStackDump's format), one per element, C++ names demangled
// ("train(launch::trainer::Step()+0x1f) [0x55...]"); empty when the file is absent or
// incomplete (no "end" line).
std::vector<std::string> ReadStackFile(const std::string& path);
// "" when ReadStackFile's `frames` are a whole native stack (they end in the program's `_start`);
// otherwise a line for the report saying why they end early: the dump's frame limit, or code
// without unwind information where the process was stopped (a BLAS kernel).
std::string StackCutShort(const std::vector<std::string>& frames);

// A replacement the agent started for a rank (launch --recover in_place).
struct Replacement {
  pid_t pid = 0;       // the process the agent started (its exec shim, parent of the worker)
  int generation = 0;  // LAUNCH_RECOVER_GENERATION
};

struct StallWatchOptions {
  std::chrono::milliseconds stall_timeout{0};  // 0: no stall rule (rings and Report() only)
  std::string ring_prefix;                     // rank r's ring is ring_prefix + std::to_string(r)
  std::vector<int> ranks;                      // the global ranks of this node's workers
  // How long to wait for the stacks the workers write (they write them within milliseconds
  // unless the process is wedged in the kernel).
  std::chrono::milliseconds stack_wait{1500};
  // The live replacement of `rank`, if the agent started one (called on the io_context's
  // thread). A rank whose ring names a process that is gone is then reported as replaced and
  // joining, not only as gone: a replacement records nothing until its group has formed.
  std::function<std::optional<Replacement>(int rank)> replacement;
};

class StallWatch : public std::enable_shared_from_this<StallWatch> {
 public:
  // Runs once, on the io_context, with the whole report (ending in a newline) and the ranks
  // to blame.
  using OnStall = std::function<void(const std::string& report, const std::vector<int>& blamed)>;

  StallWatch(boost::asio::io_context& io, StallWatchOptions options, OnStall on_stall);
  ~StallWatch();

  // "/dev/shm/launch-ring-<run_id>-<agent pid>-r" (or under $TMPDIR without /dev/shm): the
  // prefix for StallWatchOptions::ring_prefix. run_id's characters outside [A-Za-z0-9_.-] become
  // '_'.
  static std::string DefaultRingPrefix(const std::string& run_id);

  std::string RingPath(int rank) const;

  // Starts polling (every min(1 s, stall_timeout / 5)); nothing when stall_timeout is 0.
  void Start();
  // Builds the on-demand report (with every rank's stack) and passes it to `done` on the
  // io_context.
  void Report(std::function<void(const std::string&)> done);
  // Stops polling; a report in progress is dropped.
  void Cancel();

 private:
  struct Pending;
  void Arm();
  void Poll();
  std::vector<RankView> ReadAll() const;
  // Sends the stack signal to `ranks` (SIGCONT after it to stopped ones when `resume`), then
  // collects their stacks and calls `finish` with the text to append.
  void CollectStacks(const std::vector<RankView>& views, const std::vector<int>& ranks, bool resume,
                     std::function<void(std::string)> finish);
  void CheckStacks(const std::shared_ptr<Pending>& pending);
  void RemoveFiles();

  boost::asio::io_context& io_;
  StallWatchOptions options_;
  OnStall on_stall_;
  struct Timers;
  std::unique_ptr<Timers> timers_;
  bool fired_ = false;
  bool cancelled_ = false;
};

}  // namespace launch::agent
