#include "agent/worker_group.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <system_error>

#include "agent/cgroup.h"
#include "agent/error_file.h"
#include "agent/exec_shim.h"
#include "agent/line_buffer.h"
#include "agent/line_merge.h"
#include "agent/output_writer.h"
#include "agent/stall_watch.h"
#include "agent/subprocess.h"
#include "base/collective_ring.h"
#include "base/log.h"
#include "base/strings.h"

namespace launch::agent {

namespace asio = boost::asio;

namespace {

// Bytes a stream may still read after its worker exited while its output is Full: what the
// worker left in the pipe (a pipe holds at most /proc/sys/fs/pipe-max-size, 1 MiB by default),
// so that its last lines (the traceback for the failure report) come out now. Beyond that it is
// a process that escaped the worker's group still writing, and back-pressure applies again.
constexpr size_t kReadAfterExit = size_t{1} << 20;

int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

std::map<std::string, std::string> BaseEnvironment(const WorkerGroupSpec& s) {
  std::map<std::string, std::string> env;
  for (const std::string& kv : s.base_env) {
    const size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& [k, v] : s.extra_env) env[k] = v;
  return env;
}

std::map<std::string, std::string> ContractEnvironment(const WorkerGroupSpec& s, int local_rank) {
  std::map<std::string, std::string> env;
  int rank = s.rank_offset + local_rank;
  env["RANK"] = std::to_string(rank);
  env["LOCAL_RANK"] = std::to_string(local_rank);
  env["WORLD_SIZE"] = std::to_string(s.world_size);
  env["LOCAL_WORLD_SIZE"] = std::to_string(s.local_world_size);
  env["GROUP_RANK"] = std::to_string(s.group_rank);
  env["GROUP_WORLD_SIZE"] = std::to_string(s.group_world_size);
  if (s.node_view.local_rank >= 0) {
    env["LOCAL_RANK"] = std::to_string(s.node_view.local_rank + local_rank);
    env["LOCAL_WORLD_SIZE"] = std::to_string(s.node_view.local_world_size);
    env["GROUP_RANK"] = std::to_string(s.node_view.node_rank);
    env["GROUP_WORLD_SIZE"] = std::to_string(s.node_view.num_nodes);
  }
  if (s.virtual_local_rank) env["LOCAL_RANK"] = "0";
  env["ROLE_RANK"] = std::to_string(rank);
  env["ROLE_NAME"] = s.role;
  env["ROLE_WORLD_SIZE"] = std::to_string(s.world_size);
  env["MASTER_ADDR"] = s.master_addr;
  env["MASTER_PORT"] = std::to_string(s.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(s.restart_count);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(s.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = s.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";  // workers create their own TCPStore
  return env;
}

class WorkerGroup::Impl : public std::enable_shared_from_this<WorkerGroup::Impl> {
 public:
  explicit Impl(asio::io_context& io)
      : io_(io), kill_timer_(io), first_failure_timer_(io), output_timer_(io) {}

  // One worker pipe. Its bytes go to the console (as prefixed whole lines) and/or a log file,
  // both through OutputWriters; the pipe is not read while either holds a full queue.
  struct Stream {
    explicit Stream(asio::io_context& io) : pipe(io) {}
    asio::posix::stream_descriptor pipe;
    std::array<char, 65536> buf;
    LineBuffer lines;
    std::optional<ConsoleSink> console;  // nullopt: not shown
    OutputWriter::Sink file = -1;        // in files_; -1: no log file
    uint64_t console_end = 0;            // sink positions after this stream's last bytes
    uint64_t file_end = 0;
    size_t read_after_exit = 0;
    bool open = false;
    bool reading = false;  // an async_read_some is in flight
  };

  struct Worker {
    Worker(asio::io_context& io) : out(io), err(io), pidfd(io) {}
    int local_rank = 0;
    int rank = 0;
    pid_t pid = -1;           // its exec shim's (the process this agent spawned and reaps)
    uint64_t spawned_ns = 0;  // MonotonicNanos() just before the spawn
    int generation = 0;       // LAUNCH_RECOVER_GENERATION (0: a first worker)
    bool spare = false;       // a warm spare waiting for a rank (StartSpare)
    int spare_index = -1;     // its number, for messages ("[spare 0]")
    int stdin_w = -1;         // a spare's: the write end of its stdin, for its assignment
    bool reaped = false;
    std::string prefix;
    Stream out, err;
    TailLines tail;
    asio::posix::stream_descriptor pidfd;
    WorkerExit exit;
  };

  ~Impl() { RemoveErrorDir(); }

  Status Start(const WorkerGroupSpec& spec, std::function<void(const GroupResult&)> on_done) {
    LAUNCH_CHECK(workers_.empty(), "WorkerGroup::Start called twice");
    spec_ = spec;
    on_done_ = std::move(on_done);
    LAUNCH_RETURN_IF_ERROR(StartOutput());
    // An inherited SIGCHLD=SIG_IGN would make the kernel reap workers and lose their status.
    std::signal(SIGCHLD, SIG_DFL);
    if (spec.error_files) MakeErrorDir();
    if (spec.job_cgroup != nullptr && !spec.exec_shim.empty()) {
      std::string why_not;  // `launch env` says it; the shims' subreapers alone, then
      if (spec.job_cgroup->Create(spec.exec_shim, &why_not)) cgroup_ = spec.job_cgroup->path();
    }
    StartStallWatch();
    for (int lr = 0; lr < spec.local_world_size; ++lr) {
      Status s =
          StartOne(lr, spec_.recover_generation, spec_.recover_lost_at, spec_.recover_lost_by);
      if (!s.ok()) {
        KillAndReapAll();
        return s;
      }
    }
    for (int i = 0; i < spec.spares; ++i) {
      Status s = StartSpare();
      if (!s.ok()) {
        KillAndReapAll();
        return s;
      }
    }
    watch_->Start();
    return Status::Ok();
  }

  void StartStallWatch() {
    StallWatchOptions options;
    options.stall_timeout = spec_.stall_timeout;
    options.ring_prefix = StallWatch::DefaultRingPrefix(spec_.run_id);
    for (int lr = 0; lr < spec_.local_world_size; ++lr)
      options.ranks.push_back(spec_.rank_offset + lr);
    std::weak_ptr<Impl> weak = weak_from_this();
    // A replacement is named in reports while its predecessor's ring is all there is.
    options.replacement = [weak](int rank) -> std::optional<Replacement> {
      std::optional<Replacement> live;
      if (auto self = weak.lock())
        for (const auto& w : self->workers_)  // the dead stay listed: the newest live one
          if (w->rank == rank && w->generation > 0 && !w->reaped)
            live = Replacement{w->pid, w->generation};
      return live;
    };
    watch_ = std::make_shared<StallWatch>(
        io_, std::move(options), [weak](const std::string& report, const std::vector<int>& blamed) {
          if (auto self = weak.lock()) self->OnStall(report, blamed);
        });
  }

  // Launch's own report, through the console's writer (never a blocking write on the loop),
  // in order with the workers' lines.
  static void PrintReport(std::string text) {
    if (std::optional<ConsoleSink> console = ConsoleWriterFor(STDERR_FILENO)) {
      console->writer->Write(console->sink, std::move(text));
    } else {
      std::fwrite(text.data(), 1, text.size(), stderr);
    }
  }

  // The stall as a failure: the blamed workers die with it as their error, the first reaped is
  // the root cause, and the usual path (siblings stopped, restart or exit) follows.
  void OnStall(const std::string& report, const std::vector<int>& blamed) {
    if (stopping_ || failed_ || live_ == 0) return;  // already ending: the report is moot
    PrintReport(report);
    const std::string why = "stalled: no collective completed for " +
                            FormatSeconds(spec_.stall_timeout) +
                            " (--stall_timeout); see the stalled-collective report above";
    for (auto& w : workers_) {
      if (w->reaped || std::find(blamed.begin(), blamed.end(), w->rank) == blamed.end()) continue;
      w->exit.error_message = why;
      SignalGroup(w->pid, KillSignal());
    }
  }

  void ReportCollectives() {
    if (!watch_ || live_ == 0) return;
    watch_->Report([](const std::string& report) { PrintReport(report); });
  }

  Status StartOutput() {
    bool any_file = false;
    for (int lr = 0; lr < spec_.local_world_size; ++lr)
      any_file |= lr < static_cast<int>(spec_.file_streams.size()) && spec_.file_streams[lr] != 0;
    try {
      RouteLogThroughConsole();
      console_out_ = ConsoleWriterFor(spec_.console_stdout_fd);
      console_err_ = ConsoleWriterFor(spec_.console_stderr_fd);
      // Its own writer: a log directory on a stalled file system must not hold up the console.
      if (any_file && !spec_.log_dir.empty()) files_ = std::make_unique<OutputWriter>();
    } catch (const std::system_error& e) {
      return Status::IoError(std::string("cannot start an output thread: ") + e.what());
    }
    // The writers call this on their threads; it only hands the news to the io_context, and at
    // most once per WaitForOutput().
    std::weak_ptr<Impl> weak = weak_from_this();
    auto wake = [weak, pending = wake_, &io = io_] {
      if (!pending->exchange(false)) return;
      asio::post(io, [weak] {
        if (auto self = weak.lock()) self->OnOutputProgress();
      });
    };
    std::vector<OutputWriter*> writers;
    if (console_out_) writers.push_back(console_out_->writer);
    if (console_err_ && (!console_out_ || console_err_->writer != console_out_->writer))
      writers.push_back(console_err_->writer);
    if (files_) writers.push_back(files_.get());
    for (OutputWriter* w : writers) waiters_.emplace_back(w, w->AddWaiter(wake));
    if (spec_.dedup_window.count() > 0 && spec_.local_world_size > 1) {
      merge_ = std::make_unique<MergeState>(io_);
      std::vector<int> out_ranks, err_ranks;
      for (int lr = 0; lr < spec_.local_world_size; ++lr) {
        if (ConsoleMask(lr) & kStdout) out_ranks.push_back(spec_.rank_offset + lr);
        if (ConsoleMask(lr) & kStderr) err_ranks.push_back(spec_.rank_offset + lr);
      }
      // One merger per console writer's queue order: a stdout and stderr that are one file
      // still get a merger each (their lines never join), released in the same pass.
      merge_->out = std::make_unique<LineMerger>(out_ranks, spec_.dedup_window);
      merge_->err = std::make_unique<LineMerger>(err_ranks, spec_.dedup_window);
    }
    return Status::Ok();
  }

  // Makes the next writer progress (a sink back at low water, a write done) call
  // OnOutputProgress. Set before the last look at the writers' state, so that no progress in
  // between is missed.
  void WaitForOutput() { wake_->store(true); }

  // Everything waiting on the writers looks again: paused pipes, the first failure's report,
  // the end of the group.
  void OnOutputProgress() {
    for (auto& w : workers_) {
      ReadMore(w.get(), &w->out);
      ReadMore(w.get(), &w->err);
    }
    MaybeFireFirstFailure();
    MaybeFinish();
  }

  bool Written(const Stream& s) const {
    return (!s.console || s.console->writer->Done(s.console->sink) >= s.console_end) &&
           (s.file < 0 || files_->Done(s.file) >= s.file_end);
  }
  bool Written(const Worker& w) const { return Written(w.out) && Written(w.err); }
  bool AllWritten() const {
    for (auto& w : workers_)
      if (!Written(*w)) return false;
    return true;
  }
  // `written()`, or false after arranging for OnOutputProgress to run when it may have changed.
  template <typename Pred>
  bool WrittenOrWait(Pred written) {
    if (written()) return true;
    WaitForOutput();
    return written();
  }

  // What every process of the group gets, whatever its rank: the base environment, the job's
  // cgroup for the shim, the console's kind, USE_LIBUV.
  std::map<std::string, std::string> CommonEnvironment(int console_mask) {
    std::map<std::string, std::string> env_map = BaseEnvironment(spec_);
    if (!cgroup_.empty()) env_map[kJobCgroupEnv] = cgroup_;  // for the shim, not the worker
    // Through the agent's pipe a worker cannot see that the console is a terminal; `train`
    // draws its progress bar when this says so (the agent passes each redraw on at once).
    if ((console_mask & kStdout) && console_out_ && log::AnsiTerminal(spec_.console_stdout_fd))
      env_map["LAUNCH_CONSOLE_TTY"] = "1";
    else
      env_map.erase("LAUNCH_CONSOLE_TTY");  // a nested launch's console is not the outer one's
    // PyTorch 2.x's TCPStore (init_process_group's env://) asks for its libuv server unless
    // USE_LIBUV=0, and fails at once where PyTorch was built without libuv (Debian 13's 2.6:
    // torchrun fails there with "use_libuv was requested but PyTorch was build without libuv
    // support"). The store of a job's workers is small; its classic server is what 1.13 used and
    // what `train` uses. The user's own setting wins.
    env_map.emplace("USE_LIBUV", "0");
    return env_map;
  }

  // What makes a process rank `w->rank` (set before): torchrun's variables, its device, its
  // collective ring and error file, and for a replacement its generation. `generation`: its
  // LAUNCH_RECOVER_GENERATION (0: none); `lost_at`: when the worker it replaces was seen dead
  // (LAUNCH_RECOVER_LOST_AT_MS), for recovery times measured from it, and `lost_by` who saw it
  // (LAUNCH_RECOVER_LOST_BY; empty: this rank's agent).
  std::map<std::string, std::string> RankEnvironment(
      Worker* w, int generation, std::optional<std::chrono::system_clock::time_point> lost_at,
      const std::string& lost_by, const std::map<std::string, std::string>& common) {
    std::map<std::string, std::string> env_map = ContractEnvironment(spec_, w->local_rank);
    if (spec_.virtual_local_rank && spec_.gpu_workers) {
      // The device LOCAL_RANK would have picked, as the only one the worker sees.
      auto visible = common.find("CUDA_VISIBLE_DEVICES");
      std::vector<std::string> ids;
      if (visible != common.end()) ids = Split(visible->second, ',');
      const int device = spec_.node_view.local_rank >= 0
                             ? spec_.node_view.local_rank + w->local_rank
                             : w->local_rank;
      env_map["CUDA_VISIBLE_DEVICES"] =
          device < static_cast<int>(ids.size()) ? Trim(ids[device]) : std::to_string(device);
    }
    env_map[kCollectiveRingEnv] = watch_->RingPath(w->rank);
    if (generation > 0) env_map["LAUNCH_RECOVER_GENERATION"] = std::to_string(generation);
    if (lost_at)
      env_map["LAUNCH_RECOVER_LOST_AT_MS"] = std::to_string(
          std::chrono::duration_cast<std::chrono::milliseconds>(lost_at->time_since_epoch())
              .count());
    if (lost_at && !lost_by.empty()) env_map["LAUNCH_RECOVER_LOST_BY"] = lost_by;
    if (!error_dir_.empty()) {
      w->exit.error_file = error_dir_ + "/rank_" + std::to_string(w->rank) + ".error.json";
      ::unlink(w->exit.error_file.c_str());  // a previous attempt's must not be read as this one's
      env_map["TORCHELASTIC_ERROR_FILE"] = w->exit.error_file;
    }
    return env_map;
  }

  int ConsoleMask(int local_rank) const {
    return local_rank >= 0 && local_rank < static_cast<int>(spec_.console_streams.size())
               ? spec_.console_streams[local_rank]
               : (kStdout | kStderr);
  }

  Status StartOne(int local_rank, int generation,
                  std::optional<std::chrono::system_clock::time_point> lost_at = std::nullopt,
                  const std::string& lost_by = "") {
    auto w = std::make_unique<Worker>(io_);
    w->local_rank = local_rank;
    w->rank = spec_.rank_offset + local_rank;
    w->generation = generation;
    w->prefix = "[rank " + std::to_string(w->rank) + "]: ";
    w->tail = TailLines(spec_.stderr_tail_lines);
    std::map<std::string, std::string> env_map = CommonEnvironment(ConsoleMask(local_rank));
    for (auto& [k, v] : RankEnvironment(w.get(), generation, lost_at, lost_by, env_map))
      env_map[k] = v;
    Worker* raw = w.get();
    LAUNCH_RETURN_IF_ERROR(SpawnWorker(std::move(w), env_map, ConsoleMask(local_rank)));
    OpenLogFiles(raw);
    return Status::Ok();
  }

  // A warm spare (WorkerGroupSpec::spares): the program with the group's environment but no
  // rank of its own yet (LAUNCH_SPARE=1), and a pipe on its stdin through which AssignSpare
  // hands it a dead rank's environment.
  Status StartSpare() {
    auto w = std::make_unique<Worker>(io_);
    w->spare = true;
    w->spare_index = next_spare_index_++;
    w->local_rank = -1;
    w->rank = -1;
    w->prefix = "[spare " + std::to_string(w->spare_index) + "]: ";
    w->tail = TailLines(spec_.stderr_tail_lines);
    std::map<std::string, std::string> env_map = CommonEnvironment(ConsoleMask(-1));
    // Rank 0's variables stand in for what the job shares (world size, master) until it has
    // one; the assignment replaces every rank-dependent one.
    for (const auto& [k, v] : ContractEnvironment(spec_, 0)) env_map[k] = v;
    env_map["LAUNCH_SPARE"] = "1";
    int in_pipe[2];
    LAUNCH_RETURN_IF_ERROR(MakePipe(in_pipe));
    w->stdin_w = in_pipe[1];
    Worker* raw = w.get();
    Status s = SpawnWorker(std::move(w), env_map, ConsoleMask(-1), in_pipe[0]);
    ::close(in_pipe[0]);
    if (!s.ok()) {
      ::close(in_pipe[1]);
      return s;
    }
    spares_.push_back(raw);
    return Status::Ok();
  }

  // The waiting spare `w` becomes rank `spec_.rank_offset + local_rank`, a replacement of
  // `generation`: its environment goes down its stdin ("KEY=VALUE" lines, an empty line), which
  // is then closed. IoError when the spare is gone (the caller starts a cold replacement).
  Status AssignSpare(Worker* w, int local_rank, int generation,
                     std::optional<std::chrono::system_clock::time_point> lost_at) {
    spares_.erase(std::find(spares_.begin(), spares_.end(), w));
    const int index = w->spare_index;
    w->local_rank = local_rank;
    w->rank = spec_.rank_offset + local_rank;
    w->generation = generation;
    const std::map<std::string, std::string> common = CommonEnvironment(ConsoleMask(local_rank));
    std::string text;
    for (const auto& [k, v] : RankEnvironment(w, generation, lost_at, "", common))
      text += k + "=" + v + "\n";
    text += "\n";
    // Well below a pipe's capacity (64 KiB): the write does not block.
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(w->stdin_w, text.data() + done, text.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int e = errno;
        ::close(w->stdin_w);
        w->stdin_w = -1;
        w->spare = true;  // still a spare as far as its exit goes
        return Status::FromErrno("spare " + std::to_string(index) + " took no rank", e);
      }
      done += static_cast<size_t>(n);
    }
    ::close(w->stdin_w);
    w->stdin_w = -1;
    w->spare = false;
    w->prefix = "[rank " + std::to_string(w->rank) + "]: ";
    MergerOpened(*w);  // its lines are the rank's from here on
    OpenLogFiles(w);
    return Status::Ok();
  }

  // Spawns `w` with `env_map` (and `stdin_fd` as its stdin, -1: /dev/null), its output pipes
  // read from now on, its exit awaited.
  Status SpawnWorker(std::unique_ptr<Worker> w, const std::map<std::string, std::string>& env_map,
                     int console_mask, int stdin_fd = -1) {
    SpawnRequest req;
    req.argv = spec_.argv;
    req.exec_shim = spec_.exec_shim;
    for (const auto& [k, v] : env_map) req.env.push_back(k + "=" + v);
    req.stdin_fd = stdin_fd;

    int out_pipe[2], err_pipe[2];
    LAUNCH_RETURN_IF_ERROR(MakePipe(out_pipe));
    Status s = MakePipe(err_pipe);
    if (!s.ok()) {
      ::close(out_pipe[0]);
      ::close(out_pipe[1]);
      return s;
    }
    req.stdout_fd = out_pipe[1];
    req.stderr_fd = err_pipe[1];
    const uint64_t spawned_ns = MonotonicNanos();
    StatusOr<SpawnedProcess> proc = Spawn(req);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    if (!proc.ok()) {
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
      return proc.status();
    }
    w->pid = proc->pid;
    w->spawned_ns = spawned_ns;
    w->exit.started = std::chrono::system_clock::now();
    w->out.pipe.assign(out_pipe[0]);
    w->err.pipe.assign(err_pipe[0]);
    w->out.open = w->err.open = true;
    if (console_mask & kStdout) w->out.console = console_out_;
    if (console_mask & kStderr) w->err.console = console_err_;
    MergerOpened(*w);  // a replacement prints in its rank's place
    int pidfd = PidfdOpen(w->pid);
    if (pidfd < 0) {
      int e = errno;
      ::kill(w->pid, SIGKILL);
      int st;
      while (::waitpid(w->pid, &st, 0) < 0 && errno == EINTR) {
      }
      return Status::FromErrno("pidfd_open (Linux >= 5.3 is required)", e);
    }
    w->pidfd.assign(pidfd);
    Worker* raw = w.get();
    workers_.push_back(std::move(w));
    ++live_;
    ReadMore(raw, &raw->out);
    ReadMore(raw, &raw->err);
    WaitExit(raw);
    return Status::Ok();
  }

  // Rank `w->rank`'s log files: a replacement's own, the dead worker's stay as it left them.
  void OpenLogFiles(Worker* w) {
    if (!files_) return;
    const int file_mask = w->local_rank < static_cast<int>(spec_.file_streams.size())
                              ? spec_.file_streams[w->local_rank]
                              : 0;
    std::string base = spec_.log_dir + "/rank_" + std::to_string(w->rank) +
                       (w->generation > 0 ? ".g" + std::to_string(w->generation) : "");
    int fd;
    if ((file_mask & kStdout) && (fd = OpenLog(base + ".stdout")) >= 0)
      w->out.file = files_->AddSink(fd, /*owns_fd=*/true);
    if ((file_mask & kStderr) && (fd = OpenLog(base + ".stderr")) >= 0)
      w->err.file = files_->AddSink(fd, /*owns_fd=*/true);
  }

  int OpenLog(const std::string& path) {
    // O_NOFOLLOW: a symlink planted in a shared log_dir must not make us truncate its target.
    // O_NONBLOCK: opening a FIFO nobody reads would otherwise block the loop (it fails with
    // ENXIO instead); for files it changes nothing, and the writer waits out EAGAIN on a FIFO.
    int fd =
        ::open(path.c_str(),
               O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0)
      log::Warn("cannot write the log file " + path + ": " + std::strerror(errno) +
                (errno == ELOOP ? " (it is a symbolic link; not followed)" : ""));
    return fd;
  }

  // Reads the pipe again unless a destination of its bytes is full: then the pipe waits (and the
  // worker with it) until OnOutputProgress. After the worker exited, what it left in the pipe
  // is read regardless (kReadAfterExit).
  void ReadMore(Worker* w, Stream* s) {
    if (!s->open || s->reading) return;
    if (!WrittenOrWait([&] { return !MustPause(*w, *s); })) return;
    s->reading = true;
    auto self = shared_from_this();
    s->pipe.async_read_some(
        asio::buffer(s->buf), [this, self, w, s](boost::system::error_code ec, size_t n) {
          s->reading = false;
          if (!s->open) return;  // closed meanwhile (the drain limit, KillAndReapAll)
          if (n > 0) Consume(w, s, std::string_view(s->buf.data(), n));
          if (ec) {  // EOF or error: the worker (and anything it forked) closed the pipe
            CloseStream(w, s);
            MaybeFinish();
            return;
          }
          ReadMore(w, s);
        });
  }

  bool MustPause(const Worker& w, const Stream& s) const {
    bool full = (s.console && s.console->writer->Full(s.console->sink)) ||
                (s.file >= 0 && files_->Full(s.file));
    return full && !(w.reaped && s.read_after_exit < kReadAfterExit);
  }

  void Consume(Worker* w, Stream* s, std::string_view data) {
    if (w->reaped) s->read_after_exit += data.size();
    if (s->file >= 0) s->file_end = files_->Write(s->file, std::string(data));
    if (s == &w->err) w->tail.Feed(data);
    if (s->console) {
      std::string out;
      s->lines.Feed(data, MergerFor(*w, *s) ? "" : w->prefix, &out);
      ToConsole(*w, s, std::move(out), /*closing=*/false);
    }
  }

  // Whole lines of `s` (LineBuffer's: prefixed, or bare for its merger) to the console.
  void ToConsole(const Worker& w, Stream* s, std::string lines, bool closing) {
    if (LineMerger* merger = MergerFor(w, *s)) {
      merger->AddLines(w.rank, lines, LineMerger::Clock::now());
      // A closed stream's lines still held wait for the other ranks' copies no longer than
      // those ranks run; MaybeFinish and MaybeFireFirstFailure release what is held before
      // they report.
      if (closing) merger->Closed(w.rank);
      ReleaseMerged(/*all=*/false);
    } else if (!lines.empty()) {
      s->console_end = s->console->writer->Write(s->console->sink, std::move(lines));
    }
  }

  // --dedup_output: `w` prints for its rank (again), unless it is a spare.
  void MergerOpened(const Worker& w) {
    if (!merge_ || w.spare) return;
    merge_->out->Opened(w.rank);
    merge_->err->Opened(w.rank);
  }

  // --dedup_output: the merger of a rank's stream, or null (off, a spare, one rank).
  LineMerger* MergerFor(const Worker& w, const Stream& s) const {
    if (!merge_ || w.spare) return nullptr;
    return &s == &w.out ? merge_->out.get() : merge_->err.get();
  }

  // Writes the merged lines that are due (`all`: every held one) to the console, and sets the
  // timer for the next. Every stream of a merger counts as written once what it released is.
  void ReleaseMerged(bool all) {
    if (!merge_) return;
    const auto now = LineMerger::Clock::now();
    std::optional<LineMerger::Clock::time_point> next;
    for (auto [merger, console] :
         {std::pair(merge_->out.get(), console_out_), std::pair(merge_->err.get(), console_err_)}) {
      if (!merger || !console) continue;
      std::string out;
      std::optional<LineMerger::Clock::time_point> due;
      if (all) {
        merger->ReleaseAll(&out);
      } else {
        due = merger->Release(now, &out);
      }
      if (due && (!next || *due < next)) next = due;
      if (out.empty()) continue;
      const uint64_t end = console->writer->Write(console->sink, std::move(out));
      for (auto& w : workers_)
        for (Stream* s : {&w->out, &w->err})
          if (MergerFor(*w, *s) == merger) s->console_end = end;
    }
    if (!next || (merge_->armed && *merge_->armed <= *next)) return;
    merge_->armed = next;
    merge_->timer.expires_at(*next);
    auto self = shared_from_this();
    merge_->timer.async_wait([this, self](boost::system::error_code ec) {
      if (ec || !merge_) return;
      merge_->armed.reset();
      ReleaseMerged(/*all=*/false);
    });
  }

  void CloseStream(Worker* w, Stream* s) {
    if (!s->open) return;
    if (s->console) {
      std::string out;
      s->lines.Flush(MergerFor(*w, *s) ? "" : w->prefix, &out);
      ToConsole(*w, s, std::move(out), /*closing=*/true);
    }
    if (s->file >= 0) files_->CloseSink(s->file);  // closed once written; `file` stays for Done()
    boost::system::error_code ignored;
    s->pipe.close(ignored);
    s->open = false;
    if (w == first_failed_) MaybeFireFirstFailure();
  }

  void SetFirstFailure(std::function<void(const WorkerExit&)> fn) {
    on_first_failure_ = std::move(fn);
  }

  // Once its pipes are drained and what they held is written: the report comes after the
  // worker's last lines (or after 1 s, see Reap).
  void MaybeFireFirstFailure() {
    if (!first_failed_ || first_failure_fired_ || first_failed_->out.open ||
        first_failed_->err.open)
      return;
    ReleaseMerged(/*all=*/true);  // the failed worker's last lines come before its report
    if (WrittenOrWait([this] { return Written(*first_failed_); })) FireFirstFailure();
  }

  void FireFirstFailure() {
    if (!first_failed_ || first_failure_fired_ || result_.failures.empty()) return;
    first_failure_fired_ = true;
    first_failure_timer_.cancel();
    WorkerExit e = result_.failures.front();
    const auto lines = first_failed_->tail.Lines();
    e.stderr_tail.assign(lines.begin(), lines.end());
    auto cb = on_first_failure_;
    if (cb) cb(e);
  }

  void WaitExit(Worker* w) {
    auto self = shared_from_this();
    w->pidfd.async_wait(asio::posix::stream_descriptor::wait_read,
                        [this, self, w](boost::system::error_code ec) {
                          if (ec == asio::error::operation_aborted) return;
                          Reap(w);
                        });
  }

  void Reap(Worker* w) {
    if (w->reaped) return;
    int st = 0;
    pid_t r;
    do {
      r = ::waitpid(w->pid, &st, 0);
    } while (r < 0 && errno == EINTR);
    // Without its status (reaped by someone else: cannot happen with SIGCHLD at its default,
    // which Start() ensures) a worker never counts as a success.
    if (r != w->pid) st = W_EXITCODE(255, 0);
    w->reaped = true;
    --live_;
    boost::system::error_code ignored;
    w->pidfd.close(ignored);
    // Anything the worker left behind in its process group goes with it; this also lets its
    // pipes reach EOF promptly.
    SignalGroup(w->pid, SIGKILL);
    KillWorkerCgroup(w);
    ReadMore(w, &w->out);  // paused pipes: what the worker left in them is read now
    ReadMore(w, &w->err);
    if (w->spare) {
      // Never a failure: the job goes on without it (a dead rank then gets a cold replacement).
      if (w->stdin_w >= 0) ::close(w->stdin_w);
      w->stdin_w = -1;
      auto it = std::find(spares_.begin(), spares_.end(), w);
      if (it != spares_.end()) spares_.erase(it);
      if (!stopping_)
        log::Warn("spare " + std::to_string(w->spare_index) + " (pid " + std::to_string(w->pid) +
                  ") " + ExitStatus::FromWaitStatus(st).ToString() + " before it was needed; " +
                  std::to_string(spares_.size()) + " spare(s) left");
      AfterExit();
      return;
    }
    WorkerExit& e = w->exit;
    e.local_rank = w->local_rank;
    e.rank = w->rank;
    // Reports name the worker's own pid (as the stall report does, from its ring), not its exec
    // shim's; the shim's for a worker that made no ring (a program without collectives).
    const std::optional<RingSnapshot> ring = OwnRing(*w);
    e.pid = ring ? ring->pid : w->pid;
    e.status = ExitStatus::FromWaitStatus(st);
    e.time = std::chrono::system_clock::now();
    e.stopped_by_agent = stopping_;
    if (!e.status.success() && !e.error_file.empty()) {
      if (std::optional<WorkerError> err = ReadErrorFile(e.error_file)) {
        e.error_message = err->message;
        e.error_traceback = err->traceback;
      }
    }
    result_.exits.push_back(e);
    // Only a worker that said it can be recovered in place (InPlacePathFor: its group formed, its
    // mode keeps no state on one rank alone) is replaced alone, and a replacement (the survivors
    // await it). Otherwise a replacement could not be taken in: a first worker dead before its
    // group formed leaves the others in the group's formation, where no loss reaches them; a
    // mode with state on each rank has nothing to hand over. Every worker restarts at once then,
    // as without --recover in_place, instead of after a replacement that spent a restart.
    const bool died = !e.status.success() && !stopping_ && e.status.signaled;
    const bool replaceable =
        w->generation > 0 ||
        (watch_ && ::access(InPlacePathFor(watch_->RingPath(w->rank)).c_str(), F_OK) == 0);
    if (died && spec_.replace_in_place && !replaceable)
      log::Warn("rank " + std::to_string(w->rank) + " cannot be recovered in place (" +
                (ring ? "its mode keeps state on each rank alone, or it died before Prepare"
                      : "it died before its process group formed") +
                "): every worker restarts");
    if (died && spec_.replace_in_place && replaceable) {
      // The slot stays pending (MaybeFinish waits) until the agent decides; its pipes drain
      // meanwhile (its last lines come out before a replacement's).
      ++pending_decisions_;
      auto self = shared_from_this();
      spec_.replace_in_place(e, [this, self, w](int generation) { Decide(w, generation); });
      return;
    }
    Settle(w);
  }

  // The agent's answer for the dead worker `w` (WorkerGroupSpec::replace_in_place).
  void Decide(Worker* w, int generation) {
    if (finished_ || decided_.count(w)) return;  // destroyed meanwhile, or a second answer
    decided_.insert(w);
    --pending_decisions_;
    if (generation > 0 && !stopping_) {
      // The rank alone is started again; its siblings wait for it in their own recovery. A
      // warm spare takes its place when there is one (and another is started for later).
      result_.replaced.push_back(w->exit);
      while (!spares_.empty()) {
        Worker* spare = spares_.front();
        const int index = spare->spare_index;
        const Status assigned = AssignSpare(spare, w->local_rank, generation, w->exit.time);
        if (!assigned.ok()) {
          log::Warn(assigned.message());
          continue;
        }
        log::Info("rank " + std::to_string(w->rank) + ": spare " + std::to_string(index) +
                  " (started and loaded) takes its place");
        const Status refilled = StartSpare();
        if (!refilled.ok()) log::Warn("cannot start another spare: " + refilled.message());
        return;
      }
      const Status started = StartOne(w->local_rank, generation, w->exit.time);
      if (started.ok()) return;
      log::Error("cannot start a replacement for rank " + std::to_string(w->rank) + ": " +
                 started.message());
    }
    Settle(w);
  }

  // The collective ring `w` wrote, if it wrote one: a worker makes it once its first process
  // group has formed (an earlier worker's of that rank does not count).
  std::optional<RingSnapshot> OwnRing(const Worker& w) const {
    if (!watch_) return std::nullopt;
    StatusOr<RingSnapshot> ring = ReadCollectiveRing(watch_->RingPath(w.rank));
    if (ring.ok() && ring->pid > 0 && ring->created_ns >= w.spawned_ns) return *ring;
    return std::nullopt;
  }

  // A reaped worker that is not replaced: a failure unless it exited 0; the group ends once
  // nothing runs.
  void Settle(Worker* w) {
    const WorkerExit& e = w->exit;
    if (!e.status.success()) {
      bool first = result_.failures.empty() && !stopping_;
      result_.failures.push_back(e);
      if (first) {
        failed_ = true;
        first_failed_ = w;
        // Its output normally drains within milliseconds (its process group was just killed);
        // a pipe held open by an escaped daemon must not delay the report for long.
        first_failure_timer_.expires_after(std::chrono::seconds(1));
        auto self = shared_from_this();
        first_failure_timer_.async_wait([this, self](boost::system::error_code ec) {
          if (!ec) FireFirstFailure();
        });
        MaybeFireFirstFailure();
        StopInternal(SIGTERM);
      }
    }
    AfterExit();
  }

  // A process of the group ended: once only spares are left they are let go (their stdin
  // closes: a spare exits 0 at EOF), and once nothing runs the group ends.
  void AfterExit() {
    if (live_ > 0 && live_ == static_cast<int>(spares_.size()) && pending_decisions_ == 0) {
      for (Worker* spare : spares_) {
        if (spare->stdin_w >= 0) ::close(spare->stdin_w);
        spare->stdin_w = -1;
      }
      StopInternal(SIGTERM);
    }
    if (live_ == 0) {
      // Give pipes held open by escaped grandchildren a bounded time to drain.
      drain_deadline_armed_ = true;
      kill_timer_.cancel();
      kill_timer_.expires_after(std::chrono::seconds(2));
      auto self = shared_from_this();
      kill_timer_.async_wait([this, self](boost::system::error_code ec) {
        if (ec) return;
        for (auto& wk : workers_) {
          CloseStream(wk.get(), &wk->out);
          CloseStream(wk.get(), &wk->err);
        }
        MaybeFinish();
      });
    }
    MaybeFinish();
  }

  // A shim that exited on its own removed its worker's cgroup; one that was SIGKILLed left it,
  // with whatever its worker started: killed here, synchronously (milliseconds), so none of it
  // runs beside the next attempt, whose start waits for this group's end.
  void KillWorkerCgroup(Worker* w) {
    if (cgroup_.empty() || spec_.job_cgroup->KillWorker(w->pid)) return;
    log::Warn("processes of rank " + std::to_string(w->rank) + " survive cgroup.kill of " +
              cgroup_ + "/worker-" + std::to_string(w->pid) + " after " +
              std::to_string(kCgroupEmptyTimeout.count()) + " ms (stuck in the kernel?)");
  }

  void MaybeFinish() {
    if (finished_ || live_ > 0 || pending_decisions_ > 0) return;
    for (auto& w : workers_) {
      if (w->out.open || w->err.open) return;
    }
    ReleaseMerged(/*all=*/true);
    // The workers' last output is written before the outcome is known to anyone (the failure
    // report follows it), within stop_grace: a console that never reads again must not keep
    // launch from going on and exiting.
    if (!output_deadline_passed_ && !WrittenOrWait([this] { return AllWritten(); })) {
      ArmOutputDeadline();
      return;
    }
    finished_ = true;
    kill_timer_.cancel();
    output_timer_.cancel();
    for (auto& w : workers_) {
      for (const auto& line : w->tail.Lines()) {
        for (auto& f : result_.failures)
          if (f.rank == w->rank && f.started == w->exit.started) f.stderr_tail.push_back(line);
      }
    }
    if (failed_) {
      result_.outcome = GroupResult::Outcome::kFailed;
    } else if (stop_requested_) {
      result_.outcome = GroupResult::Outcome::kStopped;
    } else {
      result_.outcome = GroupResult::Outcome::kSucceeded;
    }
    auto cb = std::move(on_done_);
    on_done_ = nullptr;
    if (cb) cb(result_);
  }

  void ArmOutputDeadline() {
    if (output_timer_armed_) return;
    output_timer_armed_ = true;
    output_timer_.expires_after(spec_.stop_grace);
    auto self = shared_from_this();
    output_timer_.async_wait([this, self](boost::system::error_code ec) {
      if (ec) return;
      output_deadline_passed_ = true;
      log::Warn("the workers' last output was not all written within the stop grace (" +
                FormatSeconds(spec_.stop_grace) +
                "): the console or a log file is not reading; going on without it");
      MaybeFinish();
    });
  }

  static std::string FormatSeconds(std::chrono::milliseconds d) {
    std::string s = std::to_string(d.count() / 1000.0);
    return s.substr(0, s.find('.') + 2) + " s";
  }

  void Signal(int signo) {
    for (auto& w : workers_)
      if (!w->reaped) SignalGroup(w->pid, signo);
  }

  void Stop(int signo) {
    stop_requested_ = true;
    StopInternal(signo);
  }

  void StopInternal(int signo) {
    if (watch_) watch_->Cancel();  // stopping workers stall by design
    if (live_ == 0) return;
    stopping_ = true;
    Signal(signo);
    // A stopped worker (SIGSTOP, SIGTSTP: a stalled debug session, a test) would hold the
    // signal pending until the grace ran out and SIGKILL came: continued, it acts on it now.
    if (signo != SIGCONT) Signal(SIGCONT);
    if (kill_armed_) return;
    kill_armed_ = true;
    kill_timer_.expires_after(spec_.stop_grace);
    auto self = shared_from_this();
    kill_timer_.async_wait([this, self](boost::system::error_code ec) {
      if (ec || drain_deadline_armed_) return;
      Signal(KillSignal());
    });
  }

  void Kill() {
    stopping_ = true;
    stop_requested_ = true;
    Signal(KillSignal());
    // Now means now: no waiting for a stalled console either.
    output_deadline_passed_ = true;
    auto self = shared_from_this();
    asio::post(io_, [self] { self->MaybeFinish(); });
  }

  // SIGKILL, or with the shim kKillAll: the shim then kills the worker and everything it
  // started, which a SIGKILL of the shim itself could not (exec_shim.h).
  int KillSignal() const { return spec_.exec_shim.empty() ? SIGKILL : kKillAll; }

  void MakeErrorDir() {
    if (!spec_.log_dir.empty()) {
      error_dir_ = spec_.log_dir;
      return;
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/launch-errors.XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back('\0');
    if (::mkdtemp(buf.data()) == nullptr) {  // 0700; without it workers get no error file
      log::Warn("no TORCHELASTIC_ERROR_FILE for the workers: mkdtemp " + templ + ": " +
                std::strerror(errno));
      return;
    }
    error_dir_ = buf.data();
    own_error_dir_ = true;
  }

  void RemoveErrorDir() {
    if (!own_error_dir_) return;
    for (auto& w : workers_)
      if (!w->exit.error_file.empty()) ::unlink(w->exit.error_file.c_str());
    ::rmdir(error_dir_.c_str());
    own_error_dir_ = false;
  }

  // Synchronous cleanup for error paths and the destructor.
  void KillAndReapAll() {
    for (auto& w : workers_)
      if (!w->reaped) SignalGroup(w->pid, KillSignal());
    for (auto& w : workers_) {
      if (w->reaped) continue;
      int st;
      // The shim's clean-up is quick; a shim that does not finish in 2 s is killed outright.
      pid_t r = 0;
      for (int i = 0; i < 200 && (r = ::waitpid(w->pid, &st, WNOHANG)) == 0; ++i) ::usleep(10000);
      if (r == 0) {
        SignalGroup(w->pid, SIGKILL);
        while (::waitpid(w->pid, &st, 0) < 0 && errno == EINTR) {
        }
      }
      w->reaped = true;
      --live_;
      KillWorkerCgroup(w.get());
    }
    for (auto& w : workers_) {
      if (w->stdin_w >= 0) ::close(w->stdin_w);
      w->stdin_w = -1;
      boost::system::error_code ignored;
      w->pidfd.close(ignored);
      w->out.pipe.close(ignored);
      w->err.pipe.close(ignored);
      w->out.open = w->err.open = false;
    }
    ReleaseMerged(/*all=*/true);  // the lines held for merging, as they are
    merge_.reset();
    // No writer calls us from here on (the io_context may go next); log files close once what
    // is queued for them is dropped.
    for (auto& [writer, id] : waiters_) writer->RemoveWaiter(id);
    waiters_.clear();
    for (auto& w : workers_) w->out.file = w->err.file = -1;
    files_.reset();
    kill_timer_.cancel();
    first_failure_timer_.cancel();
    output_timer_.cancel();
    watch_.reset();  // removes the rings: no file outlives the group
    finished_ = true;
    on_done_ = nullptr;
    on_first_failure_ = nullptr;
  }

  bool running() const { return live_ > 0; }
  std::vector<pid_t> pids() const {
    std::vector<pid_t> out;
    for (auto& w : workers_)
      if (!w->reaped) out.push_back(w->pid);
    return out;
  }

 private:
  asio::io_context& io_;
  asio::steady_timer kill_timer_;
  asio::steady_timer first_failure_timer_;
  asio::steady_timer output_timer_;  // stop_grace for the last output to be written
  bool output_timer_armed_ = false;
  // --dedup_output (spec_.dedup_window): the console lines held for merging; null when off.
  struct MergeState {
    explicit MergeState(asio::io_context& io) : timer(io) {}
    std::unique_ptr<LineMerger> out, err;
    asio::steady_timer timer;                            // fires when the next line is due
    std::optional<LineMerger::Clock::time_point> armed;  // when it fires; nullopt: not armed
  };
  std::unique_ptr<MergeState> merge_;
  bool output_deadline_passed_ = false;
  std::optional<ConsoleSink> console_out_;  // the writers of console_stdout_fd / _stderr_fd
  std::optional<ConsoleSink> console_err_;
  std::unique_ptr<OutputWriter> files_;  // the per-rank log files; null without any
  std::vector<std::pair<OutputWriter*, int>> waiters_;
  // Set while the loop waits on a writer; the writer's waiter clears it and posts.
  std::shared_ptr<std::atomic<bool>> wake_ = std::make_shared<std::atomic<bool>>(false);
  std::function<void(const WorkerExit&)> on_first_failure_;
  Worker* first_failed_ = nullptr;  // the first worker that failed on its own
  bool first_failure_fired_ = false;
  WorkerGroupSpec spec_;
  std::function<void(const GroupResult&)> on_done_;
  std::vector<std::unique_ptr<Worker>> workers_;
  GroupResult result_;
  int live_ = 0;
  std::vector<Worker*> spares_;  // waiting for a rank, oldest first
  int next_spare_index_ = 0;
  bool stopping_ = false;        // the agent has signalled the workers
  bool stop_requested_ = false;  // Stop() from outside
  bool failed_ = false;
  bool kill_armed_ = false;
  bool drain_deadline_armed_ = false;
  bool finished_ = false;
  std::shared_ptr<StallWatch> watch_;  // the workers' collective rings; null before Start
  int pending_decisions_ = 0;          // dead workers whose replacement the agent decides on
  std::set<const Worker*> decided_;    // dead workers the agent has answered for
  std::string cgroup_;                 // the job's cgroup, once made; empty = none
  std::string error_dir_;  // where the workers' TORCHELASTIC_ERROR_FILEs go; empty = none
  bool own_error_dir_ = false;
};

WorkerGroup::WorkerGroup(asio::io_context& io) : impl_(std::make_shared<Impl>(io)) {}
WorkerGroup::~WorkerGroup() { impl_->KillAndReapAll(); }
Status WorkerGroup::Start(const WorkerGroupSpec& spec,
                          std::function<void(const GroupResult&)> on_done) {
  return impl_->Start(spec, std::move(on_done));
}
void WorkerGroup::Signal(int signo) { impl_->Signal(signo); }
void WorkerGroup::Stop(int signo) { impl_->Stop(signo); }
void WorkerGroup::Kill() { impl_->Kill(); }
void WorkerGroup::OnFirstFailure(std::function<void(const WorkerExit&)> fn) {
  impl_->SetFirstFailure(std::move(fn));
}
void WorkerGroup::ReportCollectives() { impl_->ReportCollectives(); }
bool WorkerGroup::running() const { return impl_->running(); }
std::vector<pid_t> WorkerGroup::pids() const { return impl_->pids(); }

}  // namespace launch::agent
