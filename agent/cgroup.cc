#include "agent/cgroup.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "base/files.h"
#include "base/strings.h"

namespace launch::agent {
namespace {

// Where the cgroup2 file system is mounted and which of its directories is its root, from
// /proc/self/mountinfo ("36 25 0:30 / /sys/fs/cgroup rw,... - cgroup2 cgroup2 rw,...").
bool FindCgroup2Mount(std::string* mount_point, std::string* mount_root) {
  for (const std::string& line : Split(ReadSmallFile("/proc/self/mountinfo", 4 << 20), '\n')) {
    size_t dash = line.find(" - ");
    if (dash == std::string::npos) continue;
    std::vector<std::string> after = Split(line.substr(dash + 3), ' ');
    std::vector<std::string> before = Split(line.substr(0, dash), ' ');
    if (after.empty() || after[0] != "cgroup2" || before.size() < 5) continue;
    *mount_root = before[3];
    *mount_point = before[4];
    return true;
  }
  return false;
}

// This process's cgroup v2 path ("0::/user.slice/..."), relative to the hierarchy's root.
std::string OwnCgroupPath() {
  for (const std::string& line : Split(ReadSmallFile("/proc/self/cgroup"), '\n'))
    if (StartsWith(line, "0::")) return line.substr(3);
  return "";
}

// When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat); empty
// when there is no such process. With the pid it names one process for as long as the machine
// runs: a pid reused later has a later start time.
std::string StartTime(pid_t pid) {
  std::string stat = ReadSmallFile("/proc/" + std::to_string(pid) + "/stat");
  size_t close = stat.rfind(')');  // after the command name, which may hold spaces
  if (close == std::string::npos) return "";
  std::vector<std::string> fields = Split(Trim(stat.substr(close + 1)), ' ');
  return fields.size() > 19 ? fields[19] : "";  // fields[0] is field 3 (the state)
}

// "pid:[4026531836]": which pid namespace our pids are numbers in.
std::string PidNamespace() {
  char buf[64];
  ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, n) : "";
}

std::string OwnerMarker() {
  return PidNamespace() + " " + std::to_string(::getpid()) + " " + StartTime(::getpid());
}

std::string ReadOwnerMarker(const std::string& dir) {
  char buf[256];
  ssize_t n = ::getxattr(dir.c_str(), kOwnerXattr, buf, sizeof(buf));
  return n > 0 ? std::string(buf, n) : "";
}

// Whether the job cgroup `dir`, named launch-<pid>, belongs to no live `launch`. Where in
// doubt, it does: another job is never killed on a guess.
bool IsAbandoned(const std::string& dir, pid_t pid) {
  std::string marker = ReadOwnerMarker(dir);
  // The marker first: a launch in another pid namespace (a container, a test host) sharing this
  // cgroup hierarchy may have our pid, and its job is alive. (In ours, a marked cgroup with our
  // pid has another start time than ours: a dead launch's, below.)
  if (marker.empty() && pid == ::getpid())
    return true;  // ours is not made yet: a dead launch had our pid
  if (!marker.empty()) {
    // Made by a launch that said which process it was: it lives while that pid has that start
    // time. From another pid namespace, our pids say nothing about it.
    std::vector<std::string> owner = Split(marker, ' ');
    if (owner.size() != 3 || owner[0] != PidNamespace() || owner[1] != std::to_string(pid))
      return false;
    return StartTime(pid) != owner[2];
  }
  // Unmarked (an older launch): gone, or the pid is now some other program's.
  if (::kill(pid, 0) != 0 && errno == ESRCH) return true;
  char exe[PATH_MAX];
  ssize_t n = ::readlink(("/proc/" + std::to_string(pid) + "/exe").c_str(), exe, sizeof(exe) - 1);
  if (n <= 0) return false;  // a zombie, or not ours to look at
  std::string program(exe, n);
  const std::string deleted = " (deleted)";  // the binary was rebuilt under it
  if (EndsWith(program, deleted)) program.resize(program.size() - deleted.size());
  return Basename(program) != "launch";
}

// "launch-<pid>" (as ForThisProcess names it, digits only) -> pid; 0 for any other name.
pid_t JobCgroupPid(const std::string& name) {
  if (!StartsWith(name, "launch-") || name.size() > 7 + 10) return 0;
  std::string digits = name.substr(7);
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return 0;
  long long pid = std::stoll(digits);
  if (pid <= 0 || pid > INT_MAX || std::to_string(pid) != digits) return 0;
  return static_cast<pid_t>(pid);
}

}  // namespace

std::unique_ptr<JobCgroup> JobCgroup::ForThisProcess(std::string* why_not) {
  std::string mount_point, mount_root;
  if (!FindCgroup2Mount(&mount_point, &mount_root)) {
    *why_not = "no cgroup2 file system is mounted";
    return nullptr;
  }
  std::string own = OwnCgroupPath();
  if (own.empty()) {
    *why_not = "this process is in no cgroup v2";
    return nullptr;
  }
  // Inside a cgroup namespace or a bind mount, the mount shows a subtree: strip its root.
  if (mount_root != "/" && StartsWith(own, mount_root)) own = own.substr(mount_root.size());
  std::string parent = mount_point + (own == "/" ? "" : own);
  return std::unique_ptr<JobCgroup>(
      new JobCgroup(parent + "/launch-" + std::to_string(::getpid())));
}

std::vector<std::string> JobCgroup::CollectAbandoned() {
  std::vector<std::string> removed;
  std::string parent = Dirname(path_);
  DIR* d = ::opendir(parent.c_str());
  if (d == nullptr) return removed;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d))
    if (e->d_type == DT_DIR && JobCgroupPid(e->d_name) > 0) names.push_back(e->d_name);
  ::closedir(d);
  for (const std::string& name : names) {
    std::string dir = parent + "/" + name;
    struct stat st;
    // Another user's job is theirs to clean up (and its cgroup.kill not ours to write).
    if (::stat(dir.c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    if (!IsAbandoned(dir, JobCgroupPid(name))) continue;
    if (KillAndRemoveCgroup(dir, kCgroupEmptyTimeout)) removed.push_back(dir);
  }
  return removed;
}

bool JobCgroup::Create(const std::string& exec_shim, std::string* why_not) {
  if (create_tried_) {
    if (!created_) *why_not = why_not_;
    return created_;
  }
  create_tried_ = true;
  if (::mkdir(path_.c_str(), 0755) != 0) {
    why_not_ = "cannot create " + path_ + ": " + std::strerror(errno);
  } else if (::access((path_ + "/cgroup.kill").c_str(), W_OK) != 0 ||
             ::access((path_ + "/cgroup.procs").c_str(), W_OK) != 0) {
    why_not_ = path_ + " has no writable cgroup.kill (Linux 5.14+)";
    ::rmdir(path_.c_str());
  } else {
    // Who made it, for CollectAbandoned; where the kernel keeps no user xattr on cgroups (before
    // 5.7: never with cgroup.kill) the pid and its program say.
    std::string marker = OwnerMarker();
    (void)::setxattr(path_.c_str(), kOwnerXattr, marker.data(), marker.size(), 0);
    created_ = true;
    // (A launch killed before its reaper runs leaves the cgroup to CollectAbandoned.)
    if (!exec_shim.empty()) StartReaper(exec_shim);
  }
  if (!created_) *why_not = why_not_;
  return created_;
}

void JobCgroup::StartReaper(const std::string& exec_shim) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return;
  if (sv[1] == kReaperLifelineFd) {  // a dup2 onto itself would keep close-on-exec
    int moved = ::fcntl(sv[1], F_DUPFD_CLOEXEC, kReaperLifelineFd + 1);
    ::close(sv[1]);
    sv[1] = moved;
  }
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  for (int fd : {0, 1, 2})
    posix_spawn_file_actions_addopen(&actions, fd, "/dev/null", fd == 0 ? O_RDONLY : O_WRONLY, 0);
  if (sv[1] >= 0) posix_spawn_file_actions_adddup2(&actions, sv[1], kReaperLifelineFd);
  // A session of its own: no signal from launch's terminal (Ctrl-C, hang-up) reaches it.
  sigset_t empty, all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::string env = std::string(kJobCgroupEnv) + "=" + path_;
  char* argv[] = {const_cast<char*>(kReaperName), const_cast<char*>(kReaperFlag), nullptr};
  char* envp[] = {env.data(), nullptr};
  pid_t pid = -1;
  int rc = sv[1] < 0 ? EBADF : ::posix_spawn(&pid, exec_shim.c_str(), &actions, &attr, argv, envp);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (sv[1] >= 0) ::close(sv[1]);
  if (rc != 0) {
    ::close(sv[0]);
    return;
  }
  reaper_ = pid;
  lifeline_ = sv[0];
  // It says it is ready once it has renamed itself and holds its end: from then on no
  // `pkill launch` matches it. Without that, it is of no use.
  pollfd p{lifeline_, POLLIN, 0};
  char ready = 0;
  if (::poll(&p, 1, static_cast<int>(kCgroupEmptyTimeout.count())) != 1 ||
      ::read(lifeline_, &ready, 1) != 1)
    EndReaper();
}

void JobCgroup::EndReaper() {
  if (lifeline_ >= 0) ::close(lifeline_);  // it reads EOF, removes what is left, and exits
  lifeline_ = -1;
  if (reaper_ <= 0) return;
  // Its clean-up is quick (we did it already); one that does not finish in time is killed.
  int status;
  pid_t r = 0;
  auto deadline = std::chrono::steady_clock::now() + kCgroupEmptyTimeout;
  while ((r = ::waitpid(reaper_, &status, WNOHANG)) == 0 &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (r == 0) {
    ::kill(reaper_, SIGKILL);
    while (::waitpid(reaper_, &status, 0) < 0 && errno == EINTR) {
    }
  }
  reaper_ = -1;
}

void JobCgroup::KillAll() {
  if (created_) (void)WriteExistingFile(path_ + "/cgroup.kill", "1");
}

bool JobCgroup::KillWorker(pid_t shim) {
  if (!created_) return true;
  return KillAndRemoveCgroup(path_ + "/worker-" + std::to_string(shim), kCgroupEmptyTimeout);
}

JobCgroup::~JobCgroup() {
  if (created_) (void)KillAndRemoveCgroup(path_, kCgroupEmptyTimeout);
  EndReaper();
}

}  // namespace launch::agent
