#pragma once

// WorkerGroup: the local workers of one attempt, supervised on an asio::io_context.
//
// Start() spawns `local_world_size` workers (one process group each) with torchrun's
// environment contract, multiplexes their stdout/stderr line by line onto the console with a
// "[rank N]: " prefix (and/or into per-rank files), and watches them through pidfds — no
// polling interval. When a worker fails (non-zero exit or a signal), it is recorded as the root
// cause and its siblings get SIGTERM, then SIGKILL after `stop_grace`. Once every worker has been
// reaped and its pipes drained, `on_done` runs (on the io_context) with the outcome.
//
// Output never blocks the io_context, which the agent shares with its heartbeats, the rendezvous
// server, signal handling and these pidfds: the bytes go through OutputWriter threads
// (output_writer.h), one per console file (shared by every group and by launch's own log lines,
// which Start() routes there) and one per group for the log files. While the console or a
// worker's log file holds a full queue (1 MiB), that worker's pipe is not read, so the worker
// blocks in its own write, as under torchrun. Memory so stays bounded: per console, 1 MiB plus,
// per pipe, one read's lines (at most LineBuffer's 1 MiB piece plus 64 KiB with prefixes), plus
// per pipe its partial line (up to 1 MiB) and, once its worker has exited, up to 1 MiB it left
// in the pipe (read at once, so its last lines are not held up). `on_done` runs once what the
// pipes held is written too, or stop_grace after the last pipe closed: a console that never reads
// again cannot hold the group (console output still queued is written if the console recovers,
// else dropped at exit, see ConsoleWriterFor; log-file output is dropped with the group).
//
// Thread-safety: none; every call and callback happens on the io_context's thread.
// Lifecycle: one Start() per WorkerGroup. The destructor SIGKILLs and reaps whatever still runs,
// so no worker outlives the group on any exit path.

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "base/exit_status.h"
#include "base/status.h"

namespace boost::asio {
class io_context;
}

namespace launch::agent {

class JobCgroup;

enum StreamBits { kStdout = 1, kStderr = 2 };

struct WorkerExit;

struct WorkerGroupSpec {
  std::vector<std::string> argv;      // resolved program and its arguments, the same for every rank
  std::vector<std::string> base_env;  // inherited environment, "KEY=VALUE"
  std::map<std::string, std::string> extra_env;  // set for every worker (OMP_NUM_THREADS, ...)
  int local_world_size = 1;
  int rank_offset = 0;  // global rank of local rank 0
  int world_size = 1;
  int group_rank = 0;        // node rank
  int group_world_size = 1;  // number of nodes
  std::string role = "default";
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  int restart_count = 0;  // TORCHELASTIC_RESTART_COUNT
  int max_restarts = 0;
  std::string run_id = "none";
  std::string exec_shim;  // path of launch-exec (parent-death guard); empty = none
  // The job's cgroup (cgroup.h), made when the first group starts where the kernel allows it,
  // or null: the shims' subreapers alone. Not owned; outlives every group. Used only with a
  // shim. When it exists, a shim reaped with its worker's cgroup still there (it was SIGKILLed)
  // gets that cgroup killed and emptied before the group goes on: nothing the worker started
  // runs beside the next attempt.
  JobCgroup* job_cgroup = nullptr;
  // Per-rank files <log_dir>/rank_<global rank>.{stdout,stderr} for the streams whose bit is set
  // in file_streams[local_rank]; log_dir must exist. Empty log_dir: no files.
  std::string log_dir;
  std::vector<int> file_streams;     // per local rank; missing entries mean 0
  std::vector<int> console_streams;  // per local rank; missing entries mean kStdout | kStderr
  std::chrono::milliseconds stop_grace{30000};
  // torchrun's error-file contract (error_file.h): each worker gets TORCHELASTIC_ERROR_FILE, in
  // log_dir when one is set (rank_<r>.error.json, kept), else in a private directory under
  // $TMPDIR removed with the group; a failed worker's file is read into its WorkerExit.
  bool error_files = true;
  // torchrun --virtual_local_rank: LOCAL_RANK=0 for every worker and, with gpu_workers, its
  // CUDA_VISIBLE_DEVICES narrowed to the one device its local rank selects.
  bool virtual_local_rank = false;
  bool gpu_workers = false;
  // When this agent is one of several on a node, one task each (SLURM's --ntasks-per-node=G):
  // what the worker's LOCAL_RANK (of its single worker), LOCAL_WORLD_SIZE, GROUP_RANK and
  // GROUP_WORLD_SIZE say, so they describe the node. local_rank < 0: derived as usual.
  struct NodeView {
    int local_rank = -1;
    int local_world_size = 0;
    int node_rank = 0;
    int num_nodes = 0;
  } node_view;
  // Hang forensics (stall_watch.h): every worker gets LAUNCH_COLLECTIVE_RING, a ring file under
  // /dev/shm removed with the group. With stall_timeout > 0, no collective completed on this
  // node for that long while some worker waits in one prints the stall report, and the workers
  // it blames (those that never entered the collective; else those waiting) are killed with the
  // stall as their error: a failure like any other (restart or exit). 0: never.
  std::chrono::milliseconds stall_timeout{0};
  int console_stdout_fd = 1;
  int console_stderr_fd = 2;
  // launch --dedup_output: > 0 merges a console line that several of this group's ranks print
  // alike within this time into one "[ranks 0-3]: " line (line_merge.h); each stream apart.
  // Log files get every rank's lines as printed.
  std::chrono::milliseconds dedup_window{0};
  size_t stderr_tail_lines = 20;
  // In-place recovery (launch --recover in_place). When set and a worker the agent did not
  // signal ends by a signal (it died: SIGKILL, SIGSEGV, the OOM killer), the group asks it with
  // that worker's exit and a ReplaceDecision, and keeps the dead rank's slot pending (the group
  // does not end) until the decision is called, on the io_context, now or later: the agent of a
  // multi-node job asks the rendezvous server first. decide(generation > 0): a replacement for
  // that rank alone starts at once (same RANK and LOCAL_RANK, LAUNCH_RECOVER_GENERATION =
  // generation, its log files rank_<r>.g<generation>.*) while its siblings go on; the dead
  // worker is listed in GroupResult::replaced, not in failures. decide(0) (a refusal), a group
  // stopping meanwhile, unset, or a worker that exited with a code of its own (it gave up, e.g.
  // a survivor that could not recover): the failure stops the group as always. REQUIRES: the
  // decision is called exactly once; a call after the group was destroyed does nothing.
  //
  // Warm spares (launch --spares N, with replace_in_place): N more processes of the program start
  // with the group, LAUNCH_SPARE=1 and a pipe on stdin, and wait (LibTorch loaded, data built)
  // without a rank. A granted replacement is handed to the oldest spare (its rank's environment
  // down the pipe; its output then carries the rank's prefix and goes to the rank's files) and
  // another spare starts; without one it is a cold start as above. A spare that ends before it
  // is needed is logged, never a failure; once only spares are left they are let go (stdin
  // closed, SIGTERM) and the group ends when they have. Only for programs that implement the
  // protocol (the built-in trainer, trainer_runtime/util/env.h AwaitSpareAssignment).
  int spares = 0;
  using ReplaceDecision = std::function<void(int generation)>;
  std::function<void(const WorkerExit&, ReplaceDecision)> replace_in_place;
  // LAUNCH_RECOVER_GENERATION of every worker this group starts (0: none): a node that takes a
  // lost node's place in a running round (the rendezvous assigned it that generation), whose
  // workers join the survivors' recovery instead of starting a run.
  int recover_generation = 0;
  // With recover_generation: when the rendezvous noticed the loss of the node whose place this
  // one takes (its workers' LAUNCH_RECOVER_LOST_AT_MS, so that recovery times count from the
  // first notice in the job: for a host that went silent, the rendezvous' heartbeat deadline).
  std::optional<std::chrono::system_clock::time_point> recover_lost_at;
  std::string recover_lost_by;  // who noticed it: "the rendezvous (node 1 lost)"
};

struct WorkerExit {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  ExitStatus status;
  std::chrono::system_clock::time_point time;     // when it ended
  std::chrono::system_clock::time_point started;  // when it was spawned
  bool stopped_by_agent = false;                  // it ended after the agent had signalled it
  std::vector<std::string> stderr_tail;
  // From its TORCHELASTIC_ERROR_FILE when it failed and wrote one (see error_file.h).
  std::string error_file;
  std::string error_message;    // "ValueError: boom"; empty = no error file
  std::string error_traceback;  // the Python traceback, may be empty
};

struct GroupResult {
  enum class Outcome {
    kSucceeded,  // every worker exited 0
    kFailed,     // a worker failed on its own; failures[0] is the root cause
    kStopped,    // Stop() was called before anything failed
  };
  Outcome outcome = Outcome::kSucceeded;
  std::vector<WorkerExit>
      failures;                   // non-zero exits in the order they were reaped, root cause first
  std::vector<WorkerExit> exits;  // every worker, in the order they were reaped
  // Workers that died and were replaced in place (WorkerGroupSpec::replace_in_place).
  std::vector<WorkerExit> replaced;
};

// What the agent loop needs from a group of workers: the seam that lets restart and signal
// logic be tested with a fake (agent_test.cc) instead of real processes.
class GroupSupervisor {
 public:
  virtual ~GroupSupervisor() = default;
  // Starts every worker; `on_done` runs once, on the io_context, when all have ended.
  // On error nothing is left running and `on_done` is never called.
  virtual Status Start(const WorkerGroupSpec& spec,
                       std::function<void(const GroupResult&)> on_done) = 0;
  // Forwards `signo` to every live worker (e.g. SIGUSR1 before preemption).
  virtual void Signal(int signo) = 0;
  // Sends `signo` to every live worker, then SIGKILL after stop_grace. The outcome is kStopped
  // unless a worker had already failed on its own.
  virtual void Stop(int signo) = 0;
  // SIGKILL to every live worker now (a second Ctrl-C).
  virtual void Kill() = 0;
  // `fn` runs once, on the io_context, as soon as the first worker that failed on its own has
  // exited and its output is drained and written (at most 1 s after it exited), with its exit
  // and stderr tail: before its siblings are stopped, so the failure can be reported while they
  // still run. Call before Start. The default implementation never calls it.
  virtual void OnFirstFailure(std::function<void(const WorkerExit&)> fn) {}
  // Prints the collective report of the running workers (stall_watch.h: each rank's current
  // collective, its last completed one, its stack) to the console; the workers go on. The
  // default implementation prints nothing.
  virtual void ReportCollectives() {}
};

class WorkerGroup : public GroupSupervisor {
 public:
  explicit WorkerGroup(boost::asio::io_context& io);
  ~WorkerGroup() override;
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  Status Start(const WorkerGroupSpec& spec,
               std::function<void(const GroupResult&)> on_done) override;
  void Signal(int signo) override;
  void Stop(int signo = 15 /* SIGTERM */) override;
  void Kill() override;
  void OnFirstFailure(std::function<void(const WorkerExit&)> fn) override;
  void ReportCollectives() override;

  bool running() const;
  std::vector<pid_t> pids() const;  // live workers

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
};

// What every worker of `spec` starts from before its own variables: base_env ("KEY=VALUE";
// entries without '=' skipped) overlaid by extra_env.
std::map<std::string, std::string> BaseEnvironment(const WorkerGroupSpec& spec);

// The torchrun environment contract for one worker, as KEY -> VALUE (RANK, LOCAL_RANK, ...).
std::map<std::string, std::string> ContractEnvironment(const WorkerGroupSpec& spec, int local_rank);

}  // namespace launch::agent
