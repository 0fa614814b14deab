#pragma once

// How a child process (a worker, a background checkpoint writer) ended, decoded once from
// waitpid()'s status word.

#include <string>

namespace launch {

struct ExitStatus {
  bool signaled = false;  // killed by a signal (then `signal` is set), else exited with `code`
  int code = 0;
  int signal = 0;

  static ExitStatus FromWaitStatus(int wait_status);
  bool success() const { return !signaled && code == 0; }
  // "exited with code 3", "killed by SIGSEGV (signal 11)".
  std::string ToString() const;
};

}  // namespace launch
