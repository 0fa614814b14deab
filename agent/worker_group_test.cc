// WorkerGroup with real processes (/bin/sh workers) on a real io_context.

#include "agent/worker_group.h"

#include <fcntl.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <csignal>
#include <optional>

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

struct Captured {
  int out_fd = -1;
  std::string path;
  Captured() {
    char tmpl[] = "/tmp/wg_test_XXXXXX";
    out_fd = mkstemp(tmpl);
    path = tmpl;
  }
  ~Captured() {
    close(out_fd);
    unlink(path.c_str());
  }
  std::string Read() const {
    std::string s;
    char buf[4096];
    int fd = open(path.c_str(), O_RDONLY);
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) s.append(buf, n);
    close(fd);
    return s;
  }
};

// `poke` is called between io_context slices until it returns true (bounded by the test's own
// worker lifetimes).
GroupResult RunGroup(WorkerGroupSpec spec, int stdout_fd,
                     std::function<bool(WorkerGroup&)> poke = {}) {
  boost::asio::io_context io;
  WorkerGroup g(io);
  spec.exec_shim = LAUNCH_EXEC_SHIM;
  spec.console_stdout_fd = stdout_fd;
  spec.console_stderr_fd = stdout_fd;
  std::optional<GroupResult> result;
  REQUIRE(g.Start(spec, [&](const GroupResult& r) { result = r; }).ok());
  bool poked = !poke;
  for (int i = 0; !result && i < 3000; ++i) {
    io.run_for(std::chrono::milliseconds(10));
    if (!poked) poked = poke(g);
  }
  REQUIRE(result.has_value());
  return *result;
}

WorkerGroupSpec Sh(const std::string& script, int n) {
  WorkerGroupSpec spec;
  spec.argv = {"/bin/sh", "-c", script};
  spec.local_world_size = n;
  spec.world_size = n;
  spec.base_env = {"PATH=/usr/bin:/bin"};
  spec.stop_grace = std::chrono::milliseconds(2000);
  return spec;
}

TEST_CASE("EveryWorkerGetsItsRankAndPrefixedOutput") {
  Captured cap;
  GroupResult r =
      RunGroup(Sh("echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE", 3), cap.out_fd);
  CHECK(r.outcome == GroupResult::Outcome::kSucceeded);
  std::string out = cap.Read();
  CHECK(out.find("[rank 0]: rank=0 local=0 world=3\n") != std::string::npos);
  CHECK(out.find("[rank 2]: rank=2 local=2 world=3\n") != std::string::npos);
}

TEST_CASE("FirstFailureIsTheRootCauseAndSiblingsAreStopped") {
  Captured cap;
  // rank 1 fails fast; rank 0 would sleep for a minute if not stopped.
  GroupResult r = RunGroup(
      Sh("if [ $RANK = 1 ]; then echo boom >&2; exit 3; else exec sleep 60; fi", 2), cap.out_fd);
  CHECK(r.outcome == GroupResult::Outcome::kFailed);
  REQUIRE(r.failures.size() == 2);
  CHECK(r.failures[0].rank == 1);
  CHECK(r.failures[0].status.code == 3);
  REQUIRE(r.failures[0].stderr_tail.size() == 1);
  CHECK(r.failures[0].stderr_tail[0] == "boom");
  CHECK(r.failures[1].rank == 0);
  CHECK(r.failures[1].stopped_by_agent);
  CHECK(r.failures[1].status.signaled);
  CHECK(r.failures[1].status.signal == SIGTERM);
}

TEST_CASE("StopEscalatesToSigkillAfterTheGrace") {
  Captured cap;
  WorkerGroupSpec spec = Sh("trap '' TERM; echo ready; while :; do sleep 0.05; done", 1);
  spec.stop_grace = std::chrono::milliseconds(300);
  std::chrono::steady_clock::time_point t0;
  GroupResult r = RunGroup(spec, cap.out_fd, [&](WorkerGroup& g) {
    if (cap.Read().find("ready") == std::string::npos) return false;
    t0 = std::chrono::steady_clock::now();
    g.Stop(SIGTERM);
    return true;
  });
  auto elapsed = std::chrono::steady_clock::now() - t0;
  CHECK(r.outcome == GroupResult::Outcome::kStopped);
  REQUIRE(r.exits.size() == 1);
  CHECK(r.exits[0].status.signal == SIGKILL);
  CHECK(elapsed >= std::chrono::milliseconds(300));
}

TEST_CASE("MissingShimFailsStartWithoutLeavingWorkers") {
  boost::asio::io_context io;
  WorkerGroup g(io);
  WorkerGroupSpec spec = Sh("sleep 60", 2);
  spec.exec_shim = "/nonexistent/launch-exec";
  Status s = g.Start(spec, [](const GroupResult&) {});
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("/nonexistent/launch-exec") != std::string::npos);
  CHECK_FALSE(g.running());
}

TEST_CASE("ContractEnvironmentIsComplete") {
  WorkerGroupSpec spec;
  spec.local_world_size = 2;
  spec.rank_offset = 4;
  spec.world_size = 8;
  spec.group_rank = 2;
  spec.group_world_size = 4;
  spec.master_addr = "10.0.0.1";
  spec.master_port = 1234;
  spec.restart_count = 1;
  spec.max_restarts = 3;
  spec.run_id = "job";
  auto env = ContractEnvironment(spec, 1);
  CHECK(env["RANK"] == "5");
  CHECK(env["LOCAL_RANK"] == "1");
  CHECK(env["WORLD_SIZE"] == "8");
  CHECK(env["LOCAL_WORLD_SIZE"] == "2");
  CHECK(env["GROUP_RANK"] == "2");
  CHECK(env["GROUP_WORLD_SIZE"] == "4");
  CHECK(env["ROLE_RANK"] == "5");
  CHECK(env["ROLE_NAME"] == "default");
  CHECK(env["ROLE_WORLD_SIZE"] == "8");
  CHECK(env["MASTER_ADDR"] == "10.0.0.1");
  CHECK(env["MASTER_PORT"] == "1234");
  CHECK(env["TORCHELASTIC_RESTART_COUNT"] == "1");
  CHECK(env["TORCHELASTIC_MAX_RESTARTS"] == "3");
  CHECK(env["TORCHELASTIC_RUN_ID"] == "job");
}

}  // namespace
}  // namespace launch::agent
