#pragma once

// The exit-code policy of every program here (`launch`, its agents, `train`, `launch
// rdzv-server`, `launch config`): what a shell, SLURM or a parent process sees. One place, so
// the same failure exits the same way whichever program reports it.
//
//   0         done
//   1         failed while running (a lost peer, an I/O error, a failure with no code of its own)
//   2         usage: bad configuration or arguments, refused credentials or protocol; nothing ran
//   128 + N   stopped by signal N (a worker killed by it, or launch stopped on request)
//   other     a failed worker's own exit code (the root cause's)

#include "base/status.h"

namespace launch {

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// As a shell reports a process that `signal` ended.
constexpr int ExitCodeForSignal(int signal) { return 128 + signal; }

// Whether a failure came while setting up (before anything ran: a rendezvous that timed out is
// then a usage error, exit 2) or while running (a timeout is then a failure, exit 1).
enum class Phase { kSetup, kRun };

// Ok 0; Interrupted 128 + SIGTERM (stopped on request, after saving what it could);
// InvalidConfig, InvalidArgument, NotFound, AuthFailed, ProtocolError 2; Timeout 2 in setup,
// 1 while running; anything else 1.
int ExitCodeFor(const Status& status, Phase phase = Phase::kRun);

// A worker's end as its launcher exits with it: 128 + its signal, else its exit code; a failure
// that reports 0 (or nothing) still exits 1, so a failure never reads as success.
int ExitCodeForWorker(int exit_code, int signal);

}  // namespace launch
