// The agent loop's restart, exit-code and signal rules, with a fake GroupSupervisor: no
// processes, no sleeping.

#include "agent/agent.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <csignal>

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

// Finishes each attempt with the next scripted result, or waits for Stop() when `hang`.
struct Script {
  explicit Script(std::vector<GroupResult> r, bool hang = false)
      : results(std::move(r)), hang_last(hang) {}
  std::vector<GroupResult> results;
  bool hang_last = false;
  std::vector<int> restart_counts;  // TORCHELASTIC_RESTART_COUNT seen per attempt
  std::vector<int> stops;           // signals passed to Stop()
  std::vector<int> forwarded;       // signals passed to Signal()
  std::function<void()> after_start;
};

class FakeGroup : public GroupSupervisor {
 public:
  FakeGroup(boost::asio::io_context& io, Script* script) : io_(io), script_(script) {}
  Status Start(const WorkerGroupSpec& spec,
               std::function<void(const GroupResult&)> on_done) override {
    on_done_ = std::move(on_done);
    size_t attempt = script_->restart_counts.size();
    script_->restart_counts.push_back(spec.restart_count);
    bool hang = script_->hang_last && attempt + 1 >= script_->results.size();
    if (!hang) {
      GroupResult r = script_->results.at(attempt);
      boost::asio::post(io_, [this, r] { on_done_(r); });
    }
    if (script_->after_start) script_->after_start();
    return Status::Ok();
  }
  void Signal(int signo) override {
    script_->forwarded.push_back(signo);
    // Like a trainer that checkpoints on SIGUSR1 and exits cleanly.
    boost::asio::post(io_, [this] { on_done_(GroupResult{}); });
  }
  void Stop(int signo) override {
    script_->stops.push_back(signo);
    GroupResult r;
    r.outcome = GroupResult::Outcome::kStopped;
    boost::asio::post(io_, [this, r] { on_done_(r); });
  }
  void Kill() override {}

 private:
  boost::asio::io_context& io_;
  Script* script_;
  std::function<void(const GroupResult&)> on_done_;
};

GroupResult Failed(int rank, int code, int signal = 0) {
  GroupResult r;
  r.outcome = GroupResult::Outcome::kFailed;
  WorkerExit e;
  e.rank = rank;
  e.status.code = code;
  e.status.signaled = signal != 0;
  e.status.signal = signal;
  r.failures.push_back(e);
  return r;
}

GroupResult Succeeded() { return GroupResult{}; }

int Run(Script* script, int max_restarts) {
  boost::asio::io_context io;
  AgentOptions opts;
  opts.max_restarts = max_restarts;
  return RunLocalAgent(opts, io, [script](boost::asio::io_context& ctx) {
    return std::unique_ptr<GroupSupervisor>(new FakeGroup(ctx, script));
  });
}

TEST_CASE("SuccessExitsZeroWithoutRestart") {
  Script s{{Succeeded()}};
  CHECK(Run(&s, 3) == 0);
  CHECK(s.restart_counts == std::vector<int>{0});
}

TEST_CASE("FailuresRestartTheGroupWithIncreasingRestartCount") {
  Script s{{Failed(1, 3), Failed(0, 4), Succeeded()}};
  CHECK(Run(&s, 2) == 0);
  CHECK(s.restart_counts == std::vector<int>{0, 1, 2});
}

TEST_CASE("ExhaustedRestartsReturnTheRootCauseCode") {
  Script s{{Failed(1, 3), Failed(0, 4)}};
  CHECK(Run(&s, 1) == 4);
  CHECK(s.restart_counts == std::vector<int>{0, 1});
}

TEST_CASE("SignalDeathMapsTo128PlusSignal") {
  Script s{{Failed(1, 0, SIGSEGV)}};
  CHECK(Run(&s, 0) == 128 + SIGSEGV);
}

TEST_CASE("SigtermStopsTheGroupAndIsNotRestarted") {
  Script s{{Succeeded()}, /*hang_last=*/true};
  s.after_start = [] { std::raise(SIGTERM); };
  CHECK(Run(&s, 5) == 128 + SIGTERM);
  CHECK(s.stops == std::vector<int>{SIGTERM});
  CHECK(s.restart_counts.size() == 1);
}

TEST_CASE("Sigusr1IsForwardedWithoutStopping") {
  Script s{{Succeeded()}, /*hang_last=*/true};
  s.after_start = [] { std::raise(SIGUSR1); };
  CHECK(Run(&s, 0) == 0);
  CHECK(s.forwarded == std::vector<int>{SIGUSR1});
  CHECK(s.stops.empty());
}

}  // namespace
}  // namespace launch::agent
