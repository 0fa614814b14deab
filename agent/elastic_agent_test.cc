// The multi-node loop with a fake worker group (no processes) and the real rendezvous server
// the agent hosts on 127.0.0.1.

#include "agent/elastic_agent.h"

#include <doctest/doctest.h>

#include <boost/asio.hpp>
#include <vector>

namespace launch::agent {
namespace {

namespace asio = boost::asio;

int FreePort() {
  asio::io_context io;
  asio::ip::tcp::acceptor a(io, {asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

// Each Start() ends with the next scripted result (posted, as real workers end later).
struct Script {
  std::vector<GroupResult> results;
  std::vector<WorkerGroupSpec> started;
};

class FakeGroup : public GroupSupervisor {
 public:
  FakeGroup(asio::io_context& io, Script* script) : io_(io), script_(script) {}
  Status Start(const WorkerGroupSpec& spec,
               std::function<void(const GroupResult&)> on_done) override {
    size_t i = script_->started.size();
    script_->started.push_back(spec);
    GroupResult r = i < script_->results.size() ? script_->results[i] : GroupResult{};
    asio::post(io_, [r, on_done] { on_done(r); });
    return Status::Ok();
  }
  void Signal(int) override {}
  void Stop(int) override {}
  void Kill() override {}

 private:
  asio::io_context& io_;
  Script* script_;
};

GroupResult Failed(int rank, int code, int signal = 0) {
  GroupResult r;
  r.outcome = GroupResult::Outcome::kFailed;
  WorkerExit e;
  e.rank = rank;
  e.local_rank = rank;
  e.status.signaled = signal != 0;
  e.status.code = code;
  e.status.signal = signal;
  e.stderr_tail = {"boom"};
  r.failures.push_back(e);
  r.exits.push_back(e);
  return r;
}

ElasticAgentOptions OneNode(int max_restarts) {
  ElasticAgentOptions o;
  o.endpoint_host = "127.0.0.1";
  o.endpoint_port = FreePort();
  o.node_rank = 0;
  o.min_nodes = o.max_nodes = 1;
  o.max_restarts = max_restarts;
  o.join_timeout_s = 5;
  o.local.group.local_world_size = 2;
  o.local.group.argv = {"/bin/true"};
  return o;
}

int Run(const ElasticAgentOptions& o, Script* script) {
  asio::io_context io;
  return RunElasticAgent(o, io, [script](asio::io_context& ctx) {
    return std::unique_ptr<GroupSupervisor>(new FakeGroup(ctx, script));
  });
}

TEST_CASE("ElasticAgentRunsTheAssignedRanksAndExitsZeroOnSuccess") {
  Script script;
  CHECK(Run(OneNode(0), &script) == 0);
  REQUIRE(script.started.size() == 1);
  const WorkerGroupSpec& s = script.started[0];
  CHECK(s.local_world_size == 2);
  CHECK(s.world_size == 2);
  CHECK(s.rank_offset == 0);
  CHECK(s.group_rank == 0);
  CHECK(s.group_world_size == 1);
  CHECK(s.master_addr == "127.0.0.1");
  CHECK(s.master_port > 0);
  CHECK(s.restart_count == 0);
}

TEST_CASE("ElasticAgentRestartsThroughTheRendezvousThenSucceeds") {
  Script script;
  script.results = {Failed(1, 3), GroupResult{}};
  CHECK(Run(OneNode(1), &script) == 0);
  REQUIRE(script.started.size() == 2);
  CHECK(script.started[0].restart_count == 0);
  CHECK(script.started[1].restart_count == 1);
  CHECK(script.started[1].max_restarts == 1);
}

TEST_CASE("ElasticAgentExitsWithTheRootCauseCodeWhenNoRestartsRemain") {
  Script script;
  script.results = {Failed(1, 3)};
  CHECK(Run(OneNode(0), &script) == 3);
  Script killed;
  killed.results = {Failed(0, 0, 9)};
  CHECK(Run(OneNode(0), &killed) == 128 + 9);
}

TEST_CASE("ElasticAgentTreatsAnUnreachableEndpointAsASetupError") {
  Script script;
  ElasticAgentOptions o = OneNode(0);
  o.node_rank = 1;  // not the host, and nobody else is
  o.min_nodes = o.max_nodes = 2;
  o.join_timeout_s = 0.3;
  CHECK(Run(o, &script) == 2);
  CHECK(script.started.empty());
}

}  // namespace
}  // namespace launch::agent
