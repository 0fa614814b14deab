#pragma once

// What makes a multi-node job this job, as each of its nodes sees it without talking to the
// others: the run id a job gets when it names none (--rdzv_id / run_id), so that the nodes of
// one job agree on it and another job pointed at the same endpoint is refused by the rendezvous
// (naming both ids) instead of joining it.

#include <string>

#include "config/launch_config.h"
#include "launcher/plan_system.h"

namespace launch::launcher {

// A hash of the built-in trainer's settings every rank must share (TrajectorySettings and
// output_dir; not the top-level keys, which differ per machine). Empty for a program of its own.
std::string TrainerIdentity(const config::LaunchConfig& cfg);

// A hash of the role, the program as given with the content of each argument that names a
// small file (the script), the extra arguments and TrainerIdentity.
std::string JobIdentityHash(const config::LaunchConfig& cfg, PlanSystem& sys);

// "job-<12 hex digits>" from the node count, max_restarts and JobIdentityHash.
std::string DerivedRunId(const config::LaunchConfig& cfg, PlanSystem& sys);

}  // namespace launch::launcher
