#pragma once

// The contract between `launch` and its `launch-exec` shim (exec_shim_main.cc), which every
// worker runs under:
//
//   launch-exec PARENT_PID NOFILE_SOFT PROGRAM [ARGS...]
//
// The shim forks PROGRAM into a process group of its own, forwards launch's signals to it, and
// on the worker's exit, on kKillAll, or when PARENT_PID dies (even by SIGKILL) kills every
// process the worker started, daemons included, then exits with the worker's status. The worker
// gets NOFILE_SOFT back as its RLIMIT_NOFILE soft limit (launch raises its own for the
// rendezvous; programs that use select() expect the usual 1024). With LAUNCH_JOB_CGROUP in its
// environment (agent/cgroup.h) the worker also runs in a cgroup of its own below that one.
//
//   launch-exec --reap   (argv[0] cgroup-reaper; LAUNCH_JOB_CGROUP; descriptor 3)
//
// is the job cgroup's reaper instead: it kills and removes LAUNCH_JOB_CGROUP once descriptor 3,
// one end of a socket pair whose other end only `launch` holds, reads EOF (agent/cgroup.h).

#include <csignal>

namespace launch::agent {

// "Kill the worker and everything it started, now": launch's SIGKILL escalation, and the
// shim's parent-death signal. A signal nothing else sends to a worker.
constexpr int kKillAll = SIGPWR;

}  // namespace launch::agent
