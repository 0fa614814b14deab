// launch-exec PARENT_PID NOFILE_SOFT PROGRAM [ARGS...]   (the contract: exec_shim.h)
// launch-exec --reap                                     (the job cgroup's reaper: RunReaper)
//
// Every worker runs under one of these: it is what `launch` spawns, supervises and signals, and
// it makes sure nothing the worker starts outlives it, on every exit path:
//
//  * It is a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the worker forks and abandons,
//    setsid'd daemons and double forks included, is re-parented to the shim, not to init.
//  * It forks the worker into a process group of its own (W) and waits. When the worker exits,
//    the shim SIGKILLs group W and every descendant it has adopted, reaps them, and exits with the
//    worker's status (re-raising the signal that killed it), so `launch` sees the worker's status.
//  * Its parent-death signal is kKillAll: when `launch` dies, even by SIGKILL, the shim kills the
//    whole tree the same way. The getppid() check closes the race where `launch` died before
//    prctl() took effect. The worker itself carries PR_SET_PDEATHSIG(SIGKILL) for the shim.
//  * Where `launch` made a job cgroup (LAUNCH_JOB_CGROUP, agent/cgroup.h), the worker runs in a
//    cgroup of its own below it, and killing the tree starts with its cgroup.kill: atomic, and
//    it reaches processes that left the subreaper's reach. The shim removes that cgroup (and the
//    job's, when it is the last) before it exits. The variable does not reach the worker. A shim
//    SIGKILLed by someone else cannot: `launch` kills its worker's cgroup when it reaps it, and
//    the reaper the job's when `launch` dies too.
//  * Signals from `launch`: SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGCONT (which launch sends
//    after a stop signal, so that a stopped worker acts on it) go to the worker's group W;
//    SIGUSR1 and SIGUSR2 only to the processes of W that handle them (SigCgt in /proc): their
//    default action is to die, which a wrapper shell or a DataLoader worker would; kKillAll kills
//    the tree now (launch's SIGKILL escalation).
//
// Dependency-free, so it costs well under a millisecond per worker. Exit 127: the worker could
// not be started (message on stderr).

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "agent/cgroup.h"
#include "agent/exec_shim.h"
#include "base/collective_ring.h"

namespace {

pid_t g_worker = -1;
char g_cgroup[4096] = "";      // the worker's cgroup; empty: none
char g_job_cgroup[4096] = "";  // its parent, the job's

// Writes `text` to an existing control file; false on failure.
bool WriteControl(const char* dir, const char* file, const char* text) {
  char path[4200];
  std::snprintf(path, sizeof(path), "%s/%s", dir, file);
  int fd = open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  ssize_t n = write(fd, text, std::strlen(text));
  close(fd);
  return n == static_cast<ssize_t>(std::strlen(text));
}

// Removes the worker's cgroup once the kernel has emptied it (an rmdir of a populated cgroup
// fails with EBUSY; the last processes may take a moment to leave after the kill). When
// `launch` is gone (it made the job's cgroup and removes it itself otherwise, and may still start
// workers in it), also the job's, which fails while another worker's cgroup is left in it: the
// last shim removes it.
// The worker's collective ring, stack file and in-place declaration (base/collective_ring.h):
// launch removes them with its workers; once launch is gone (SIGKILLed), nobody else would.
void RemoveRingIfLaunchIsGone(pid_t launch_pid) {
  if (getppid() == launch_pid) return;
  const char* ring = std::getenv(launch::kCollectiveRingEnv);
  if (ring == nullptr || ring[0] == '\0') return;
  unlink(ring);
  unlink(launch::StackPathFor(ring).c_str());
  unlink(launch::InPlacePathFor(ring).c_str());
}

void RemoveCgroups(pid_t launch_pid) {
  if (g_cgroup[0] == '\0') return;
  for (int i = 0; i < 500 && rmdir(g_cgroup) != 0 && errno == EBUSY; ++i) usleep(2000);
  if (getppid() != launch_pid) rmdir(g_job_cgroup);
}

// Calls fn(pid) for each of our children: /proc/self/task/<tid>/children where the kernel has
// it, else a scan of /proc for processes whose parent we are.
template <typename Fn>
void ForEachChild(Fn fn) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/self/task/%d/children", static_cast<int>(getpid()));
  if (FILE* f = std::fopen(path, "re")) {
    long pid;
    while (std::fscanf(f, "%ld", &pid) == 1) fn(static_cast<pid_t>(pid));
    std::fclose(f);
    return;
  }
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return;
  while (dirent* e = readdir(proc)) {
    char* end;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    FILE* f = std::fopen(path, "re");
    if (f == nullptr) continue;
    char buf[512];
    size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* close = std::strrchr(buf, ')');  // after the command name, which may hold spaces
    long ppid = 0;
    char state;
    if (close && std::sscanf(close + 1, " %c %ld", &state, &ppid) == 2 && ppid == getpid())
      fn(static_cast<pid_t>(pid));
  }
  closedir(proc);
}

// Sends `sig` to the processes of group `pgid` that catch it; says so on stderr (the worker's
// stream) when none does, rather than killing them with it.
void SignalHandlers(pid_t pgid, int sig) {
  int sent = 0;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return;
  while (dirent* e = readdir(proc)) {
    char* end;
    long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    char path[64], buf[4096];
    std::snprintf(path, sizeof(path), "/proc/%ld/stat", pid);
    FILE* f = std::fopen(path, "re");
    if (f == nullptr) continue;
    size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    buf[n] = '\0';
    const char* close = std::strrchr(buf, ')');
    long ppid = 0, group = 0;
    char state;
    if (!close || std::sscanf(close + 1, " %c %ld %ld", &state, &ppid, &group) != 3 ||
        group != pgid)
      continue;
    std::snprintf(path, sizeof(path), "/proc/%ld/status", pid);
    f = std::fopen(path, "re");
    if (f == nullptr) continue;
    unsigned long long caught = 0;
    while (std::fgets(buf, sizeof(buf), f))
      if (std::sscanf(buf, "SigCgt: %llx", &caught) == 1) break;
    std::fclose(f);
    if (caught & (1ULL << (sig - 1))) {
      kill(static_cast<pid_t>(pid), sig);
      ++sent;
    }
  }
  closedir(proc);
  if (sent == 0)
    std::fprintf(stderr, "launch: %s not delivered: no process of this worker handles it\n",
                 sig == SIGUSR1 ? "SIGUSR1" : "SIGUSR2");
}

// SIGKILLs group W and every child the shim has (adopted daemons and their groups), repeatedly,
// until none is left: killing a child can orphan grandchildren, which come to us next. Bounded:
// each round reaps at least one process or ends.
void KillTreeAndReap(int* worker_status, bool* worker_done) {
  if (g_cgroup[0] != '\0') WriteControl(g_cgroup, "cgroup.kill", "1");
  if (g_worker > 0) kill(-g_worker, SIGKILL);
  for (int round = 0; round < 100000; ++round) {
    // Our live children, from /proc (children of every thread of ours: we have one).
    bool any = false;
    ForEachChild([&any](pid_t pid) {
      any = true;
      kill(-pid, SIGKILL);  // its group, if it leads one
      kill(pid, SIGKILL);
    });
    int status = 0;
    pid_t r = waitpid(-1, &status, any ? 0 : WNOHANG);
    if (r == g_worker && !*worker_done) {
      *worker_status = status;
      *worker_done = true;
    }
    if (r < 0 && errno == ECHILD) return;  // nothing left
    if (r == 0) usleep(1000);              // a child we could not list yet (just re-parented)
  }
}

[[noreturn]] void ExitLike(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    sigprocmask(SIG_UNBLOCK, &set, nullptr);
    kill(getpid(), sig);
    _exit(128 + sig);  // a signal that does not terminate (cannot happen for a worker's)
  }
  _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}

// launch-exec --reap (as `cgroup-reaper`, see agent/cgroup.h): waits for `launch` to end, then
// kills and removes the job's cgroup. `launch` holds the other end of the socket pair on
// kReaperLifelineFd and nothing else does: EOF on it means `launch` is gone, however it went.
int RunReaper() {
  using namespace launch::agent;
  prctl(PR_SET_NAME, kReaperName);  // comm; `pkill launch` must not match it
  const char* job = std::getenv(kJobCgroupEnv);
  if (job == nullptr || job[0] == '\0') return 2;
  // Nothing launch's caller passed down stays open here (a pipe's reader would wait for us).
  for (int n = 1; n > 0;) {  // in rounds: not closed while the directory is being read
    DIR* fds = opendir("/proc/self/fd");
    if (fds == nullptr) break;
    int own = dirfd(fds), list[256];
    n = 0;
    while (dirent* e = readdir(fds)) {
      int fd = std::atoi(e->d_name);
      if (fd > kReaperLifelineFd && fd != own && n < 256) list[n++] = fd;
    }
    closedir(fds);
    for (int i = 0; i < n; ++i) close(list[i]);
  }
  char byte = 'r';
  if (write(kReaperLifelineFd, &byte, 1) != 1) return 2;
  for (;;) {
    ssize_t n = read(kReaperLifelineFd, &byte, 1);
    if (n == 0) break;                      // launch is gone
    if (n < 0 && errno != EINTR) return 2;  // not the lifeline we were promised: kill nothing
  }
  // Workers may still be dying (their shims kill them too); a process stuck in the kernel may
  // take a while: retry for up to a minute.
  for (int i = 0; i < 30 && !KillAndRemoveCgroup(job, kCgroupEmptyTimeout); ++i) {
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], launch::agent::kReaperFlag) == 0) return RunReaper();
  if (argc < 4) {
    std::fprintf(
        stderr,
        "usage: launch-exec PARENT_PID NOFILE_SOFT PROGRAM [ARGS...] (internal to launch)\n");
    return 2;
  }
  pid_t parent = static_cast<pid_t>(std::strtol(argv[1], nullptr, 10));
  rlim_t nofile_soft = static_cast<rlim_t>(std::strtoull(argv[2], nullptr, 10));
  char** program = argv + 3;

  // Every signal we act on is taken synchronously with sigwaitinfo.
  sigset_t handled;
  sigemptyset(&handled);
  for (int s : {SIGCHLD, SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGCONT, SIGUSR1, SIGUSR2,
                launch::agent::kKillAll})
    sigaddset(&handled, s);
  sigprocmask(SIG_BLOCK, &handled, nullptr);
  signal(SIGCHLD, SIG_DFL);  // an inherited SIG_IGN would make the kernel reap the worker

  if (prctl(PR_SET_PDEATHSIG, launch::agent::kKillAll) != 0 ||
      prctl(PR_SET_CHILD_SUBREAPER, 1) != 0) {
    std::fprintf(stderr, "launch-exec: prctl: %s\n", std::strerror(errno));
    return 127;
  }
  if (getppid() != parent) return 127;  // launch is already gone: do not start the worker

  if (const char* job = std::getenv(launch::agent::kJobCgroupEnv)) {
    std::snprintf(g_job_cgroup, sizeof(g_job_cgroup), "%s", job);
    std::snprintf(g_cgroup, sizeof(g_cgroup), "%s/worker-%d", job, static_cast<int>(getpid()));
    if (mkdir(g_cgroup, 0755) != 0) g_cgroup[0] = '\0';  // the subreaper alone, then
    unsetenv(launch::agent::kJobCgroupEnv);
  }

  pid_t shim = getpid();
  g_worker = fork();
  if (g_worker < 0) {
    std::fprintf(stderr, "launch: cannot start '%s': fork: %s\n", program[0], std::strerror(errno));
    RemoveCgroups(parent);
    return 127;
  }
  if (g_worker == 0) {
    setpgid(0, 0);
    // Into the worker's cgroup before exec: everything it starts is born inside.
    if (g_cgroup[0] != '\0') WriteControl(g_cgroup, "cgroup.procs", "0");
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != shim) _exit(127);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    rlimit lim;
    if (nofile_soft > 0 && getrlimit(RLIMIT_NOFILE, &lim) == 0 && nofile_soft <= lim.rlim_max) {
      lim.rlim_cur = nofile_soft;
      setrlimit(RLIMIT_NOFILE, &lim);
    }
    execv(program[0], program);
    std::fprintf(stderr, "launch: cannot execute '%s': %s\n", program[0], std::strerror(errno));
    _exit(127);
  }
  setpgid(g_worker, g_worker);  // also here: no signal may find the worker still in our group

  int worker_status = 0;
  bool worker_done = false;
  for (;;) {
    siginfo_t info;
    int sig = sigwaitinfo(&handled, &info);
    if (sig < 0) continue;  // EINTR
    if (sig == SIGCHLD) {
      int status;
      pid_t r;
      while ((r = waitpid(-1, &status, WNOHANG)) > 0) {
        if (r == g_worker) {
          worker_status = status;
          worker_done = true;
        }
      }
      if (worker_done) break;  // the worker is gone: so is everything it left behind
    } else if (sig == launch::agent::kKillAll) {
      break;
    } else if (sig == SIGUSR1 || sig == SIGUSR2) {
      SignalHandlers(g_worker, sig);
    } else {
      kill(-g_worker, sig);
    }
  }
  KillTreeAndReap(&worker_status, &worker_done);
  RemoveCgroups(parent);
  RemoveRingIfLaunchIsGone(parent);
  if (!worker_done) worker_status = SIGKILL;  // reaped by nobody: cannot happen; say "killed"
  ExitLike(worker_status);
}
