#pragma once

// The text people read when a job fails: the root cause first (rank, exit code or signal, time,
// the tail of its stderr), later failures below it.

#include <string>

#include "agent/worker_group.h"

namespace launch::agent {

struct ReportContext {
  std::string host;  // shown when non-empty (multi-node)
  int restarts_used = 0;
  int max_restarts = 0;
  bool will_restart = false;
  // The workers' interpreter when they run Python, and what chose it:
  // "/usr/bin/python3 (python3 on PATH)". Empty for other programs.
  std::string python;
};

std::string FormatFailureReport(const GroupResult& result, const ReportContext& ctx);

// torchrun runs workers under its own interpreter; launch runs the one `python` names. A
// Python worker that ends within its first minute with ModuleNotFoundError most likely runs
// another interpreter than the one the module was installed for: the hint names the
// interpreter, the module and how to choose another. Empty when that does not apply (no
// `python`, a later failure, another error).
std::string MissingModuleHint(const WorkerExit& exit, const std::string& python);

// "2026-11-22 02:30:11.123" in local time.
std::string FormatTime(std::chrono::system_clock::time_point t);

}  // namespace launch::agent
