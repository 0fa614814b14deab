#pragma once

// The text people read when a job fails: the root cause first (rank, exit code or signal, time,
// the tail of its stderr), later failures below it.

#include <string>

#include "agent/worker_group.h"

namespace launch::agent {

inline constexpr const char* kPythonChoice = "--python PATH (or PYTHON_EXEC)";
inline constexpr const char* kHostfilePythonChoice =
    "--python PATH on the head's command line (or PYTHON_EXEC in the hosts' ~/.launch_env or "
    "<working folder>/.launch_env; the head's own environment does not reach them)";

struct ReportContext {
  std::string host;  // shown when non-empty (multi-node)
  int restarts_used = 0;
  int max_restarts = 0;
  bool will_restart = false;
  // The workers' interpreter when they run Python, and what chose it:
  // "/usr/bin/python3 (python3 on PATH)". Empty for other programs.
  std::string python;
  // How a user chooses another interpreter, in words that reach these workers: kPythonChoice,
  // or on a --hostfile host kHostfilePythonChoice (the head's PYTHON_EXEC stays on the head).
  std::string python_choice = kPythonChoice;
};

std::string FormatFailureReport(const GroupResult& result, const ReportContext& ctx);

// torchrun runs workers under its own interpreter; launch runs the one `python` names. A
// Python worker that ends within its first minute with ModuleNotFoundError most likely runs
// another interpreter than the one the module was installed for: the hint names the
// interpreter, the module and how to choose another. Empty when that does not apply (no
// `python`, a later failure, another error).
std::string MissingModuleHint(const WorkerExit& exit, const std::string& python,
                              const std::string& python_choice = kPythonChoice);

// "2026-11-22 02:30:11.123" in local time.
std::string FormatTime(std::chrono::system_clock::time_point t);

}  // namespace launch::agent
