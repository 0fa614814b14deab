#include "base/exit_code.h"

#include <csignal>

namespace launch {

int ExitCodeFor(const Status& status, Phase phase) {
  using Code = Status::Code;
  switch (status.code()) {
    case Code::kOk:
      return kExitOk;
    case Code::kInterrupted:
      return ExitCodeForSignal(SIGTERM);
    case Code::kInvalidConfig:
    case Code::kInvalidArgument:
    case Code::kNotFound:
    case Code::kAuthFailed:
    case Code::kProtocolError:
      return kExitUsage;
    case Code::kTimeout:
      return phase == Phase::kSetup ? kExitUsage : kExitFailure;
    default:
      return kExitFailure;
  }
}

int ExitCodeForWorker(int exit_code, int signal) {
  if (signal > 0) return ExitCodeForSignal(signal);
  return exit_code > 0 ? exit_code : kExitFailure;
}

}  // namespace launch
