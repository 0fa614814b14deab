#include <dirent.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <set>

#include "agent/subprocess.h"
#include "base/files.h"
#include "base/strings.h"

namespace launch::agent {
namespace {

std::vector<char*> CStrings(const std::vector<std::string>& v) {
  std::vector<char*> out;
  out.reserve(v.size() + 1);
  for (const auto& s : v) out.push_back(const_cast<char*>(s.c_str()));
  out.push_back(nullptr);
  return out;
}

// The descriptors above 2 that this process was started with (what launch's own caller passed
// down): taken before main() runs, so nothing launch opens is among them.
std::set<int> OpenDescriptors() {
  std::set<int> fds;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return fds;
  int own = dirfd(d);
  while (dirent* e = readdir(d)) {
    char* end;
    long fd = std::strtol(e->d_name, &end, 10);
    if (*end == '\0' && e->d_name[0] != '\0' && fd > 2 && fd != own)
      fds.insert(static_cast<int>(fd));
  }
  closedir(d);
  return fds;
}

const std::set<int> kInherited = OpenDescriptors();

}  // namespace

StatusOr<SpawnedProcess> Spawn(const SpawnRequest& request) {
  LAUNCH_CHECK(!request.argv.empty(), "Spawn needs a program");
  std::vector<std::string> argv;
  if (!request.exec_shim.empty()) {
    argv = {request.exec_shim, std::to_string(getpid()), std::to_string(OriginalDescriptorLimit())};
    argv.insert(argv.end(), request.argv.begin(), request.argv.end());
  } else {
    argv = request.argv;
  }

  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  posix_spawn_file_actions_init(&actions);
  posix_spawnattr_init(&attr);
  // stdin is /dev/null: a worker that reads it gets EOF instead of being stopped by SIGTTIN (it is
  // a background process group of launch's terminal). dup2 makes the pipes its 1 and 2.
  // (launch's ssh head passes a pipe instead: the remote launch's control channel.)
  if (request.stdin_fd >= 0)
    posix_spawn_file_actions_adddup2(&actions, request.stdin_fd, 0);
  else
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  if (request.stdout_fd >= 0) posix_spawn_file_actions_adddup2(&actions, request.stdout_fd, 1);
  if (request.stderr_fd >= 0) posix_spawn_file_actions_adddup2(&actions, request.stderr_fd, 2);
  // A worker holds 0-2 and what launch's caller passed down, nothing of launch's own: our
  // descriptors are close-on-exec, but some libraries' are not (Boost.Asio 1.74's sockets), so
  // every other open descriptor without FD_CLOEXEC is closed in the child explicitly.
  if (DIR* d = opendir("/proc/self/fd")) {
    int own = dirfd(d);
    while (dirent* e = readdir(d)) {
      char* end;
      long fd = std::strtol(e->d_name, &end, 10);
      if (*end != '\0' || e->d_name[0] == '\0' || fd <= 2 || fd == own) continue;
      if (kInherited.count(static_cast<int>(fd)) || fd == request.stdin_fd ||
          fd == request.stdout_fd || fd == request.stderr_fd)
        continue;
      int flags = fcntl(static_cast<int>(fd), F_GETFD);
      if (flags >= 0 && !(flags & FD_CLOEXEC))
        posix_spawn_file_actions_addclose(&actions, static_cast<int>(fd));
    }
    closedir(d);
  }

  // Own process group; default dispositions and an empty mask, whatever `launch` had
  // (asio's signal handlers are reset by exec anyway, but ignored signals would be inherited).
  sigset_t empty, all;
  sigemptyset(&empty);
  sigfillset(&all);
  posix_spawnattr_setsigmask(&attr, &empty);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);

  auto cargv = CStrings(argv);
  auto cenv = CStrings(request.env);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, argv[0].c_str(), &actions, &attr, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) return Status::FromErrno("cannot start '" + argv[0] + "'", rc);
  return SpawnedProcess{pid};
}

StatusOr<std::string> ResolveProgram(const std::string& program) {
  auto check = [](const std::string& path) -> Status {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) return Status::NotFound(path + ": no such file");
    if (S_ISDIR(st.st_mode)) return Status::InvalidArgument(path + ": is a directory");
    if (access(path.c_str(), X_OK) != 0)
      return Status::InvalidArgument(path +
                                     ": is not executable (chmod +x, or run it with "
                                     "an interpreter)");
    return Status::Ok();
  };
  if (program.empty()) return Status::InvalidArgument("empty program name");
  if (program.find('/') != std::string::npos) {
    LAUNCH_RETURN_IF_ERROR(check(program));
    return program;
  }
  const char* path_env = std::getenv("PATH");
  std::string path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  for (const std::string& dir : Split(path, ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (check(candidate).ok()) return candidate;
  }
  return Status::NotFound("'" + program + "' was not found on PATH");
}

Status MakePipe(int fds[2]) {
  if (pipe2(fds, O_CLOEXEC) != 0) return Status::FromErrno("pipe2", errno);
  return Status::Ok();
}

void SignalGroup(pid_t pgid, int signo) {
  if (pgid > 0) ::kill(-pgid, signo);
}

}  // namespace launch::agent
