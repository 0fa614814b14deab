#pragma once

// How a child process (a worker, a background checkpoint writer) ended, decoded once from
// waitpid()'s status word.

#include <string>

#include "base/exit_code.h"

namespace launch {

struct ExitStatus {
  bool signaled = false;  // killed by a signal (then `signal` is set), else exited with `code`
  int code = 0;
  int signal = 0;

  static ExitStatus FromWaitStatus(int wait_status);
  bool success() const { return !signaled && code == 0; }
  // The shell convention: the exit code, or 128 + signal number.
  int ShellCode() const { return signaled ? ExitCodeForSignal(signal) : code; }
  // "exited with code 3", "killed by SIGSEGV (signal 11)".
  std::string ToString() const;
};

}  // namespace launch
