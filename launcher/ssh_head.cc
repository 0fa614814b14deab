#include "launcher/ssh_head.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <optional>
#include <thread>

#include "agent/line_buffer.h"
#include "agent/subprocess.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/log.h"
#include "base/strings.h"

namespace launch::launcher {
namespace {

using Clock = std::chrono::steady_clock;

// After one host failed, how long the others get to end by themselves: the rendezvous tells
// them at once, and each then prints the job's root cause, which the head's own stop would
// pre-empt. A host still running after this (one whose launch failed before it joined leaves
// the others waiting for it) is stopped.
constexpr std::chrono::seconds kPeersFollow{10};
// How long the remote launch waits for the head's message (it is written right after ssh
// starts, so only a wrong caller waits this long).
constexpr int kHeadMessageTimeoutMs = 30000;
constexpr size_t kMaxHeadMessageBytes = 1 << 20;
constexpr const char* kHeadMagic = "launch-head 1";

// The head's one signal channel: handlers write the signal's number to this pipe, which the
// event loop polls with the hosts' output.
int g_signal_pipe = -1;

void OnSignal(int signo) {
  const int saved = errno;
  unsigned char b = static_cast<unsigned char>(signo);
  if (g_signal_pipe >= 0) (void)::write(g_signal_pipe, &b, 1);
  errno = saved;
}

// One shell word, for the remote shell: '...' with each ' written as '\''.
std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) {
    if (ch == '\'')
      out += "'\\''";
    else
      out += ch;
  }
  return out + "'";
}

bool IsEnvName(const std::string& name) {
  if (name.empty() || std::isdigit(static_cast<unsigned char>(name[0]))) return false;
  return std::all_of(name.begin(), name.end(), [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_';
  });
}

void WriteAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own stdout gone: nothing better to do with the line
    done += static_cast<size_t>(n);
  }
}

// One host's ssh and what the head knows of it.
struct Remote {
  const config::HostSlots* host = nullptr;
  size_t node = 0;
  std::string prefix;  // "HOST: "
  pid_t pid = -1;
  int in = -1, out = -1, err = -1;
  agent::LineBuffer out_lines, err_lines;
  agent::TailLines err_tail{5};
  bool ready = false;
  bool exited = false;
  int code = 0;

  void CloseInput() {
    if (in >= 0) ::close(in);
    in = -1;
  }
};

// Reads what `fd` has; false at its end (the descriptor is then closed and set to -1).
bool Drain(int* fd, std::string* data) {
  char buf[65536];
  ssize_t n = ::read(*fd, buf, sizeof(buf));
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (n <= 0) {
    ::close(*fd);
    *fd = -1;
    return false;
  }
  data->assign(buf, static_cast<size_t>(n));
  return true;
}

std::string Describe(const Remote& r) {
  return r.host->host + " (node " + std::to_string(r.node) + ", " + r.host->where + ")";
}

}  // namespace

std::vector<std::string> SshArgv(const HeadJob& job, size_t node) {
  const config::HostSlots& h = job.hosts.at(node);
  std::vector<std::string> remote = {job.launch_path};
  if (job.self_test) remote.push_back("test");
  remote.insert(
      remote.end(),
      {"--head_stdin", "--num_machines", std::to_string(job.hosts.size()), "--machine_rank",
       std::to_string(node), "--nproc_per_node", std::to_string(h.slots), "--main_process_ip",
       job.master_addr, "--main_process_port", std::to_string(job.port), "--run_id", job.run_id});
  remote.insert(remote.end(), job.args.begin(), job.args.end());
  std::string command = "cd " + ShellQuote(job.cwd) + " && exec";
  for (const std::string& a : remote) command += " " + ShellQuote(a);
  // -T: no terminal, so the remote launch's stdin is ssh's channel (whose end stops it) and no
  // SIGHUP games; BatchMode: fail instead of asking for a password; ServerAliveInterval: a
  // lost link ends ssh here (3 unanswered probes), which ends the remote side's stdin there.
  return {job.ssh, "-T",
          "-o",    "BatchMode=yes",
          "-o",    "ConnectTimeout=30",
          "-o",    "ServerAliveInterval=10",
          h.host,  command};
}

std::string HeadMessage(const HeadJob& job) {
  std::string m = std::string(kHeadMagic) + "\n";
  for (const auto& [k, v] : job.env) m += "env " + k + "=" + v + "\n";
  return m + "token " + job.token + "\nend\n";
}

int RunHead(const HeadJob& job) {
  LAUNCH_CHECK(!job.hosts.empty(), "RunHead needs hosts");
  int sig_pipe[2];
  if (Status s = agent::MakePipe(sig_pipe); !s.ok()) {
    log::Error(s.message());
    return kExitFailure;
  }
  // Both ends: the handler never blocks, and the loop reads what came and goes on.
  ::fcntl(sig_pipe[0], F_SETFL, O_NONBLOCK);
  ::fcntl(sig_pipe[1], F_SETFL, O_NONBLOCK);
  g_signal_pipe = sig_pipe[1];
  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  for (int signo : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2, SIGURG}) {
    struct sigaction old {};
    sigaction(signo, nullptr, &old);
    if (signo == SIGHUP && old.sa_handler == SIG_IGN) continue;  // nohup: stays ignored
    sigaction(signo, &sa, nullptr);
  }
  // A host that ends while the head writes its message must not kill the head.
  ::signal(SIGPIPE, SIG_IGN);

  std::vector<std::string> base_env;
  for (char** e = environ; *e; ++e) base_env.emplace_back(*e);
  const std::string message = HeadMessage(job);

  std::vector<Remote> remotes(job.hosts.size());
  int result = kExitOk;
  bool failed = false, stopping = false;
  std::optional<Clock::time_point> stop_at, kill_at;
  const Remote* first_failed = nullptr;  // the first host whose launch ended non-zero
  auto stop_all = [&](const std::string& why) {
    if (!stopping) log::Info("stopping every host: " + why);
    stopping = true;
    for (Remote& r : remotes) r.CloseInput();
    stop_at.reset();
    if (!kill_at)
      kill_at = Clock::now() +
                std::chrono::milliseconds(static_cast<int64_t>(job.stop_grace_s * 1000)) +
                kPeersFollow;
  };
  auto kill_all = [&] {
    for (Remote& r : remotes)
      if (!r.exited && r.pid > 0) agent::SignalGroup(r.pid, SIGKILL);
  };

  for (size_t i = 0; i < remotes.size(); ++i) {
    Remote& r = remotes[i];
    r.host = &job.hosts[i];
    r.node = i;
    r.prefix = job.hosts[i].host + ": ";
    int in[2], out[2], err[2];
    Status piped = agent::MakePipe(in);
    if (piped.ok()) piped = agent::MakePipe(out);
    if (piped.ok()) piped = agent::MakePipe(err);
    if (!piped.ok()) {
      log::Error(piped.message());
      r.exited = true;
      failed = true;
      result = kExitFailure;
      stop_all("cannot start ssh");
      break;
    }
    agent::SpawnRequest req;
    req.argv = SshArgv(job, i);
    req.env = base_env;
    req.stdin_fd = in[0];
    req.stdout_fd = out[1];
    req.stderr_fd = err[1];
    StatusOr<agent::SpawnedProcess> p = agent::Spawn(req);
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    r.in = in[1];
    r.out = out[0];
    r.err = err[0];
    if (!p.ok()) {
      log::Error(Describe(r) + ": " + p.status().message());
      r.CloseInput();
      ::close(r.out);
      ::close(r.err);
      r.out = r.err = -1;
      r.exited = true;
      failed = true;
      result = kExitFailure;
      stop_all("ssh could not be started");
      break;
    }
    r.pid = p->pid;
    // Far below a pipe's capacity, so this never blocks; a host whose ssh already ended shows
    // up as EPIPE here and by its exit below.
    WriteAll(r.in, message);
  }
  log::Info("started " + std::to_string(remotes.size()) + " host(s) over ssh; node 0 (" +
            job.hosts[0].host + ") hosts the rendezvous at " + job.master_addr + ":" +
            std::to_string(job.port) + ", run id " + job.run_id);

  int signals = 0;
  while (std::any_of(remotes.begin(), remotes.end(),
                     [](const Remote& r) { return !r.exited && r.pid > 0; })) {
    std::vector<pollfd> fds = {{sig_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Remote*, bool>> owners = {{nullptr, false}};
    for (Remote& r : remotes) {
      if (r.out >= 0) fds.push_back({r.out, POLLIN, 0}), owners.push_back({&r, false});
      if (r.err >= 0) fds.push_back({r.err, POLLIN, 0}), owners.push_back({&r, true});
    }
    int timeout = -1;
    auto now = Clock::now();
    for (const auto& at : {stop_at, kill_at})
      if (at) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(*at - now).count();
        int t = static_cast<int>(std::max<int64_t>(0, ms) + 1);
        timeout = timeout < 0 ? t : std::min(timeout, t);
      }
    int n = ::poll(fds.data(), fds.size(), timeout);
    if (n < 0 && errno != EINTR) {
      log::Error(Status::FromErrno("poll", errno).message());
      stop_all("internal error");
      kill_all();
      break;
    }
    for (size_t k = 0; n > 0 && k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      if (k == 0) {
        unsigned char b = 0;
        while (::read(sig_pipe[0], &b, 1) == 1) {
          if (const std::string line = ForwardedSignalLine(b); !line.empty()) {
            log::Info("forwarding " + SignalName(b) + " to every host");
            for (Remote& r : remotes)
              if (r.in >= 0) WriteAll(r.in, line);
            continue;
          }
          ++signals;
          if (!failed) result = ExitCodeForSignal(b);
          if (signals == 1) {
            stop_all(SignalName(b));
          } else {
            log::Info("second signal: ending every host's ssh now");
            kill_all();
          }
        }
        continue;
      }
      Remote& r = *owners[k].first;
      const bool is_err = owners[k].second;
      int* fd = is_err ? &r.err : &r.out;
      std::string data, lines;
      bool open = Drain(fd, &data);
      agent::LineBuffer& buf = is_err ? r.err_lines : r.out_lines;
      if (is_err) r.err_tail.Feed(data);
      buf.Feed(data, r.prefix, &lines);
      if (!open) buf.Flush(r.prefix, &lines);
      if (!is_err && !r.ready) {
        // The remote launch's answer is its first line; what comes before it (a login
        // banner) is shown.
        const std::string ready = r.prefix + kReadyLine + "\n";
        size_t at = lines.find(ready);
        if (at != std::string::npos && (at == 0 || lines[at - 1] == '\n')) {
          lines.erase(at, ready.size());
          r.ready = true;
        }
      }
      WriteAll(is_err ? 2 : 1, lines);
    }
    // A host whose output has ended: its ssh is ending.
    for (Remote& r : remotes) {
      if (r.exited || r.pid <= 0 || r.out >= 0 || r.err >= 0) continue;
      int status = 0;
      pid_t w;
      do {
        w = ::waitpid(r.pid, &status, 0);
      } while (w < 0 && errno == EINTR);
      r.exited = true;
      r.CloseInput();
      r.code = WIFEXITED(status)     ? WEXITSTATUS(status)
               : WIFSIGNALED(status) ? ExitCodeForSignal(WTERMSIG(status))
                                     : kExitFailure;
      if (!r.ready) {
        std::deque<std::string> tail = r.err_tail.Lines();
        std::string said = tail.empty() ? "" : ": " + SanitizeForTerminal(Trim(tail.back()));
        if (!stopping) {
          log::Error(Describe(r) + ": launch could not be started there (ssh exited " +
                     std::to_string(r.code) + said + ")");
          if (!failed) result = kExitFailure;
          failed = true;
          stop_all(r.host->host + " cannot take part");
        }
        continue;
      }
      if (r.code != 0 && !failed && !stopping) {
        failed = true;
        result = r.code;
        first_failed = &r;
        stop_at = Clock::now() + kPeersFollow;
      }
    }
    now = Clock::now();
    if (stop_at && now >= *stop_at) stop_all("a host failed and the others have not ended");
    if (kill_at && now >= *kill_at) {
      log::Warn("hosts still running " + std::to_string(job.stop_grace_s) +
                " s after being asked to stop: ending their ssh");
      kill_all();
      kill_at = now + std::chrono::hours(24);  // once; the loop ends as their output closes
    }
  }
  g_signal_pipe = -1;
  ::close(sig_pipe[0]);
  ::close(sig_pipe[1]);
  if (first_failed) {
    // A failed job ends every host with the root cause's code, in whatever order their ssh
    // ends; node 0 hosts the rendezvous, which decided the root cause, and prints its report
    // (the others leave it to node 0: one report per job). A host that failed alone (a
    // rendezvous it could not reach) is the one to name.
    const Remote& node0 = remotes[0];
    if (node0.exited && node0.ready && node0.code != 0) {
      result = node0.code;
      log::Error("the job failed (exit " + std::to_string(node0.code) +
                 "): node 0's failure "
                 "report above (" +
                 node0.prefix + "...) names the root cause");
    } else {
      log::Error(Describe(*first_failed) + " failed (exit " + std::to_string(first_failed->code) +
                 "); its output above names the cause");
    }
  }
  return result;
}

StatusOr<std::vector<std::pair<std::string, std::string>>> ParseEnvFile(const std::string& text,
                                                                        const std::string& path) {
  std::vector<std::pair<std::string, std::string>> out;
  std::vector<std::string> lines = Split(text, '\n');
  for (size_t i = 0; i < lines.size(); ++i) {
    std::string line = lines[i];
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::string trimmed = Trim(line);
    if (trimmed.empty() || trimmed[0] == '#') continue;
    if (StartsWith(trimmed, "export ")) trimmed = Trim(trimmed.substr(7));
    size_t eq = trimmed.find('=');
    std::string key = eq == std::string::npos ? "" : Trim(trimmed.substr(0, eq));
    if (!IsEnvName(key))
      return Status::InvalidConfig(path + ":" + std::to_string(i + 1) +
                                   ": expected KEY=VALUE, got '" + SanitizeForTerminal(trimmed) +
                                   "'");
    std::string value = trimmed.substr(eq + 1);
    // `export A="x y"` in a file written for the shell means x y: one pair of quotes around the
    // whole value goes (without escapes inside, as in .env files); anything else stays as written.
    const std::string quoted = Trim(value);
    if (quoted.size() >= 2 && (quoted[0] == '"' || quoted[0] == '\'') &&
        quoted.back() == quoted[0] && quoted.find(quoted[0], 1) == quoted.size() - 1)
      value = quoted.substr(1, quoted.size() - 2);
    out.emplace_back(key, value);
  }
  return out;
}

StatusOr<std::vector<std::pair<std::string, std::string>>> JobEnvironment(
    const std::map<std::string, std::string>& env, const std::string& cwd,
    std::vector<std::string>* warnings) {
  std::vector<std::pair<std::string, std::string>> out;
  auto set = [&out](const std::string& k, const std::string& v) {
    for (auto& [key, value] : out)
      if (key == k) {
        value = v;
        return;
      }
    out.emplace_back(k, v);
  };
  for (const auto& [k, v] : env) {
    if (k == "LAUNCH_RDZV_TOKEN" || k == "PET_RDZV_TOKEN") continue;
    if (!(StartsWith(k, "LAUNCH_") || StartsWith(k, "PET_") || k == "PYTHONPATH")) continue;
    if (v.find('\n') != std::string::npos) {
      warnings->push_back(k + " holds a newline: not passed to the other hosts");
      continue;
    }
    set(k, v);
  }
  std::vector<std::string> files;
  auto home = env.find("HOME");
  if (home != env.end() && !home->second.empty()) files.push_back(home->second + "/.launch_env");
  files.push_back(cwd + "/.launch_env");
  if (files.size() == 2 && files[0] == files[1]) files.pop_back();
  for (const std::string& path : files) {
    if (!FileExists(path)) continue;
    StatusOr<std::string> text = ReadRegularFile(path, kMaxHeadMessageBytes / 2);
    if (!text.ok()) return Status::InvalidConfig(text.status().message());
    StatusOr<std::vector<std::pair<std::string, std::string>>> parsed = ParseEnvFile(*text, path);
    if (!parsed.ok()) return parsed.status();
    for (const auto& [k, v] : *parsed) set(k, v);
  }
  return out;
}

Status ReceiveFromHead(int fd, std::vector<std::pair<std::string, std::string>>* env,
                       std::string* token) {
  std::string text;
  const auto deadline = Clock::now() + std::chrono::milliseconds(kHeadMessageTimeoutMs);
  // Byte by byte would do as well; reading past "end\n" would not matter either (the head
  // sends nothing after it), but the rest of stdin is the watcher's.
  while (!EndsWith(text, "\nend\n")) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0)
      return Status::ProtocolError("--head_stdin: no message from the head within " +
                                   std::to_string(kHeadMessageTimeoutMs / 1000) + " s");
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    char ch;
    ssize_t r = ::read(fd, &ch, 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0)
      return Status::ProtocolError(
          "--head_stdin: stdin ended before the head's message did (this flag is for the "
          "launches that --hostfile starts)");
    text += ch;
    if (text.size() > kMaxHeadMessageBytes)
      return Status::ProtocolError("--head_stdin: the head's message is too large");
  }
  std::vector<std::string> lines = Split(text, '\n');
  if (lines.empty() || lines[0] != kHeadMagic)
    return Status::ProtocolError("--head_stdin: stdin does not start with '" +
                                 std::string(kHeadMagic) + "'");
  bool have_token = false;
  for (size_t i = 1; i + 2 < lines.size(); ++i) {
    const std::string& l = lines[i];
    if (StartsWith(l, "env ") && l.find('=') != std::string::npos) {
      size_t eq = l.find('=');
      env->emplace_back(l.substr(4, eq - 4), l.substr(eq + 1));
    } else if (StartsWith(l, "token ")) {
      *token = l.substr(6);
      have_token = true;
    } else {
      return Status::ProtocolError("--head_stdin: unexpected line " + std::to_string(i + 1) +
                                   " in the head's message");
    }
  }
  if (!have_token) return Status::ProtocolError("--head_stdin: the head sent no token");
  return Status::Ok();
}

std::string ForwardedSignalLine(int signo) {
  if (signo != SIGUSR1 && signo != SIGUSR2 && signo != SIGURG) return "";
  std::string name = SignalName(signo);  // "SIGUSR1"
  return "signal " + name.substr(3) + "\n";
}

int ForwardedSignal(const std::string& line) {
  for (int signo : {SIGUSR1, SIGUSR2, SIGURG}) {
    const std::string want = ForwardedSignalLine(signo);
    if (line + "\n" == want) return signo;
  }
  return 0;
}

void StopWhenHeadLeaves(int fd) {
  // A forwarded SIGUSR1/2 that arrives before the agent has its handlers would end this launch
  // (their default action): ignored until then. The agent's own handlers replace this, so its
  // workers start with the default again.
  ::signal(SIGUSR1, SIG_IGN);
  ::signal(SIGUSR2, SIG_IGN);
  std::thread([fd] {
    char buf[256];
    std::string line;
    while (true) {
      ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      for (ssize_t i = 0; i < n; ++i) {
        if (buf[i] != '\n') {
          if (line.size() < 64) line += buf[i];  // no line the head sends is longer
          continue;
        }
        // The agent handles a forwarded signal as one sent to it directly, on its own thread.
        if (int signo = ForwardedSignal(line); signo != 0) ::kill(::getpid(), signo);
        line.clear();
      }
    }
    // The head closed our stdin or its ssh connection is gone: stop as on Ctrl-C. The agent
    // handles the signal on its own thread (no logging here: log is single-threaded).
    ::kill(::getpid(), SIGTERM);
  }).detach();
}

}  // namespace launch::launcher
