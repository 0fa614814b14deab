// launch-exec PARENT_PID PROGRAM [ARGS...]
//
// Runs between posix_spawn and the worker's exec: posix_spawn cannot run code in the child,
// and a worker must die with `launch` even when `launch` is SIGKILLed (no chance to clean up).
// The parent-death signal survives exec, so the worker itself carries it. The getppid() check
// closes the race where `launch` died before prctl() took effect.

#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: launch-exec PARENT_PID PROGRAM [ARGS...] (internal to launch)\n");
    return 2;
  }
  pid_t parent = static_cast<pid_t>(std::strtol(argv[1], nullptr, 10));
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) {
    std::fprintf(stderr, "launch-exec: prctl(PR_SET_PDEATHSIG): %s\n", std::strerror(errno));
    return 127;
  }
  if (getppid() != parent) return 127;  // launch is already gone: do not start the worker
  execv(argv[2], argv + 2);
  std::fprintf(stderr, "launch: cannot execute '%s': %s\n", argv[2], std::strerror(errno));
  return 127;
}
