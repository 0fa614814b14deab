#include "launcher/launcher.h"

#include <cstdlib>

#include <doctest/doctest.h>

namespace launch::launcher {
namespace {

struct Parsed {
  Status status;
  config::LaunchConfig cfg;
  bool print = false;
  bool exit_now = false;
};

Parsed Parse(std::vector<std::string> args) {
  // Never pick up the user's ~/.config/launch/default_config.yaml.
  setenv("XDG_CONFIG_HOME", "/nonexistent/launch-test", 1);
  Parsed p;
  p.status = ParseCommandLine(args, &p.cfg, &p.print, &p.exit_now);
  return p;
}

TEST_CASE("BothSpellingsOfEveryFlag") {
  Parsed a = Parse({"--nproc-per-node", "3", "--max-restarts", "2", "--", "true"});
  REQUIRE(a.status.ok());
  CHECK(a.cfg.nproc_per_node == "3");
  CHECK(a.cfg.max_restarts == 2);
  Parsed b = Parse({"--nproc_per_node", "3", "--node_rank", "0", "--", "true"});
  REQUIRE(b.status.ok());
  CHECK(b.cfg.nproc_per_node == "3");
  CHECK(b.cfg.origins["nproc_per_node"].ToString() == "flag --nproc_per_node");
}

TEST_CASE("ProgramAfterDashDashKeepsItsOwnFlags") {
  Parsed p = Parse({"--nproc_per_node", "2", "--", "prog", "--nproc_per_node", "9", "-x"});
  REQUIRE(p.status.ok());
  CHECK(p.cfg.program == std::vector<std::string>{"prog", "--nproc_per_node", "9", "-x"});
  CHECK(p.cfg.nproc_per_node == "2");
}

TEST_CASE("TorchrunStyleScriptWithoutDashDash") {
  Parsed p = Parse({"--nproc_per_node", "2", "train.py", "--lr", "0.1"});
  REQUIRE(p.status.ok());
  CHECK(p.cfg.program == std::vector<std::string>{"train.py", "--lr", "0.1"});
}

TEST_CASE("UnknownFlagSuggestsTheNearestOne") {
  Parsed p = Parse({"--nprocs", "2", "--", "true"});
  CHECK(p.status.code() == Status::Code::kInvalidConfig);
  CHECK(p.status.message() ==
        "unknown flag '--nprocs' (did you mean '--nproc_per_node'?); see launch --help");
}

TEST_CASE("RdzvConfPairs") {
  Parsed p = Parse({"--rdzv_conf", "join_timeout=5,last_call_timeout=0.5", "--", "true"});
  REQUIRE(p.status.ok());
  CHECK(p.cfg.rdzv_conf.join_timeout_s == 5);
  CHECK(p.cfg.rdzv_conf.last_call_timeout_s == 0.5);
  Parsed bad = Parse({"--rdzv_conf", "join_timout=5", "--", "true"});
  CHECK(bad.status.message() ==
        "--rdzv_conf: unknown key 'join_timout' (did you mean 'join_timeout'?)");
}

TEST_CASE("PlanResolvesPythonScriptsAndWorkerCount") {
  Parsed p = Parse({"--nproc_per_node", "3", "--python", "/bin/sh", "x.py", "arg"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent");
  REQUIRE(plan.ok());
  CHECK(plan->nproc_per_node == 3);
  // -u: unbuffered, as torchrun runs Python workers.
  CHECK(plan->argv == std::vector<std::string>{"/bin/sh", "-u", "x.py", "arg"});
  CHECK(plan->master_port > 0);
  CHECK(plan->extra_env.count("OMP_NUM_THREADS") + (std::getenv("OMP_NUM_THREADS") ? 1 : 0) >= 1);
}

TEST_CASE("PlanLogStreams") {
  Parsed p = Parse({"--nproc_per_node", "2", "--redirects", "0:3", "--tee", "1",
                    "--local_ranks_filter", "1", "--", "/bin/true"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent");
  REQUIRE(plan.ok());
  CHECK(plan->file_streams == std::vector<int>{3, 1});
  CHECK(plan->console_streams == std::vector<int>{0, 3});
  CHECK(plan->log_root.empty());  // a private directory, made when the job starts
  CHECK(plan->private_log_parent.find("/launch-logs-XXXXXX") != std::string::npos);
}

TEST_CASE("PlanRejectsMissingPrograms") {
  Parsed p = Parse({"--", "definitely-not-a-program-xyz"});
  REQUIRE(p.status.ok());
  StatusOr<Plan> plan = MakePlan(p.cfg, "/nonexistent");
  CHECK(plan.status().message() ==
        "cannot run the program: 'definitely-not-a-program-xyz' was not found on PATH");
  Parsed none = Parse({});
  REQUIRE(none.status.ok());
  CHECK(MakePlan(none.cfg, "/x").status().message().find("nothing to run") == 0);
}

}  // namespace
}  // namespace launch::launcher
