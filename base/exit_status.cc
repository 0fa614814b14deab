#include "base/exit_status.h"

#include <sys/wait.h>

#include "base/strings.h"

namespace launch {

ExitStatus ExitStatus::FromWaitStatus(int wait_status) {
  ExitStatus s;
  if (WIFSIGNALED(wait_status)) {
    s.signaled = true;
    s.signal = WTERMSIG(wait_status);
  } else if (WIFEXITED(wait_status)) {
    s.code = WEXITSTATUS(wait_status);
  }
  return s;
}

std::string ExitStatus::ToString() const {
  if (signaled)
    return "killed by " + SignalName(signal) + " (signal " + std::to_string(signal) + ")";
  return "exited with code " + std::to_string(code);
}

}  // namespace launch
