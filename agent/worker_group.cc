#include "agent/worker_group.h"

#include <fcntl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <boost/asio/steady_timer.hpp>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>

#include "agent/error_file.h"
#include "agent/exec_shim.h"
#include "agent/line_buffer.h"
#include "agent/subprocess.h"
#include "base/log.h"
#include "base/strings.h"

namespace launch::agent {

namespace asio = boost::asio;

namespace {

// Writes all of `data` to a blocking descriptor (the console or a log file). Retries on EINTR
// and partial writes; gives up silently on other errors (a closed console must not stop us).
void WriteAll(int fd, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        // Our stdout may be a non-blocking pipe shared with a parent; wait for room.
        fd_set set;
        FD_ZERO(&set);
        FD_SET(fd, &set);
        ::select(fd + 1, nullptr, &set, nullptr, nullptr);
        continue;
      }
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

int PidfdOpen(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

}  // namespace

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
  explicit Impl(asio::io_context& io) : io_(io), kill_timer_(io), first_failure_timer_(io) {}

  struct Stream {
    explicit Stream(asio::io_context& io) : pipe(io) {}
    asio::posix::stream_descriptor pipe;
    std::array<char, 65536> buf;
    LineBuffer lines;
    int console_fd = -1;  // -1: not shown
    int file_fd = -1;
    bool open = false;
  };

  struct Worker {
    Worker(asio::io_context& io) : out(io), err(io), pidfd(io) {}
    int local_rank = 0;
    int rank = 0;
    pid_t pid = -1;
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
    // An inherited SIGCHLD=SIG_IGN would make the kernel reap workers and lose their status.
    std::signal(SIGCHLD, SIG_DFL);
    if (spec.error_files) MakeErrorDir();
    for (int lr = 0; lr < spec.local_world_size; ++lr) {
      Status s = StartOne(lr);
      if (!s.ok()) {
        KillAndReapAll();
        return s;
      }
    }
    return Status::Ok();
  }

  Status StartOne(int local_rank) {
    auto w = std::make_unique<Worker>(io_);
    w->local_rank = local_rank;
    w->rank = spec_.rank_offset + local_rank;
    w->prefix = "[rank " + std::to_string(w->rank) + "]: ";
    w->tail = TailLines(spec_.stderr_tail_lines);
    int file_mask = local_rank < static_cast<int>(spec_.file_streams.size())
                        ? spec_.file_streams[local_rank]
                        : 0;
    int console_mask = local_rank < static_cast<int>(spec_.console_streams.size())
                           ? spec_.console_streams[local_rank]
                           : (kStdout | kStderr);

    std::map<std::string, std::string> env_map;
    for (const std::string& kv : spec_.base_env) {
      size_t eq = kv.find('=');
      if (eq != std::string::npos) env_map[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    for (const auto& [k, v] : spec_.extra_env) env_map[k] = v;
    for (const auto& [k, v] : ContractEnvironment(spec_, local_rank)) env_map[k] = v;
    if (spec_.virtual_local_rank && spec_.gpu_workers) {
      // The device LOCAL_RANK would have picked, as the only one the worker sees.
      auto visible = env_map.find("CUDA_VISIBLE_DEVICES");
      std::vector<std::string> ids;
      if (visible != env_map.end()) ids = Split(visible->second, ',');
      const int device =
          spec_.node_view.local_rank >= 0 ? spec_.node_view.local_rank + local_rank : local_rank;
      env_map["CUDA_VISIBLE_DEVICES"] =
          device < static_cast<int>(ids.size()) ? Trim(ids[device]) : std::to_string(device);
    }
    if (!error_dir_.empty()) {
      w->exit.error_file = error_dir_ + "/rank_" + std::to_string(w->rank) + ".error.json";
      ::unlink(w->exit.error_file.c_str());  // a previous attempt's must not be read as this one's
      env_map["TORCHELASTIC_ERROR_FILE"] = w->exit.error_file;
    }
    SpawnRequest req;
    req.argv = spec_.argv;
    req.exec_shim = spec_.exec_shim;
    for (const auto& [k, v] : env_map) req.env.push_back(k + "=" + v);

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
    StatusOr<SpawnedProcess> proc = Spawn(req);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    if (!proc.ok()) {
      ::close(out_pipe[0]);
      ::close(err_pipe[0]);
      return proc.status();
    }
    w->pid = proc->pid;
    w->out.pipe.assign(out_pipe[0]);
    w->err.pipe.assign(err_pipe[0]);
    w->out.open = w->err.open = true;
    w->out.console_fd = (console_mask & kStdout) ? spec_.console_stdout_fd : -1;
    w->err.console_fd = (console_mask & kStderr) ? spec_.console_stderr_fd : -1;
    if (!spec_.log_dir.empty()) {
      std::string base = spec_.log_dir + "/rank_" + std::to_string(w->rank);
      if (file_mask & kStdout) w->out.file_fd = OpenLog(base + ".stdout");
      if (file_mask & kStderr) w->err.file_fd = OpenLog(base + ".stderr");
    }
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
    ReadMore(raw, &raw->out, false);
    ReadMore(raw, &raw->err, true);
    WaitExit(raw);
    return Status::Ok();
  }

  int OpenLog(const std::string& path) {
    // O_NOFOLLOW: a symlink planted in a shared log_dir must not make us truncate its target.
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_APPEND | O_NOFOLLOW,
                    0644);
    if (fd < 0)
      log::Warn("cannot write the log file " + path + ": " + std::strerror(errno) +
                (errno == ELOOP ? " (it is a symbolic link; not followed)" : ""));
    return fd;
  }

  void ReadMore(Worker* w, Stream* s, bool is_err) {
    auto self = shared_from_this();
    s->pipe.async_read_some(
        asio::buffer(s->buf), [this, self, w, s, is_err](boost::system::error_code ec, size_t n) {
          if (n > 0) {
            std::string_view data(s->buf.data(), n);
            if (s->file_fd >= 0) WriteAll(s->file_fd, data);
            if (is_err) w->tail.Feed(data);
            if (s->console_fd >= 0) {
              std::string out;
              s->lines.Feed(data, w->prefix, &out);
              WriteAll(s->console_fd, out);
            }
          }
          if (ec) {  // EOF or error: the worker (and anything it forked) closed the pipe
            CloseStream(w, s);
            MaybeFinish();
            return;
          }
          ReadMore(w, s, is_err);
        });
  }

  void CloseStream(Worker* w, Stream* s) {
    if (!s->open) return;
    if (s->console_fd >= 0) {
      std::string out;
      s->lines.Flush(w->prefix, &out);
      WriteAll(s->console_fd, out);
    }
    if (s->file_fd >= 0) ::close(s->file_fd);
    s->file_fd = -1;
    boost::system::error_code ignored;
    s->pipe.close(ignored);
    s->open = false;
    if (w == first_failed_) MaybeFireFirstFailure();
  }

  void SetFirstFailure(std::function<void(const WorkerExit&)> fn) {
    on_first_failure_ = std::move(fn);
  }

  void MaybeFireFirstFailure() {
    if (first_failed_ && !first_failed_->out.open && !first_failed_->err.open) FireFirstFailure();
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
    WorkerExit& e = w->exit;
    e.local_rank = w->local_rank;
    e.rank = w->rank;
    e.pid = w->pid;
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

  void MaybeFinish() {
    if (finished_ || live_ > 0) return;
    for (auto& w : workers_) {
      if (w->out.open || w->err.open) return;
    }
    finished_ = true;
    kill_timer_.cancel();
    for (auto& w : workers_) {
      for (const auto& line : w->tail.Lines()) {
        for (auto& f : result_.failures)
          if (f.pid == w->pid) f.stderr_tail.push_back(line);
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

  void Signal(int signo) {
    for (auto& w : workers_)
      if (!w->reaped) SignalGroup(w->pid, signo);
  }

  void Stop(int signo) {
    stop_requested_ = true;
    StopInternal(signo);
  }

  void StopInternal(int signo) {
    if (live_ == 0) return;
    stopping_ = true;
    Signal(signo);
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
    }
    for (auto& w : workers_) {
      boost::system::error_code ignored;
      w->pidfd.close(ignored);
      if (w->out.file_fd >= 0) ::close(w->out.file_fd);
      if (w->err.file_fd >= 0) ::close(w->err.file_fd);
      w->out.file_fd = w->err.file_fd = -1;
      w->out.pipe.close(ignored);
      w->err.pipe.close(ignored);
      w->out.open = w->err.open = false;
    }
    kill_timer_.cancel();
    first_failure_timer_.cancel();
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
  std::function<void(const WorkerExit&)> on_first_failure_;
  Worker* first_failed_ = nullptr;  // the first worker that failed on its own
  bool first_failure_fired_ = false;
  WorkerGroupSpec spec_;
  std::function<void(const GroupResult&)> on_done_;
  std::vector<std::unique_ptr<Worker>> workers_;
  GroupResult result_;
  int live_ = 0;
  bool stopping_ = false;        // the agent has signalled the workers
  bool stop_requested_ = false;  // Stop() from outside
  bool failed_ = false;
  bool kill_armed_ = false;
  bool drain_deadline_armed_ = false;
  bool finished_ = false;
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
bool WorkerGroup::running() const { return impl_->running(); }
std::vector<pid_t> WorkerGroup::pids() const { return impl_->pids(); }

}  // namespace launch::agent
