// WorkerGroup with real processes (/bin/sh workers) on a real io_context.

#include "agent/worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>

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
    // A group waiting for a decision has nothing for the context to do: it ran out of work.
    if (io.stopped()) io.restart();
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

TEST_CASE("AStoppedWorkerIsContinuedToActOnTheStopSignal") {
  Captured cap;
  // The worker stops itself; SIGTERM alone would stay pending until the grace's SIGKILL.
  WorkerGroupSpec spec = Sh("echo ready $$; kill -STOP $$; exec sleep 60", 1);
  spec.stop_grace = std::chrono::milliseconds(20000);
  GroupResult r = RunGroup(spec, cap.out_fd, [&](WorkerGroup& g) {
    const std::string out = cap.Read();
    const size_t at = out.find("ready ");
    if (at == std::string::npos) return false;
    const std::string pid = out.substr(at + 6, out.find('\n', at) - at - 6);
    char state = 0;
    if (FILE* f = std::fopen(("/proc/" + pid + "/stat").c_str(), "r")) {
      // "pid (comm) S ...": the state follows the command's closing parenthesis.
      char line[512] = {0};
      if (std::fgets(line, sizeof line, f)) {
        const char* close = std::strrchr(line, ')');
        if (close && close[1] == ' ') state = close[2];
      }
      std::fclose(f);
    }
    if (state != 'T') return false;
    g.Stop(SIGTERM);
    return true;
  });
  CHECK(r.outcome == GroupResult::Outcome::kStopped);
  REQUIRE(r.exits.size() == 1);
  CHECK(r.exits[0].status.signal == SIGTERM);
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

// A console pipe the test reads only when told to (a reader that stopped, then resumed).
struct StalledConsole {
  int r = -1, w = -1;
  std::mutex mu;
  std::string data;  // guarded by mu
  std::thread reader;
  StalledConsole() {
    int fds[2];
    REQUIRE(::pipe2(fds, O_CLOEXEC) == 0);
    r = fds[0];
    w = fds[1];
  }
  void Resume() {
    reader = std::thread([this] {
      char buf[65536];
      ssize_t n;
      while ((n = ::read(r, buf, sizeof buf)) > 0) {
        std::lock_guard<std::mutex> lock(mu);
        data.append(buf, static_cast<size_t>(n));
      }
    });
  }
  size_t Count(char c) {
    std::lock_guard<std::mutex> lock(mu);
    return static_cast<size_t>(std::count(data.begin(), data.end(), c));
  }
  // Joins the reader after closing our write end, the only one (the console writer writes
  // through it: call once everything was written).
  std::string Finish() {
    ::close(w);
    w = -1;
    if (reader.joinable()) reader.join();
    return data;
  }
  ~StalledConsole() {
    if (w >= 0) ::close(w);
    if (reader.joinable()) reader.join();
    ::close(r);
  }
};

TEST_CASE("AFullConsolePausesTheWorkerNotTheLoop") {
  StalledConsole console;
  boost::asio::io_context io;
  WorkerGroup g(io);
  // 40000 lines of 100 bytes: far more than the pipe and the console writer's queue hold.
  WorkerGroupSpec spec = Sh("head -c 4000000 /dev/zero | tr '\\0' x | fold -w 100", 1);
  spec.exec_shim = LAUNCH_EXEC_SHIM;
  spec.console_stdout_fd = spec.console_stderr_fd = console.w;
  std::optional<GroupResult> result;
  REQUIRE(g.Start(spec, [&](const GroupResult& r) { result = r; }).ok());
  // While nobody reads, the loop keeps its timers on time and the worker waits in its write.
  int ticks = 0;
  boost::asio::steady_timer tick(io);
  std::function<void()> arm = [&] {
    tick.expires_after(std::chrono::milliseconds(10));
    tick.async_wait([&](boost::system::error_code ec) {
      if (ec) return;
      ++ticks;
      arm();
    });
  };
  arm();
  io.run_for(std::chrono::milliseconds(600));
  CHECK(ticks >= 40);
  CHECK_FALSE(result.has_value());
  CHECK(g.running());
  tick.cancel();
  console.Resume();
  for (int i = 0; !result && i < 3000; ++i) io.run_for(std::chrono::milliseconds(10));
  REQUIRE(result.has_value());
  CHECK(result->outcome == GroupResult::Outcome::kSucceeded);
  std::string out = console.Finish();
  const std::string line = "[rank 0]: " + std::string(100, 'x') + "\n";
  CHECK(out.size() == 40000 * line.size());
  bool all_whole = true;
  for (size_t at = 0; at + line.size() <= out.size() && all_whole; at += line.size())
    all_whole = out.compare(at, line.size(), line) == 0;
  CHECK(all_whole);
}

TEST_CASE("TheOutcomeWaitsForTheConsoleOnlyUntilStopGrace") {
  StalledConsole console;
  // 300 KiB: the pipe and the console writer's queue take it all, so the worker exits; its
  // output is then unwritten until the console reads, which it does not within stop_grace.
  WorkerGroupSpec spec = Sh("head -c 307200 /dev/zero | tr '\\0' y | fold -w 1023", 1);
  spec.stop_grace = std::chrono::milliseconds(300);
  const auto t0 = std::chrono::steady_clock::now();
  GroupResult r = RunGroup(spec, console.w);
  const auto elapsed = std::chrono::steady_clock::now() - t0;
  CHECK(r.outcome == GroupResult::Outcome::kSucceeded);
  CHECK(elapsed >= std::chrono::milliseconds(300));
  CHECK(elapsed < std::chrono::milliseconds(5000));
  // Not dropped: it is still queued and arrives once the console reads again.
  console.Resume();
  const std::string line = "[rank 0]: " + std::string(1023, 'y') + "\n";
  bool arrived = false;
  for (int i = 0; i < 500 && !arrived; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    arrived = console.Count('y') == 307200;
  }
  CHECK(arrived);
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

// What the trainer does once it can be recovered in place (base/collective_ring.h).
constexpr const char* kDeclareInPlace = "touch \"$LAUNCH_COLLECTIVE_RING.in_place\"";

TEST_CASE("ADeadWorkerIsReplacedInPlaceWhileItsSiblingsGoOn") {
  // Rank 1's first worker says it can be recovered in place (as the trainer does once its group
  // formed), then dies by SIGKILL; its replacement (LAUNCH_RECOVER_GENERATION=1) and the
  // sibling, which is still the first process, finish. The sibling waits for it (a file).
  Captured cap;
  char dir[] = "/tmp/wg_replace_XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string flag = std::string(dir) + "/replaced";
  const std::string rank1 = "if [ -z \"$LAUNCH_RECOVER_GENERATION\" ]; then " +
                            std::string(kDeclareInPlace) +
                            "; kill -9 $$; fi; echo $LAUNCH_RECOVER_GENERATION > " + flag;
  const std::string rank0 = "i=0; while [ ! -e " + flag +
                            " ] && [ $i -lt 500 ]; do sleep 0.01; i=$((i+1)); done; echo sibling";
  WorkerGroupSpec spec = Sh("if [ \"$RANK\" = 1 ]; then " + rank1 + "; else " + rank0 + "; fi", 2);
  std::vector<WorkerExit> asked;
  spec.replace_in_place = [&](const WorkerExit& e, WorkerGroupSpec::ReplaceDecision decide) {
    asked.push_back(e);
    decide(1);
  };
  GroupResult r = RunGroup(spec, cap.out_fd);
  CHECK(r.outcome == GroupResult::Outcome::kSucceeded);
  REQUIRE(asked.size() == 1);
  CHECK(asked[0].rank == 1);
  CHECK(asked[0].status.signaled);
  REQUIRE(r.replaced.size() == 1);
  CHECK(r.replaced[0].rank == 1);
  CHECK(r.failures.empty());
  CHECK(r.exits.size() == 3);  // rank 0 once, rank 1 twice
  std::string out = cap.Read();
  CHECK(out.find("[rank 0]: sibling") != std::string::npos);
  std::string generation;
  if (FILE* f = std::fopen(flag.c_str(), "r")) {
    char line[16] = {};
    if (std::fgets(line, sizeof line, f)) generation = line;
    std::fclose(f);
  }
  CHECK(generation == "1\n");
  unlink(flag.c_str());
  rmdir(dir);
}

// Runs two workers whose rank 1 ends by `rank1` under an agent that would replace it; the
// group's result and how often the agent was asked.
std::pair<GroupResult, int> RunAskingToReplace(const std::string& rank1) {
  Captured cap;
  WorkerGroupSpec spec = Sh("if [ \"$RANK\" = 1 ]; then " + rank1 + "; fi; sleep 5", 2);
  int asked = 0;
  spec.replace_in_place = [&](const WorkerExit&, WorkerGroupSpec::ReplaceDecision decide) {
    ++asked;
    decide(1);
  };
  GroupResult r = RunGroup(spec, cap.out_fd);
  return {std::move(r), asked};
}

TEST_CASE("ADeadWorkerThatNeverSaidItCanBeRecoveredInPlaceRestartsTheGroupWithoutAsking") {
  // Killed before it declared itself (its group not formed, or a mode with state on each rank
  // alone): nothing is asked, the group fails at once and the log says why.
  auto [r, asked] = RunAskingToReplace("kill -9 $$");
  CHECK(r.outcome == GroupResult::Outcome::kFailed);
  CHECK(asked == 0);
  CHECK(r.replaced.empty());
  REQUIRE(!r.failures.empty());
  CHECK(r.failures[0].status.signal == SIGKILL);
}

TEST_CASE("AWorkerThatExitsWithACodeIsNotReplacedInPlace") {
  // A code of its own means it gave up: the group stops as always, without asking.
  auto [r, asked] = RunAskingToReplace("exit 3");
  CHECK(r.outcome == GroupResult::Outcome::kFailed);
  CHECK(asked == 0);
  CHECK(r.replaced.empty());
  REQUIRE(!r.failures.empty());
  CHECK(r.failures[0].status.code == 3);
}

TEST_CASE("ADeadWorkerIsNotReplacedWhenTheAgentSaysNo") {
  Captured cap;
  WorkerGroupSpec spec =
      Sh("if [ \"$RANK\" = 1 ]; then " + std::string(kDeclareInPlace) + "; kill -9 $$; fi; sleep 5",
         2);
  spec.replace_in_place = [](const WorkerExit&, WorkerGroupSpec::ReplaceDecision decide) {
    decide(0);
  };
  GroupResult r = RunGroup(spec, cap.out_fd);
  CHECK(r.outcome == GroupResult::Outcome::kFailed);
  CHECK(r.replaced.empty());
  REQUIRE(!r.failures.empty());
  CHECK(r.failures[0].status.signal == SIGKILL);
}

TEST_CASE("ADeadWorkersSlotStaysPendingUntilTheAgentDecides") {
  // The only worker dies; the group must not end before the (later) answer, whose generation
  // the replacement gets. The answer comes from the poke, after the worker is gone.
  Captured cap;
  WorkerGroupSpec spec =
      Sh("if [ -z \"$LAUNCH_RECOVER_GENERATION\" ]; then " + std::string(kDeclareInPlace) +
             "; kill -9 $$; fi; echo generation $LAUNCH_RECOVER_GENERATION",
         1);
  WorkerGroupSpec::ReplaceDecision later;
  spec.replace_in_place = [&](const WorkerExit&, WorkerGroupSpec::ReplaceDecision decide) {
    later = std::move(decide);
  };
  bool group_ran_out = false;
  GroupResult r = RunGroup(spec, cap.out_fd, [&](WorkerGroup& g) {
    if (!later) return false;
    group_ran_out = !g.running();  // the dead worker is reaped and nothing else runs
    later(7);
    later(0);  // a second answer changes nothing
    return true;
  });
  CHECK(group_ran_out);
  CHECK(r.outcome == GroupResult::Outcome::kSucceeded);
  REQUIRE(r.replaced.size() == 1);
  CHECK(r.failures.empty());
  CHECK(cap.Read().find("[rank 0]: generation 7") != std::string::npos);
}

TEST_CASE("AGroupStartedWithARecoverGenerationGivesItToEveryWorker") {
  // A node that takes a lost node's place: every worker joins generation 4's recovery.
  Captured cap;
  WorkerGroupSpec spec = Sh("echo rank $RANK generation $LAUNCH_RECOVER_GENERATION", 2);
  spec.recover_generation = 4;
  GroupResult r = RunGroup(spec, cap.out_fd);
  CHECK(r.outcome == GroupResult::Outcome::kSucceeded);
  const std::string out = cap.Read();
  CHECK(out.find("rank 0 generation 4") != std::string::npos);
  CHECK(out.find("rank 1 generation 4") != std::string::npos);
}

}  // namespace launch::agent
