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
};

std::string FormatFailureReport(const GroupResult& result, const ReportContext& ctx);

// "2026-11-22 02:30:11.123" in local time.
std::string FormatTime(std::chrono::system_clock::time_point t);

}  // namespace launch::agent
