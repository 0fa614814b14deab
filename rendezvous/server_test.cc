// Rendezvous behaviour with real clients and a real server over loopback TCP, all on one
// io_context (no threads, no sleeps: the test drives the io_context).

#include "rendezvous/server.h"

#include <doctest/doctest.h>

#include "rendezvous/test_util.h"

namespace launch::rendezvous {
namespace {

using namespace testing;
using std::chrono::milliseconds;

bool Contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

TEST_CASE("TwoNodesGetRanksOffsetsAndMasterFromNodeZero") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 1, 3, "hostA"));
  Recorder& b = h.AddClient(Join(2, 2, -1, 2, "hostB"));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  const Assignment& x = a.assignments[0];
  const Assignment& y = b.assignments[0];
  CHECK(x.node_rank == 1);  // explicit rank honoured
  CHECK(y.node_rank == 0);  // the free rank assigned
  CHECK(x.num_nodes == 2);
  CHECK(x.world_size == 5);
  CHECK(y.rank_offset == 0);
  CHECK(y.local_world_size == 2);
  CHECK(x.rank_offset == 2);  // after node 0's two workers
  CHECK(x.local_world_size == 3);
  CHECK(x.master_addr == "127.0.0.1");
  CHECK(x.master_port == 30999);  // hostB (node 0) reserved it
  CHECK(y.master_port == 30999);
  CHECK(x.round == 0);
  REQUIRE(x.nodes.size() == 2);
  CHECK(x.nodes[0].host == "hostB");
}

TEST_CASE("StaticJobClosesTheMomentTheLastNodeArrives") {
  Harness h;
  JoinRequest j = Join(3, 3, -1);
  j.last_call_timeout_s = 10;  // must not matter when MIN == MAX
  std::vector<Recorder*> rs;
  for (int i = 0; i < 3; ++i) rs.push_back(&h.AddClient(j));
  auto start = Clock::now();
  REQUIRE(RunUntil(h.io, [&] {
    for (auto* r : rs)
      if (r->assignments.empty()) return false;
    return true;
  }));
  CHECK(Clock::now() - start < milliseconds(2000));
  std::vector<int> ranks;
  for (auto* r : rs) ranks.push_back(r->assignments[0].node_rank);
  std::sort(ranks.begin(), ranks.end());
  CHECK(ranks == std::vector<int>{0, 1, 2});
}

TEST_CASE("DuplicateRankFailsBothAgentsNamingBothHosts") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 0, 1, "alpha"));
  REQUIRE(RunUntil(h.io, [&] { return h.LogContains("first agent"); }));
  Recorder& b = h.AddClient(Join(2, 2, 0, 1, "beta"));
  REQUIRE(RunUntil(h.io, [&] { return a.finished() && b.finished(); }));
  for (Recorder* r : {&a, &b}) {
    REQUIRE(r->failed.has_value());
    CHECK(r->failed->code() == Status::Code::kInvalidConfig);
    CHECK(Contains(r->failed->message(), "duplicate machine_rank 0"));
    CHECK(Contains(r->failed->message(), "alpha"));
    CHECK(Contains(r->failed->message(), "beta"));
  }
}

TEST_CASE("MismatchedRunIdFailsNamingTheFieldAndBothValues") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 0, 1, "alpha"));
  REQUIRE(RunUntil(h.io, [&] { return h.LogContains("first agent"); }));
  JoinRequest other = Join(2, 2, 1, 1, "beta");
  other.run_id = "other";
  Recorder& b = h.AddClient(other);
  REQUIRE(RunUntil(h.io, [&] { return a.finished() && b.finished(); }));
  REQUIRE(b.failed.has_value());
  CHECK(Contains(b.failed->message(), "run_id mismatch"));
  CHECK(Contains(b.failed->message(), "'other'"));
  CHECK(Contains(b.failed->message(), "'test'"));
  REQUIRE(a.failed.has_value());  // the waiting agent does not wait for its timeout
  CHECK(a.failed->code() == Status::Code::kInvalidConfig);
}

TEST_CASE("MismatchedWorldSizeSpecAndFingerprintAreNamed") {
  Harness h;
  h.AddClient(Join(2, 2, 0));
  REQUIRE(RunUntil(h.io, [&] { return h.LogContains("first agent"); }));
  Recorder& b = h.AddClient(Join(3, 3, 1));
  REQUIRE(RunUntil(h.io, [&] { return b.finished(); }));
  CHECK(Contains(b.failed->message(), "num_machines (nnodes) mismatch"));
  CHECK(Contains(b.failed->message(), "has 3 but"));

  Harness h2;
  h2.AddClient(Join(2, 2, 0));
  REQUIRE(RunUntil(h2.io, [&] { return h2.LogContains("first agent"); }));
  JoinRequest j = Join(2, 2, 1);
  j.fingerprint = "different";
  Recorder& c = h2.AddClient(j);
  REQUIRE(RunUntil(h2.io, [&] { return c.finished(); }));
  CHECK(Contains(c.failed->message(), "config fingerprint mismatch"));
}

TEST_CASE("JoinTimeoutFailsEveryWaitingAgentListingMissingRanks") {
  Harness h;
  JoinRequest j = Join(3, 3, 0, 1, "alpha");
  j.join_timeout_s = 0.3;
  Recorder& a = h.AddClient(j);
  JoinRequest k = j;
  k.node_rank = 2;
  k.hostname = "gamma";
  Recorder& c = h.AddClient(k);
  auto start = Clock::now();
  REQUIRE(RunUntil(h.io, [&] { return a.finished() && c.finished(); }));
  CHECK(Clock::now() - start < milliseconds(2000));
  for (Recorder* r : {&a, &c}) {
    REQUIRE(r->failed.has_value());
    CHECK(r->failed->code() == Status::Code::kInvalidConfig);
    CHECK(Contains(r->failed->message(), "2 of 3 nodes joined"));
    CHECK(Contains(r->failed->message(), "unclaimed node ranks: 1"));
  }
}

TEST_CASE("ElasticJobWaitsTheLastCallThenClosesWithWhatCame") {
  Harness h;
  JoinRequest j = Join(2, 4, -1);
  j.last_call_timeout_s = 0.3;
  Recorder& a = h.AddClient(j);
  Recorder& b = h.AddClient(j);
  auto start = Clock::now();
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  auto took = Clock::now() - start;
  CHECK(took >= milliseconds(280));
  CHECK(took < milliseconds(2000));
  CHECK(a.assignments[0].num_nodes == 2);
}

TEST_CASE("ElasticJobClosesAtOnceWhenMaxArrive") {
  Harness h;
  JoinRequest j = Join(1, 2, -1);
  j.last_call_timeout_s = 5;
  Recorder& a = h.AddClient(j);
  Recorder& b = h.AddClient(j);
  auto start = Clock::now();
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  CHECK(Clock::now() - start < milliseconds(2000));
  CHECK(a.assignments[0].num_nodes == 2);
}

TEST_CASE("WorkerFailureRestartsEveryNodeWithTheRootCauseThenJobCompletes") {
  Harness h;
  JoinRequest j = Join(2, 2, -1, 2);
  j.max_restarts = 1;
  Recorder& a = h.AddClient(j);
  Recorder& b = h.AddClient(j);
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  FailureReport r;
  r.round = 0;
  r.global_rank = a.assignments[0].rank_offset + 1;
  r.local_rank = 1;
  r.exit_code = 7;
  r.reason = "exited with code 7";
  r.stderr_tail = "Traceback\nValueError: boom";
  a.client->ReportFailure(r);
  REQUIRE(RunUntil(h.io, [&] { return a.assignments.size() == 2 && b.assignments.size() == 2; }));
  REQUIRE(b.restarts.size() == 1);
  CHECK(b.restarts[0].counts_as_restart);
  REQUIRE(b.restarts[0].report.has_value());
  CHECK(b.restarts[0].report->exit_code == 7);
  CHECK(b.restarts[0].report->stderr_tail == "Traceback\nValueError: boom");
  CHECK(b.restarts[0].report->node_rank == a.assignments[0].node_rank);
  CHECK(a.assignments[1].round == 1);
  CHECK(a.assignments[1].restart_count == 1);
  a.client->ReportSuccess(1);
  REQUIRE(
      RunUntil(h.io, [&] { return h.server->state() == RendezvousServer::JobState::kRunning; }));
  CHECK_FALSE(b.done);
  b.client->ReportSuccess(1);
  REQUIRE(RunUntil(h.io, [&] { return a.done && b.done; }));
  // Once everyone is gone the server forgets the job.
  REQUIRE(RunUntil(h.io, [&] { return h.server->state() == RendezvousServer::JobState::kIdle; }));
}

TEST_CASE("FailureWithNoRestartsLeftFailsEveryNodeWithTheSameReport") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 0));
  Recorder& b = h.AddClient(Join(2, 2, 1));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  FailureReport r;
  r.global_rank = 1;
  r.local_rank = 0;
  r.signal = 11;
  b.client->ReportFailure(r);
  REQUIRE(RunUntil(h.io, [&] { return a.finished() && b.finished(); }));
  for (Recorder* x : {&a, &b}) {
    REQUIRE(x->failed.has_value());
    CHECK(x->failed->code() == Status::Code::kWorkerFailed);
    CHECK(Contains(x->failed->message(), "no restarts left"));
    REQUIRE(x->failure->report.has_value());
    CHECK(x->failure->report->signal == 11);
  }
  CHECK(FormatFailureReport(*a.failure->report) == FormatFailureReport(*b.failure->report));
}

TEST_CASE("TheEarliestFailureIsTheRootCauseEvenWhenItsReportArrivesSecond") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 0));
  Recorder& b = h.AddClient(Join(2, 2, 1));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  const int64_t now = WallClockMicros();
  FailureReport collateral;
  collateral.global_rank = 1;
  collateral.exit_code = 7;
  collateral.reason = "exited with code 7";
  collateral.time_us = now;
  FailureReport root;
  root.global_rank = 0;
  root.exit_code = 3;
  root.reason = "exited with code 3";
  root.time_us = now - 500000;  // half a second earlier, reported later
  b.client->ReportFailure(collateral);
  a.client->ReportFailure(root);
  REQUIRE(RunUntil(h.io, [&] { return a.finished() && b.finished(); }));
  for (Recorder* x : {&a, &b}) {
    REQUIRE(x->failure.has_value());
    REQUIRE(x->failure->report.has_value());
    CHECK(x->failure->report->exit_code == 3);
    CHECK(x->failure->report->global_rank == 0);
    CHECK(x->failure->report->time_us == root.time_us);
  }
}

TEST_CASE("LostAgentStartsANewRoundAtMinNodes") {
  Harness h;
  JoinRequest j = Join(2, 3, -1);
  j.max_restarts = 1;
  j.last_call_timeout_s = 0;
  std::vector<Recorder*> rs;
  for (int i = 0; i < 3; ++i) rs.push_back(&h.AddClient(j));
  REQUIRE(RunUntil(h.io, [&] {
    for (auto* r : rs)
      if (r->assignments.empty()) return false;
    return true;
  }));
  // Depending on timing the first round may have closed with 2 or 3; wait for 3.
  REQUIRE(RunUntil(h.io, [&] {
    for (auto* r : rs)
      if (r->assignments.back().num_nodes != 3) return false;
    return true;
  }));
  size_t before = rs[0]->restarts.size();
  rs[2]->client->Close();  // the socket closes like a SIGKILLed agent's
  auto start = Clock::now();
  REQUIRE(RunUntil(h.io, [&] {
    return rs[0]->restarts.size() > before && rs[0]->assignments.back().num_nodes == 2 &&
           rs[1]->assignments.back().num_nodes == 2;
  }));
  CHECK(Clock::now() - start < milliseconds(1000));
  CHECK(Contains(rs[0]->restarts.back().reason, "lost node"));
  REQUIRE(rs[0]->restarts.back().report.has_value());
  CHECK(Contains(rs[0]->restarts.back().report->reason, "node lost"));
}

TEST_CASE("LostAgentBelowMinFailsTheSurvivorsWhenNoReplacementComes") {
  Harness h;
  JoinRequest j = Join(2, 2, -1);
  j.max_restarts = 5;
  j.join_timeout_s = 0.5;
  Recorder& a = h.AddClient(j);
  Recorder& b = h.AddClient(j);
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  b.client->Close();
  REQUIRE(RunUntil(h.io, [&] { return a.finished(); }));
  REQUIRE(a.failed.has_value());
  CHECK(Contains(a.failed->message(), "no replacement node joined"));
  REQUIRE(a.restarts.size() == 1);  // the survivor was told to wait
  CHECK(Contains(a.restarts[0].reason, "waiting up to"));
  REQUIRE(a.failure->report.has_value());  // the root cause travels with the failure
  CHECK(Contains(a.failure->report->reason, "node lost"));
}

TEST_CASE("LostAgentBelowMinIsReplacedByANewAgentAndTheJobGoesOn") {
  Harness h;
  JoinRequest j = Join(2, 2, -1);
  j.max_restarts = 5;
  Recorder& a = h.AddClient(j);
  Recorder& b = h.AddClient(j);
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  const int lost_rank = b.assignments[0].node_rank;
  b.client->Close();
  REQUIRE(RunUntil(h.io, [&] { return a.restarts.size() == 1; }));
  JoinRequest replacement = j;
  replacement.node_rank = lost_rank;  // takes the lost node's place
  Recorder& c = h.AddClient(replacement);
  REQUIRE(RunUntil(h.io, [&] { return a.assignments.size() == 2 && !c.assignments.empty(); }));
  CHECK(c.assignments[0].node_rank == lost_rank);
  CHECK(c.assignments[0].restart_count == 1);
  a.client->ReportSuccess(1);
  c.client->ReportSuccess(1);
  REQUIRE(RunUntil(h.io, [&] { return a.done && c.done; }));
}

TEST_CASE("LateNodeScalesUpWithoutSpendingARestart") {
  Harness h;
  JoinRequest j = Join(1, 2, -1);
  j.last_call_timeout_s = 0;
  Recorder& a = h.AddClient(j);
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty(); }));
  CHECK(a.assignments[0].num_nodes == 1);
  Recorder& b = h.AddClient(j);
  REQUIRE(RunUntil(h.io, [&] { return a.assignments.size() == 2 && !b.assignments.empty(); }));
  REQUIRE(a.restarts.size() == 1);
  CHECK_FALSE(a.restarts[0].counts_as_restart);
  CHECK(Contains(a.restarts[0].reason, "scale-up"));
  CHECK(a.assignments[1].num_nodes == 2);
  CHECK(a.assignments[1].restart_count == 0);
  CHECK(b.restarts.empty());
}

TEST_CASE("ClientRetriesUntilTheServerStartsLater") {
  asio::io_context probe;
  asio::ip::tcp::acceptor a(probe, {asio::ip::make_address("127.0.0.1"), 0});
  int port = a.local_endpoint().port();
  a.close();
  ServerOptions options;
  options.port = port;
  // The harness's server listens at once; start a client against a second, later server.
  Harness h;
  JoinRequest j = Join(1, 1, -1);
  Recorder& r = h.AddClient(j, "", true, port);
  RunUntil(
      h.io, [] { return false; }, milliseconds(300));
  CHECK_FALSE(r.finished());
  CHECK(r.assignments.empty());
  options.host = "127.0.0.1";
  auto late = RendezvousServer::Create(h.io, options);
  REQUIRE(late->Listen().ok());
  REQUIRE(RunUntil(h.io, [&] { return !r.assignments.empty(); }));
  r.client->Close();
  late->Stop();
}

TEST_CASE("UnreachableEndpointFailsAfterJoinTimeoutNamingTheAddress") {
  asio::io_context probe;
  asio::ip::tcp::acceptor a(probe, {asio::ip::make_address("127.0.0.1"), 0});
  int port = a.local_endpoint().port();
  a.close();
  Harness h;
  JoinRequest j = Join(1, 1, -1);
  j.join_timeout_s = 0.3;
  Recorder& r = h.AddClient(j, "", true, port);
  REQUIRE(RunUntil(h.io, [&] { return r.finished(); }));
  REQUIRE(r.failed.has_value());
  CHECK(r.failed->code() == Status::Code::kTimeout);
  CHECK(Contains(r.failed->message(), "127.0.0.1:" + std::to_string(port)));
}

TEST_CASE("PortInUseIsOneLineNamingTheAddress") {
  Harness h;
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = h.server->port();
  auto second = RendezvousServer::Create(h.io, options);
  Status s = second->Listen();
  CHECK(s.code() == Status::Code::kIoError);
  CHECK(s.message() ==
        "rendezvous port 127.0.0.1:" + std::to_string(h.server->port()) + " is already in use");
}

TEST_CASE("Ipv6LoopbackWorks") {
  asio::io_context io;
  ServerOptions so;
  so.host = "::1";
  so.port = 0;
  auto server = RendezvousServer::Create(io, so);
  Status listen = server->Listen();
  if (!listen.ok()) {
    MESSAGE("no IPv6 loopback here: " << listen.message());
    return;
  }
  ClientOptions co;
  co.host = "::1";
  co.port = server->port();
  co.join = Join(1, 1, -1);
  std::optional<Assignment> got;
  ClientEvents ev;
  ev.on_assigned = [&](const Assignment& a) { got = a; };
  auto client = RendezvousClient::Create(io, co, ev);
  client->Start();
  REQUIRE(RunUntil(io, [&] { return got.has_value(); }));
  CHECK(got->master_addr == "::1");
  CHECK(client->endpoint() == "[::1]:" + std::to_string(server->port()));
  client->Close();
  server->Stop();
}

}  // namespace
}  // namespace launch::rendezvous
