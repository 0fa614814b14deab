#pragma once

// Starting worker processes (ninja's subprocess-posix.cc is the model): posix_spawn, never
// fork from a threaded process; the worker's argv directly, no shell; each worker in its own
// process group so a Ctrl-C on the terminal reaches only `launch`, which forwards it.

#include <sys/types.h>

#include <string>
#include <vector>

#include "base/status.h"

namespace launch::agent {

struct SpawnRequest {
  // argv[0] must be a path (see ResolveProgram); it is exec'd as given.
  std::vector<std::string> argv;
  // The complete environment, as "KEY=VALUE" strings.
  std::vector<std::string> env;
  // Path of the `launch-exec` shim (exec_shim.h). When set, the child is the shim, which runs
  // argv in a process group of its own and kills everything it started when it ends, on
  // kKillAll, or when `launch` dies, even by SIGKILL. Empty: exec argv directly.
  std::string exec_shim;
  // The descriptor that becomes the child's stdin; -1: /dev/null (see Spawn).
  int stdin_fd = -1;
  // Descriptors that become the child's stdout / stderr; -1 inherits ours.
  int stdout_fd = -1;
  int stderr_fd = -1;
};

struct SpawnedProcess {
  pid_t pid = -1;  // also the process group id (the child leads its own group)
};

// Starts the process. Fails with IoError when posix_spawn fails (e.g. the shim is missing).
StatusOr<SpawnedProcess> Spawn(const SpawnRequest& request);

// Finds `program` like execvp would: as given when it contains '/', else on $PATH. Returns the
// path, or NotFound / InvalidArgument ("is a directory", "is not executable").
StatusOr<std::string> ResolveProgram(const std::string& program);

// pipe2(O_CLOEXEC); fds[0] is the read end.
Status MakePipe(int fds[2]);

// Sends `signo` to the process group `pgid`; ESRCH (already gone) is not an error.
void SignalGroup(pid_t pgid, int signo);

}  // namespace launch::agent
