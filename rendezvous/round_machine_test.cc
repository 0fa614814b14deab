// The rendezvous round logic driven directly, with a fake clock: no sockets, no sleeps, every
// timer fired exactly at its deadline. One test per rule in round_machine.h.

#include "rendezvous/round_machine.h"

#include <algorithm>
#include <set>

#include <doctest/doctest.h>

#include "base/test_util.h"
#include "rendezvous/test_util.h"

namespace launch::rendezvous {
namespace {

using std::chrono::milliseconds;
using testing::Join;

using launch::testing::Contains;

// Drives a RoundMachine the way the server does: effects recorded per session, timers kept at
// their deadlines, closes the machine asks for delivered back as OnClosed.
struct Driver {
  RoundMachine m{milliseconds(5000)};
  int64_t now = 1'700'000'000'000'000;  // fake wall clock, microseconds
  std::map<TimerId, int64_t> timers;
  std::map<SessionId, std::vector<Effect>> got;  // messages each session received
  std::set<SessionId> closed;                    // closed by the server
  std::vector<std::string> log;
  SessionId next_id = 1;
  bool check = true;  // recount the machine's counters after each input (O(n))

  void Apply(Effects effects) {
    std::vector<SessionId> to_close;
    for (Effect& e : effects) {
      switch (e.kind) {
        case Effect::Kind::kSend:
        case Effect::Kind::kSendAndClose:
          REQUIRE(closed.count(e.session) == 0);  // nothing after the last word
          if (e.kind == Effect::Kind::kSendAndClose) to_close.push_back(e.session);
          got[e.session].push_back(std::move(e));
          break;
        case Effect::Kind::kClose:
          to_close.push_back(e.session);
          break;
        case Effect::Kind::kArmTimer:
          timers[e.timer] = e.at_us;
          break;
        case Effect::Kind::kCancelTimer:
          timers.erase(e.timer);
          break;
        case Effect::Kind::kLog:
          log.push_back(e.text);
          break;
        default:
          break;
      }
    }
    if (check) REQUIRE(m.CheckInvariants() == "");
    for (SessionId id : to_close) {
      closed.insert(id);
      Apply(m.OnClosed(id, Status::Ok(), now));
    }
  }
  SessionId Connect(const std::string& remote = "10.0.0.2", const std::string& local = "10.0.0.1") {
    SessionId id = next_id++;
    Apply(m.OnAuthenticated(id, remote, local, now));
    return id;
  }
  SessionId Joined(const JoinRequest& j, const std::string& remote = "10.0.0.2") {
    SessionId id = Connect(remote);
    Apply(m.OnJoin(id, j, now));
    return id;
  }
  void Rejoin(SessionId id, const JoinRequest& j) { Apply(m.OnJoin(id, j, now)); }
  void Report(SessionId id, FailureReport r) { Apply(m.OnReport(id, std::move(r), now)); }
  void Succeed(SessionId id) { Apply(m.OnSucceeded(id, m.round(), now)); }
  // REPLACE for `global_rank` in the running round; the REPLACED answer.
  ReplaceAnswer Replace(SessionId id, int global_rank) {
    Apply(m.OnReplace(id, ReplaceRequest{m.round(), global_rank, "killed by SIGKILL"}, now));
    const Effect* e = Last(id);
    REQUIRE(e != nullptr);
    REQUIRE(e->type == MessageType::kReplaced);
    StatusOr<ReplaceAnswer> a = ParseReplaceAnswer(e->fields);
    REQUIRE(a.ok());
    return *a;
  }
  void Heartbeat(SessionId id) { Apply(m.OnHeartbeat(id, now)); }
  void Lose(SessionId id) { Apply(m.OnClosed(id, Status::PeerLost("connection reset"), now)); }
  // Moves the clock forward, firing each timer at its deadline on the way.
  void Advance(milliseconds d) {
    const int64_t until = now + d.count() * 1000;
    while (true) {
      auto next = std::min_element(timers.begin(), timers.end(),
                                   [](auto& a, auto& b) { return a.second < b.second; });
      if (next == timers.end() || next->second > until) break;
      const TimerId t = next->first;
      now = next->second;
      timers.erase(next);
      Apply(m.OnTimer(t, now));
    }
    now = until;
  }

  std::vector<Assignment> Assignments(SessionId id) {
    std::vector<Assignment> out;
    for (const Effect& e : got[id])
      if (e.type == MessageType::kAssign) {
        auto a = ParseAssignment(e.fields);
        REQUIRE(a.ok());
        out.push_back(*a);
      }
    return out;
  }
  std::vector<RestartNotice> Restarts(SessionId id) {
    std::vector<RestartNotice> out;
    for (const Effect& e : got[id])
      if (e.type == MessageType::kRestart) out.push_back(*ParseRestart(e.fields));
    return out;
  }
  const Effect* Last(SessionId id) { return got[id].empty() ? nullptr : &got[id].back(); }
  std::optional<JobFailure> Failed(SessionId id) {
    const Effect* e = Last(id);
    if (!e || e->type != MessageType::kFailed) return std::nullopt;
    return *ParseJobFailure(e->fields);
  }
  std::optional<ErrorMessage> Refused(SessionId id) {
    const Effect* e = Last(id);
    if (!e || e->type != MessageType::kError) return std::nullopt;
    return *ParseError(e->fields);
  }
  bool Done(SessionId id) {
    const Effect* e = Last(id);
    return e && e->type == MessageType::kDone;
  }
  bool LogContains(const std::string& needle) const {
    for (const auto& l : log)
      if (Contains(l, needle)) return true;
    return false;
  }
};

FailureReport WorkerFailure(int round, int exit_code, int64_t time_us = 0) {
  FailureReport r;
  r.round = round;
  r.global_rank = 0;
  r.local_rank = 0;
  r.exit_code = exit_code;
  r.reason = "exited with code " + std::to_string(exit_code);
  r.time_us = time_us;
  return r;
}

TEST_CASE("StaticJobClosesTheMomentTheLastNodeArrives") {
  Driver d;
  JoinRequest j = Join(3, 3, -1);
  j.last_call_timeout_s = 10;  // must not matter when MIN == MAX
  SessionId a = d.Joined(j), b = d.Joined(j);
  CHECK(d.Assignments(a).empty());
  SessionId c = d.Joined(j);
  std::vector<int> ranks;
  for (SessionId id : {a, b, c}) {
    REQUIRE(d.Assignments(id).size() == 1);
    ranks.push_back(d.Assignments(id)[0].node_rank);
  }
  CHECK(ranks == std::vector<int>{0, 1, 2});  // join order
}

TEST_CASE("ExplicitRanksAreHonouredAndOffsetsAreNodeZeroFirst") {
  Driver d;
  SessionId a = d.Joined(Join(2, 2, 1, 3, "hostA"), "10.0.0.2");
  SessionId b = d.Joined(Join(2, 2, -1, 2, "hostB"), "10.0.0.3");
  Assignment x = d.Assignments(a).at(0), y = d.Assignments(b).at(0);
  CHECK(x.node_rank == 1);
  CHECK(y.node_rank == 0);
  CHECK(x.world_size == 5);
  CHECK(y.rank_offset == 0);
  CHECK(x.rank_offset == 2);
  CHECK(x.local_world_size == 3);
  CHECK(x.master_addr == "10.0.0.3");  // node 0's address
  CHECK(x.master_port == 30999);       // the port node 0 reserved
  CHECK(x.nodes.empty());              // each node gets its own row only
}

TEST_CASE("ElasticJobWaitsTheLastCallThenClosesWithWhatCame") {
  Driver d;
  JoinRequest j = Join(2, 4, -1);
  j.last_call_timeout_s = 0.3;
  SessionId a = d.Joined(j), b = d.Joined(j);
  d.Advance(milliseconds(299));
  CHECK(d.Assignments(a).empty());
  d.Advance(milliseconds(1));
  REQUIRE(d.Assignments(a).size() == 1);
  CHECK(d.Assignments(a)[0].num_nodes == 2);
  CHECK(d.Assignments(b).size() == 1);
}

TEST_CASE("ElasticJobClosesAtOnceWhenMaxArrive") {
  Driver d;
  JoinRequest j = Join(1, 2, -1);
  j.last_call_timeout_s = 5;
  SessionId a = d.Joined(j);
  d.Joined(j);
  REQUIRE(d.Assignments(a).size() == 1);
  CHECK(d.Assignments(a)[0].num_nodes == 2);
}

TEST_CASE("AServerTakingOverALostOnesRecordGoesOnWithItsCountsAndSpec") {
  Driver before;
  JoinRequest j = Join(2, 3, -1);
  j.max_restarts = 2;
  j.last_call_timeout_s = 0.5;
  SessionId a = before.Joined(j, "10.0.0.1"), b = before.Joined(j, "10.0.0.2");
  before.Joined(j, "10.0.0.3");
  REQUIRE(before.Assignments(a).size() == 1);
  std::optional<JobRecord> kept = before.m.Record();
  REQUIRE(kept.has_value());
  CHECK(kept->num_nodes == 3);
  CHECK(kept->round == 0);
  // Through its text form, as etcd holds it.
  StatusOr<JobRecord> record = DecodeJobRecord(EncodeJobRecord(*kept));
  REQUIRE(record.ok());
  CHECK(record->spec.run_id == j.run_id);
  CHECK(record->spec_origin == kept->spec_origin);
  CHECK(!DecodeJobRecord("not a record").ok());
  (void)b;

  Driver after;  // the new server, on a surviving host
  after.Apply(after.m.Resume(*record, "the rendezvous host 10.0.0.1 was lost", after.now));
  CHECK(after.m.round() == 1);
  CHECK(after.m.restarts_used() == 1);
  CHECK(after.LogContains("taking over job"));
  // Another job's agent is refused by the record's spec.
  JoinRequest stranger = j;
  stranger.run_id = "other";
  SessionId s = after.Joined(stranger);
  REQUIRE(after.Refused(s).has_value());
  CHECK(Contains(after.Refused(s)->message, "run_id mismatch"));
  // The lost round had 3 nodes: the 2 survivors close it after last_call.
  SessionId x = after.Joined(j, "10.0.0.2");
  after.Advance(milliseconds(2000));
  CHECK(after.Assignments(x).empty());  // one of the two survivors is not a round
  SessionId y = after.Joined(j, "10.0.0.3");
  after.Advance(milliseconds(499));
  CHECK(after.Assignments(x).empty());  // last_call: a replacement host may still come
  after.Advance(milliseconds(1));
  REQUIRE(after.Assignments(x).size() == 1);
  Assignment got = after.Assignments(y).at(0);
  CHECK(got.round == 1);
  CHECK(got.restart_count == 1);
  CHECK(got.num_nodes == 2);
  CHECK(got.master_addr == "10.0.0.2");  // a survivor is node 0 now
  CHECK(after.m.Record()->restarts_used == 1);
}

TEST_CASE("ATakenOverRoundThatNeverFillsFailsNamingTheLostServer") {
  Driver before;
  JoinRequest j = Join(2, 2, -1);
  j.max_restarts = 2;
  j.join_timeout_s = 5;
  before.Joined(j, "10.0.0.1");
  before.Joined(j, "10.0.0.2");
  StatusOr<JobRecord> record = DecodeJobRecord(EncodeJobRecord(*before.m.Record()));
  REQUIRE(record.ok());
  Driver after;
  after.Apply(after.m.Resume(*record, "the rendezvous host 10.0.0.1 was lost", after.now));
  SessionId x = after.Joined(j, "10.0.0.2");
  after.Advance(milliseconds(5001));
  REQUIRE(after.Failed(x).has_value());
  CHECK(Contains(after.Failed(x)->message,
                 "job failed: the rendezvous host 10.0.0.1 was lost; no replacement node joined"));
}

TEST_CASE("AServerTakingOverAJobWithNoRestartLeftRefusesEveryJoinSayingWhy") {
  Driver before;
  JoinRequest j = Join(1, 2, -1);
  j.max_restarts = 0;
  before.Joined(j);
  StatusOr<JobRecord> record = DecodeJobRecord(EncodeJobRecord(*before.m.Record()));
  REQUIRE(record.ok());
  Driver after;
  after.Apply(after.m.Resume(*record, "the rendezvous host 10.0.0.1 was lost", after.now));
  for (int i = 0; i < 2; ++i) {  // and the job is not forgotten when its sessions close
    SessionId x = after.Joined(j);
    REQUIRE(after.Refused(x).has_value());
    CHECK(Contains(after.Refused(x)->message, "no restart left"));
  }
}

TEST_CASE("JoinTimeoutFailsEveryWaitingAgentListingMissingRanks") {
  Driver d;
  JoinRequest j = Join(3, 3, 0, 1, "alpha");
  j.join_timeout_s = 0.3;
  SessionId a = d.Joined(j);
  JoinRequest k = j;
  k.node_rank = 2;
  k.hostname = "gamma";
  SessionId c = d.Joined(k);
  d.Advance(milliseconds(299));
  CHECK_FALSE(d.Failed(a));
  d.Advance(milliseconds(1));
  for (SessionId id : {a, c}) {
    REQUIRE(d.Failed(id));
    CHECK(d.Failed(id)->config_error);
    CHECK(Contains(d.Failed(id)->message, "2 of 3 nodes joined"));
    CHECK(Contains(d.Failed(id)->message, "unclaimed node ranks: 1"));
  }
}

TEST_CASE("MismatchedRunIdIsRefusedAloneAndTheFormingJobGoesOn") {
  Driver d;
  SessionId a = d.Joined(Join(2, 2, 0, 1, "alpha"), "10.0.0.2");
  JoinRequest other = Join(2, 2, 1, 1, "beta");
  other.run_id = "other";
  SessionId b = d.Joined(other, "10.0.0.3");
  REQUIRE(d.Refused(b));
  CHECK(d.Refused(b)->config_error);
  CHECK(Contains(d.Refused(b)->message, "run_id mismatch"));
  CHECK(Contains(d.Refused(b)->message, "'other'"));
  CHECK(Contains(d.Refused(b)->message, "'test'"));
  CHECK(Contains(d.Refused(b)->message, "host alpha (10.0.0.2)"));  // who set the spec
  CHECK(d.got[a].empty());                                          // untouched
  SessionId c = d.Joined(Join(2, 2, 1, 1, "gamma"));
  CHECK(d.Assignments(a).size() == 1);
  CHECK(d.Assignments(c).size() == 1);
}

// The hosting agent's server knows its job before its own agent's JOIN arrives: another job's
// node 0 on the same port, reaching it first from the same address, is the one refused.
TEST_CASE("AnotherJobJoiningBeforeTheHostsOwnAgentIsRefusedAlone") {
  Driver d;
  d.m.Expect(Join(2, 2, 0, 1, "vm"), "the agent hosting this rendezvous (host vm)");
  JoinRequest other = Join(2, 2, 0, 1, "vm");
  other.run_id = "other";
  SessionId stray = d.Joined(other, "127.0.0.1");
  REQUIRE(d.Refused(stray));
  CHECK(d.Refused(stray)->config_error);
  CHECK(Contains(d.Refused(stray)->message, "run_id mismatch"));
  CHECK(Contains(d.Refused(stray)->message,
                 "but the agent hosting this rendezvous (host vm) has 'test'"));
  CHECK(d.m.state() == JobState::kIdle);  // the stray set no spec
  SessionId host = d.Joined(Join(2, 2, 0, 1, "vm"), "127.0.0.1");
  SessionId peer = d.Joined(Join(2, 2, 1, 1, "peer"), "127.0.0.1");
  CHECK(d.Assignments(host).size() == 1);
  CHECK(d.Assignments(peer).size() == 1);
}

TEST_CASE("MismatchedRunIdIsRefusedAloneWhileTheJobRuns") {
  Driver d;
  SessionId a = d.Joined(Join(1, 1, -1));
  JoinRequest other = Join(1, 1, -1);
  other.run_id = "other";
  SessionId b = d.Joined(other);
  REQUIRE(d.Refused(b));
  CHECK(d.Assignments(a).size() == 1);
  CHECK(d.Restarts(a).empty());
  CHECK(d.m.state() == JobState::kRunning);
}

TEST_CASE("MismatchedWorldSizeAndFingerprintAreNamed") {
  Driver d;
  d.Joined(Join(2, 2, 0));
  SessionId b = d.Joined(Join(3, 3, 1));
  REQUIRE(d.Refused(b));
  CHECK(Contains(d.Refused(b)->message, "num_machines (nnodes) mismatch"));
  CHECK(Contains(d.Refused(b)->message, "has 3 but"));
  JoinRequest j = Join(2, 2, 1);
  j.fingerprint = "different";
  SessionId c = d.Joined(j);
  CHECK(Contains(d.Refused(c)->message, "config fingerprint mismatch"));
}

TEST_CASE("MismatchedRdzvTimeoutsAreRefusedNamingTheFieldAndBothValues") {
  Driver d;
  JoinRequest base = Join(3, 3, -1);
  base.heartbeat_timeout_s = 1;
  SessionId a = d.Joined(base);
  struct Case {
    const char* field;
    JoinRequest join;
  };
  JoinRequest hb = base, jt = base, lc = base;
  hb.heartbeat_timeout_s = 8;
  jt.join_timeout_s = 30;
  lc.last_call_timeout_s = 2;
  for (const Case& c : {Case{"heartbeat_timeout mismatch", hb}, Case{"join_timeout mismatch", jt},
                        Case{"last_call_timeout mismatch", lc}}) {
    SessionId b = d.Joined(c.join);
    REQUIRE(d.Refused(b));
    CHECK(d.Refused(b)->config_error);  // exit 2
    CHECK(Contains(d.Refused(b)->message, c.field));
  }
  SessionId b = d.Joined(hb);
  CHECK(Contains(d.Refused(b)->message, "has 8 s but"));
  CHECK(Contains(d.Refused(b)->message, "has 1 s"));
  CHECK(d.got[a].empty());
}

TEST_CASE("DuplicateRankRefusesOnlyTheNewcomerWhileTheHolderIsAlive") {
  Driver d;
  SessionId a = d.Joined(Join(2, 2, 0, 1, "alpha"), "10.0.0.2");
  d.Advance(milliseconds(200));  // heartbeat_timeout 1 s: within one interval (250 ms)
  SessionId b = d.Joined(Join(2, 2, 0, 1, "beta"), "10.0.0.3");
  REQUIRE(d.Refused(b));
  CHECK(d.Refused(b)->config_error);
  CHECK(Contains(d.Refused(b)->message, "duplicate machine_rank 0"));
  CHECK(Contains(d.Refused(b)->message, "alpha"));
  CHECK(Contains(d.Refused(b)->message, "beta"));
  CHECK(d.got[a].empty());  // the forming job never fails because of it
  SessionId c = d.Joined(Join(2, 2, 1, 1, "gamma"));
  CHECK(d.Assignments(a).size() == 1);
  CHECK(d.Assignments(c).size() == 1);
}

TEST_CASE("SilentRankHolderIsReplacedByTheNewcomer") {
  Driver d;
  SessionId a = d.Joined(Join(3, 3, 0, 1, "alpha"), "10.0.0.2");
  SessionId b = d.Joined(Join(3, 3, 1, 1, "frozen"), "10.0.0.3");
  d.Advance(milliseconds(200));
  d.Heartbeat(a);  // alpha keeps talking; frozen does not
  d.Advance(milliseconds(100));
  SessionId c = d.Joined(Join(3, 3, 1, 1, "fresh"), "10.0.0.4");
  REQUIRE(d.Refused(b));  // the old session is closed with a message
  CHECK(Contains(d.Refused(b)->message, "replaces host frozen"));
  CHECK(d.closed.count(b));
  CHECK(d.got[c].empty());
  SessionId e = d.Joined(Join(3, 3, 2, 1, "gamma"));
  REQUIRE(d.Assignments(c).size() == 1);
  CHECK(d.Assignments(c)[0].node_rank == 1);
  CHECK(d.Assignments(a).size() == 1);
  CHECK(d.Assignments(e).size() == 1);
}

TEST_CASE("SilentMemberReplacedWhileRunningRestartsTheRoundWithTheNewcomer") {
  Driver d;
  JoinRequest j = Join(2, 2, -1);
  j.max_restarts = 1;
  JoinRequest r0 = j, r1 = j;
  r0.node_rank = 0;
  r1.node_rank = 1;
  SessionId a = d.Joined(r0), b = d.Joined(r1);
  REQUIRE(d.Assignments(b).size() == 1);
  d.Advance(milliseconds(200));
  d.Heartbeat(a);
  d.Advance(milliseconds(200));
  SessionId c = d.Joined(r1);
  CHECK(d.Refused(b));
  d.Advance(kRootCauseWindow);
  REQUIRE(d.Restarts(a).size() == 1);
  CHECK(Contains(d.Restarts(a)[0].reason, "lost node 1"));
  d.Rejoin(a, r0);
  REQUIRE(d.Assignments(c).size() == 1);
  CHECK(d.Assignments(c)[0].node_rank == 1);
  CHECK(d.Assignments(c)[0].restart_count == 1);
}

TEST_CASE("WorkerFailureRestartsEveryNodeWithTheRootCauseThenJobCompletes") {
  Driver d;
  JoinRequest j = Join(2, 2, -1, 2);
  j.max_restarts = 1;
  SessionId a = d.Joined(j), b = d.Joined(j);
  FailureReport r = WorkerFailure(0, 7);
  r.stderr_tail = "Traceback\nValueError: boom";
  d.Report(a, r);
  CHECK(d.Restarts(b).empty());  // the window for an earlier failure
  d.Advance(kRootCauseWindow);
  REQUIRE(d.Restarts(b).size() == 1);
  CHECK(d.Restarts(b)[0].counts_as_restart);
  REQUIRE(d.Restarts(b)[0].report);
  CHECK(d.Restarts(b)[0].report->exit_code == 7);
  CHECK(d.Restarts(b)[0].report->stderr_tail == "Traceback\nValueError: boom");
  CHECK(d.Restarts(b)[0].report->node_rank == d.Assignments(a)[0].node_rank);
  d.Rejoin(a, j);
  d.Rejoin(b, j);
  REQUIRE(d.Assignments(a).size() == 2);
  CHECK(d.Assignments(a)[1].round == 1);
  CHECK(d.Assignments(a)[1].restart_count == 1);
  d.Succeed(a);
  CHECK_FALSE(d.Done(b));
  d.Succeed(b);
  CHECK(d.Done(a));
  CHECK(d.Done(b));
  CHECK(d.m.state() == JobState::kIdle);  // every agent gone: forgotten
}

TEST_CASE("FailureWithNoRestartsLeftFailsEveryNodeWithTheSameReport") {
  Driver d;
  SessionId a = d.Joined(Join(2, 2, 0)), b = d.Joined(Join(2, 2, 1));
  FailureReport r = WorkerFailure(0, -1);
  r.signal = 11;
  d.Report(b, r);
  d.Advance(kRootCauseWindow);
  for (SessionId id : {a, b}) {
    REQUIRE(d.Failed(id));
    CHECK_FALSE(d.Failed(id)->config_error);
    CHECK(Contains(d.Failed(id)->message, "no restarts left"));
    REQUIRE(d.Failed(id)->report);
    CHECK(d.Failed(id)->report->signal == 11);
  }
}

TEST_CASE("TheEarliestFailureIsTheRootCauseEvenWhenItsReportArrivesSecond") {
  Driver d;
  JoinRequest j0 = Join(2, 2, 0), j1 = Join(2, 2, 1);
  j0.clock_us = d.now - 2'000'000;  // node 0's clock is 2 s behind the server's
  j1.clock_us = d.now + 5'000'000;  // node 1's is 5 s ahead
  SessionId a = d.Joined(j0), b = d.Joined(j1);
  d.Advance(milliseconds(1000));
  // Node 0 failed first (100 ms before node 1, on the server's clock); its report arrives last.
  const int64_t at = d.now - 200'000;
  d.Report(b, WorkerFailure(0, 7, at + 100'000 + 5'000'000));
  d.Advance(milliseconds(100));
  d.Report(a, WorkerFailure(0, 3, at - 2'000'000));
  d.Advance(kRootCauseWindow);
  for (SessionId id : {a, b}) {
    REQUIRE(d.Failed(id));
    REQUIRE(d.Failed(id)->report);
    CHECK(d.Failed(id)->report->exit_code == 3);
    CHECK(d.Failed(id)->report->node_rank == 0);
  }
}

TEST_CASE("LostAgentStartsANewRoundAtMinNodes") {
  Driver d;
  JoinRequest j = Join(2, 3, -1);
  j.max_restarts = 1;
  SessionId a = d.Joined(j), b = d.Joined(j), c = d.Joined(j);
  REQUIRE(d.Assignments(a).at(0).num_nodes == 3);
  d.Lose(c);
  d.Advance(kRootCauseWindow);
  REQUIRE(d.Restarts(a).size() == 1);
  CHECK(Contains(d.Restarts(a)[0].reason, "lost node"));
  REQUIRE(d.Restarts(a)[0].report);
  CHECK(Contains(d.Restarts(a)[0].report->reason, "node lost"));
  d.Rejoin(a, j);
  d.Rejoin(b, j);
  REQUIRE(d.Assignments(b).size() == 2);
  CHECK(d.Assignments(b)[1].num_nodes == 2);
}

TEST_CASE("LostAgentBelowMinFailsTheSurvivorsWhenNoReplacementComes") {
  Driver d;
  JoinRequest j = Join(2, 2, -1);
  j.max_restarts = 5;
  j.join_timeout_s = 0.5;
  SessionId a = d.Joined(j), b = d.Joined(j);
  d.Lose(b);
  d.Advance(kRootCauseWindow);
  REQUIRE(d.Restarts(a).size() == 1);
  CHECK(Contains(d.Restarts(a)[0].reason, "waiting up to"));
  d.Rejoin(a, j);
  d.Advance(milliseconds(499));
  CHECK_FALSE(d.Failed(a));
  d.Advance(milliseconds(1));
  REQUIRE(d.Failed(a));
  CHECK(Contains(d.Failed(a)->message, "no replacement node joined"));
  REQUIRE(d.Failed(a)->report);
  CHECK(Contains(d.Failed(a)->report->reason, "node lost"));
}

TEST_CASE("ARestartRoundWaitsOnceMoreForAConnectedMemberStillStoppingItsWorkers") {
  // Node c is lost; its replacement n joins in time, but member b (the hosting node's own
  // agent, stopping its workers for up to stop_grace) re-joins after join_timeout.
  for (const bool b_comes : {true, false}) {
    CAPTURE(b_comes);
    Driver d;
    JoinRequest j = Join(3, 3, -1);
    j.max_restarts = 5;
    j.join_timeout_s = 0.5;
    SessionId a = d.Joined(j), b = d.Joined(j), c = d.Joined(j);
    d.Lose(c);
    d.Advance(kRootCauseWindow);
    REQUIRE(d.Restarts(a).size() == 1);
    d.Rejoin(a, j);
    SessionId n = d.Joined(j);
    d.Advance(milliseconds(500));
    CHECK_FALSE(d.Failed(a));
    CHECK(d.Assignments(n).empty());
    if (b_comes) {
      d.Advance(milliseconds(300));
      d.Rejoin(b, j);
      REQUIRE(d.Assignments(n).size() == 1);
      CHECK(d.Assignments(n)[0].num_nodes == 3);
      CHECK_FALSE(d.Failed(a));
    } else {
      d.Advance(milliseconds(499));
      CHECK_FALSE(d.Failed(a));
      d.Advance(milliseconds(1));
      REQUIRE(d.Failed(a));
      CHECK(Contains(d.Failed(a)->message, "still connected but not joined again"));
    }
  }
}

TEST_CASE("LostAgentBelowMinIsReplacedByANewAgentAndTheJobGoesOn") {
  Driver d;
  JoinRequest j = Join(2, 2, -1);
  j.max_restarts = 5;
  SessionId a = d.Joined(j), b = d.Joined(j);
  const int lost_rank = d.Assignments(b).at(0).node_rank;
  d.Lose(b);
  d.Advance(kRootCauseWindow);
  d.Rejoin(a, j);
  JoinRequest replacement = j;
  replacement.node_rank = lost_rank;
  SessionId c = d.Joined(replacement);
  REQUIRE(d.Assignments(c).size() == 1);
  CHECK(d.Assignments(c)[0].node_rank == lost_rank);
  CHECK(d.Assignments(c)[0].restart_count == 1);
  d.Succeed(a);
  d.Succeed(c);
  CHECK(d.Done(a));
  CHECK(d.Done(c));
}

TEST_CASE("LateNodeScalesUpWithoutSpendingARestart") {
  Driver d;
  JoinRequest j = Join(1, 2, -1);
  j.last_call_timeout_s = 0;
  SessionId a = d.Joined(j);
  REQUIRE(d.Assignments(a).size() == 1);
  CHECK(d.Assignments(a)[0].num_nodes == 1);
  SessionId b = d.Joined(j);
  REQUIRE(d.Restarts(a).size() == 1);
  CHECK_FALSE(d.Restarts(a)[0].counts_as_restart);
  CHECK(Contains(d.Restarts(a)[0].reason, "scale-up"));
  d.Rejoin(a, j);
  REQUIRE(d.Assignments(a).size() == 2);
  CHECK(d.Assignments(a)[1].num_nodes == 2);
  CHECK(d.Assignments(a)[1].restart_count == 0);
  CHECK(d.Restarts(b).empty());
  CHECK(d.Assignments(b).size() == 1);
}

TEST_CASE("ASpareNeverAssignedGetsFailedSayingItNeverRanNotDone") {
  Driver d;
  SessionId a = d.Joined(Join(1, 1, -1));
  JoinRequest late = Join(1, 1, -1, 1, "late");
  SessionId spare = d.Joined(late);
  CHECK(d.got[spare].empty());  // waits
  CHECK(d.LogContains("waits as a spare"));
  d.Succeed(a);
  CHECK(d.Done(a));
  REQUIRE(d.Failed(spare));
  CHECK(d.Failed(spare)->config_error);  // non-zero exit (2)
  CHECK(Contains(d.Failed(spare)->message, "never ran"));
  CHECK(Contains(d.Failed(spare)->message, "the job 'test' already had its maximum of 1 nodes"));
}

TEST_CASE("ANodeThatSucceededAndThenLeftIsNeitherARestartNorAFailure") {
  Driver d;
  JoinRequest j = Join(1, 2, -1);
  j.max_restarts = 1;
  SessionId a = d.Joined(j), b = d.Joined(j);
  d.Succeed(b);
  d.Lose(b);
  d.Advance(milliseconds(2000));
  CHECK(d.Restarts(a).empty());
  CHECK_FALSE(d.Failed(a));
  CHECK(d.m.state() == JobState::kRunning);
  d.Succeed(a);  // the job waited only for the other node
  CHECK(d.Done(a));
}

TEST_CASE("ALostNodeThatHadNotSucceededKeepsTheJobFromSucceeding") {
  Driver d;
  SessionId a = d.Joined(Join(2, 2, -1)), b = d.Joined(Join(2, 2, -1));
  d.Lose(b);
  d.Succeed(a);  // within the root-cause window: the loss still decides
  CHECK_FALSE(d.Done(a));
  d.Advance(kRootCauseWindow);
  REQUIRE(d.Failed(a));
  CHECK(Contains(d.Failed(a)->message, "lost node"));
}

TEST_CASE("MasterAddrForRemoteNodesIsNeverLoopback") {
  // Node 0 runs on the server's host and reaches it over loopback; node 1 reaches the server
  // at 10.0.0.1 from 10.0.0.7. The shell hands the machine both ends of each connection; a
  // real cross-host run is not possible on one test machine.
  Driver d;
  SessionId a = d.Connect("127.0.0.1", "127.0.0.1");
  d.Apply(d.m.OnJoin(a, Join(2, 2, 0), d.now));
  SessionId b = d.Connect("10.0.0.7", "10.0.0.1");
  d.Apply(d.m.OnJoin(b, Join(2, 2, 1), d.now));
  CHECK(d.Assignments(a).at(0).master_addr == "10.0.0.1");
  CHECK(d.Assignments(b).at(0).master_addr == "10.0.0.1");
  CHECK(d.LogContains("reached it over loopback"));
}

TEST_CASE("MasterAddrStaysLoopbackWhenEveryNodeIsOnThisHost") {
  Driver d;
  SessionId a = d.Connect("127.0.0.1", "127.0.0.1");
  d.Apply(d.m.OnJoin(a, Join(2, 2, 0), d.now));
  SessionId b = d.Connect("127.0.0.2", "127.0.0.1");
  d.Apply(d.m.OnJoin(b, Join(2, 2, 1), d.now));
  CHECK(d.Assignments(b).at(0).master_addr == "127.0.0.1");
}

TEST_CASE("AMessageThatCannotBeSentFailsTheJobWithAMessage") {
  Driver d;
  SessionId a = d.Joined(Join(2, 2, -1, 1, "alpha")), b = d.Joined(Join(2, 2, -1, 1, "beta"));
  d.Apply(d.m.OnSendFailed(b, MessageType::kAssign,
                           Status::ProtocolError("message of 70000000 bytes exceeds the limit"),
                           d.now));
  for (SessionId id : {a, b}) {
    REQUIRE(d.Failed(id));
    CHECK(Contains(d.Failed(id)->message, "could not send ASSIGN to host beta"));
    CHECK(Contains(d.Failed(id)->message, "exceeds the limit"));
  }
}

TEST_CASE("NoMessageExceedsTheFrameLimitAt65536Nodes") {
  Driver d;
  d.check = false;
  size_t largest = 0;
  auto measure = [&] {
    for (auto& [id, effects] : d.got)
      for (const Effect& e : effects) {
        const std::string payload = EncodeFields(e.fields);
        largest = std::max(largest, payload.size());
        REQUIRE(ValidateMessage(e.type, e.fields).ok());  // the agent's parser accepts it
      }
    d.got.clear();
  };
  // Every node with the longest host name the protocol allows; one node missing, so the job
  // times out with the longest message the server writes.
  JoinRequest j = Join(kMaxNodes, kMaxNodes, -1, 1, std::string(256, 'h'));
  j.join_timeout_s = 1;
  for (int i = 0; i < kMaxNodes - 1; ++i) d.Joined(j);
  d.Advance(milliseconds(1000));
  measure();
  CHECK(largest <= kMaxPayloadSize);
  // And a full round of ASSIGNs.
  Driver e;
  e.check = false;
  JoinRequest k = Join(kMaxNodes, kMaxNodes, -1, 1, std::string(256, 'h'));
  for (int i = 0; i < kMaxNodes; ++i) e.Joined(k);
  size_t assigns = 0;
  for (auto& [id, effects] : e.got)
    for (const Effect& x : effects) {
      assigns += x.type == MessageType::kAssign;
      largest = std::max(largest, EncodeFields(x.fields).size());
    }
  CHECK(assigns == static_cast<size_t>(kMaxNodes));
  CHECK(largest < 64 * 1024);
}

TEST_CASE("FailAllSendsFailedToEverySessionOnce") {
  Driver d;
  SessionId a = d.Joined(Join(3, 3, -1)), b = d.Joined(Join(3, 3, -1));
  SessionId idle = d.Connect();
  d.Apply(d.m.FailAll("the rendezvous host is leaving: SIGTERM", d.now));
  for (SessionId id : {a, b, idle}) {
    REQUIRE(d.Failed(id));
    CHECK(d.got[id].size() == 1);
    CHECK(d.Failed(id)->message == "the rendezvous host is leaving: SIGTERM");
  }
  CHECK(d.m.state() == JobState::kIdle);  // all closed: forgotten
}

TEST_CASE("EarlyAndStaleTimerFiringsAreIgnored") {
  Driver d;
  JoinRequest j = Join(2, 4, -1);
  j.last_call_timeout_s = 1;
  SessionId a = d.Joined(j);
  d.Joined(j);
  d.Apply(d.m.OnTimer(TimerId::kLastCall, d.now + 999'000));    // early
  d.Apply(d.m.OnTimer(TimerId::kDecision, d.now + 5'000'000));  // never armed
  CHECK(d.Assignments(a).empty());
  d.Advance(milliseconds(1000));
  CHECK(d.Assignments(a).size() == 1);
}

TEST_CASE("AFinishedJobIsForgottenAndTheNextJobForms") {
  Driver d;
  SessionId a = d.Joined(Join(1, 1, -1));
  d.Succeed(a);
  CHECK(d.m.state() == JobState::kIdle);
  JoinRequest next = Join(1, 1, -1);
  next.run_id = "next";
  SessionId b = d.Joined(next);
  REQUIRE(d.Assignments(b).size() == 1);
  CHECK(d.Assignments(b)[0].run_id == "next");
}

}  // namespace
}  // namespace launch::rendezvous

namespace launch::rendezvous {
namespace {

// --- In-place recovery (recover_in_place in the spec) ------------------------------------------

JoinRequest Recovering(int nodes, int node_rank, int max_restarts, int local_world_size = 2) {
  JoinRequest j = Join(nodes, nodes, node_rank, local_world_size);
  j.recover_in_place = true;
  j.max_restarts = max_restarts;
  j.join_timeout_s = 2;
  return j;
}

TEST_CASE("ADeadWorkerIsReplacedInPlaceWithAJobWideGenerationAndCountsAsARestart") {
  Driver d;
  SessionId a = d.Joined(Recovering(2, 0, 2)), b = d.Joined(Recovering(2, 1, 2));
  REQUIRE(d.Assignments(b).size() == 1);
  ReplaceAnswer first = d.Replace(b, 3);
  CHECK(first.generation == 1);
  CHECK(first.restart_count == 1);
  ReplaceAnswer second = d.Replace(a, 0);  // another node's: the count is the job's
  CHECK(second.generation == 2);
  CHECK(second.restart_count == 2);
  CHECK(d.m.restarts_used() == 2);
  CHECK(d.Restarts(a).empty());  // nobody else is told anything
  CHECK(d.LogContains("replaced alone, generation 1 (restart 1 of 2, in place)"));
  // No restart left: refused, and the job goes on until the agent reports the failure.
  ReplaceAnswer third = d.Replace(b, 2);
  CHECK(third.generation == 0);
  CHECK(Contains(third.message, "no restarts left (max_restarts 2)"));
  CHECK(d.m.restarts_used() == 2);
  d.Report(b, WorkerFailure(0, -1));
  d.Advance(kRootCauseWindow);
  REQUIRE(d.Failed(a));
}

TEST_CASE("AReplaceIsRefusedWithoutRecoveryForAnotherNodesRankOrAStaleRound") {
  Driver d;
  JoinRequest j = Recovering(2, 0, 3);
  j.recover_in_place = false;
  JoinRequest k = j;
  k.node_rank = 1;
  SessionId a = d.Joined(j), b = d.Joined(k);
  CHECK(Contains(d.Replace(b, 2).message, "--recover restart"));
  Driver e;
  a = e.Joined(Recovering(2, 0, 3));
  b = e.Joined(Recovering(2, 1, 3));
  CHECK(Contains(e.Replace(b, 0).message, "is not one of this node's"));  // node 0's rank
  e.Apply(e.m.OnReplace(b, ReplaceRequest{5, 2, "x"}, e.now));
  CHECK(Contains(ParseReplaceAnswer(e.Last(b)->fields)->message, "round 5 is not running"));
  // A failure already decided on: everyone restarts; no replacement.
  e.Report(a, WorkerFailure(0, 3));
  CHECK(Contains(e.Replace(b, 2).message, "has already failed"));
  CHECK(e.m.restarts_used() == 0);
}

TEST_CASE("ANodeWithAnotherRecoverSettingIsRefusedNamingIt") {
  Driver d;
  d.Joined(Recovering(2, 0, 1));
  JoinRequest other = Recovering(2, 1, 1);
  other.recover_in_place = false;
  SessionId b = d.Joined(other);
  REQUIRE(d.Refused(b));
  CHECK(Contains(d.Refused(b)->message, "recover mismatch"));
  CHECK(Contains(d.Refused(b)->message, "restart"));
  CHECK(Contains(d.Refused(b)->message, "in_place"));
}

TEST_CASE("ALostNodeLeavesItsPlaceToAReplacementNodeInTheRunningRound") {
  Driver d;
  SessionId a = d.Joined(Recovering(3, 0, 2), "10.0.0.2");
  SessionId b = d.Joined(Recovering(3, 1, 2), "10.0.0.3");
  SessionId c = d.Joined(Recovering(3, 2, 2), "10.0.0.4");
  const Assignment before = d.Assignments(b).at(0);
  d.Lose(b);
  d.Advance(kRootCauseWindow * 2);
  CHECK(d.m.vacant_node() == 1);
  CHECK(d.Restarts(a).empty());  // the survivors are told nothing
  CHECK(d.Restarts(c).empty());
  CHECK(d.m.restarts_used() == 0);
  CHECK(d.LogContains("waiting up to 2 s (join_timeout) for a node to join as machine_rank 1"));
  // The others finish first: the job waits for the vacant place.
  d.Succeed(a);
  d.Succeed(c);
  CHECK_FALSE(d.Done(a));
  d.Advance(milliseconds(700));
  // A node asking for that rank takes the place: same round, ranks, master; a generation, and
  // how long ago the loss was noticed (its workers' recovery times count from then).
  SessionId r = d.Joined(Recovering(3, 1, 2), "10.0.0.9");
  REQUIRE(d.Assignments(r).size() == 1);
  const Assignment got = d.Assignments(r)[0];
  CHECK(got.round == before.round);
  CHECK(got.node_rank == 1);
  CHECK(got.rank_offset == before.rank_offset);
  CHECK(got.world_size == before.world_size);
  CHECK(got.master_addr == before.master_addr);
  CHECK(got.master_port == before.master_port);
  CHECK(got.generation == 1);
  CHECK(got.lost_ms_ago == (kRootCauseWindow * 2 + milliseconds(700)).count());
  CHECK(before.lost_ms_ago == 0);
  CHECK(got.restart_count == before.restart_count);  // the round's, as the survivors have it
  CHECK(d.m.restarts_used() == 1);
  CHECK(d.m.vacant_node() == -1);
  CHECK(d.LogContains("takes the place of node 1 in round 0"));
  d.Succeed(r);
  CHECK(d.Done(a));
  CHECK(d.Done(r));
  // The next recovery gets the next generation.
}

TEST_CASE("ASpareJoiningWithoutARankTakesTheVacantPlaceOnlyWithTheSameLocalWorldSize") {
  Driver d;
  SessionId a = d.Joined(Recovering(2, 0, 2));
  SessionId b = d.Joined(Recovering(2, 1, 2));
  CHECK(d.Replace(a, 1).generation == 1);
  d.Lose(b);
  SessionId wrong = d.Joined(Recovering(2, -1, 2, /*local_world_size=*/3));
  CHECK(d.Assignments(wrong).empty());
  CHECK(d.LogContains("local_world_size 3, the lost node's was 2"));
  SessionId spare = d.Joined(Recovering(2, -1, 2));
  REQUIRE(d.Assignments(spare).size() == 1);
  CHECK(d.Assignments(spare)[0].node_rank == 1);
  CHECK(d.Assignments(spare)[0].generation == 2);
  CHECK(d.m.restarts_used() == 2);
}

TEST_CASE("ARestartedMachineReplacingItsSilentSessionTakesItsPlaceInTheRunningRound") {
  // The lost machine's session is not closed yet (a power loss sends no FIN): the JOIN with its
  // rank replaces the silent session and fills the place it leaves.
  Driver d;
  SessionId a = d.Joined(Recovering(2, 0, 2), "10.0.0.2");
  SessionId b = d.Joined(Recovering(2, 1, 2), "10.0.0.3");
  d.Advance(milliseconds(2000));  // more than a quarter of heartbeat_timeout without a word
  d.Heartbeat(a);
  SessionId c = d.Joined(Recovering(2, 1, 2), "10.0.0.4");
  REQUIRE(d.Refused(b));
  REQUIRE(d.Assignments(c).size() == 1);
  CHECK(d.Assignments(c)[0].generation == 1);
  CHECK(d.Assignments(c)[0].round == 0);
  CHECK(d.Restarts(a).empty());
  d.Succeed(a);
  d.Succeed(c);
  CHECK(d.Done(a));
}

TEST_CASE("NoReplacementWithinJoinTimeoutRestartsEveryNodeAsWithoutRecovery") {
  Driver d;
  SessionId a = d.Joined(Recovering(2, 0, 2));
  SessionId b = d.Joined(Recovering(2, 1, 2));
  d.Lose(b);
  d.Advance(milliseconds(1999));
  CHECK(d.Restarts(a).empty());
  d.Advance(milliseconds(1) + kRootCauseWindow);
  REQUIRE(d.Restarts(a).size() == 1);
  CHECK(Contains(d.Restarts(a)[0].reason, "lost node 1"));
  REQUIRE(d.Restarts(a)[0].report);
  CHECK(Contains(d.Restarts(a)[0].report->reason,
                 "no node joined to replace it within "
                 "join_timeout (2 s)"));
  CHECK(d.m.restarts_used() == 1);
  CHECK(d.m.vacant_node() == -1);
  CHECK(d.LogContains("node 1 is not recovered in place"));
}

TEST_CASE("LosingNodeZeroOrASecondNodeOrAWorkerFailureEndsTheVacancy") {
  SUBCASE("node 0 hosts the store") {
    Driver d;
    SessionId a = d.Joined(Recovering(2, 0, 2));
    SessionId b = d.Joined(Recovering(2, 1, 2));
    d.Lose(a);
    CHECK(d.m.vacant_node() == -1);
    CHECK(d.LogContains("node 0 hosts the workers' store"));
    d.Advance(kRootCauseWindow);
    CHECK(d.Restarts(b).size() == 1);
  }
  SUBCASE("a second loss") {
    Driver d;
    SessionId a = d.Joined(Recovering(3, 0, 2));
    SessionId b = d.Joined(Recovering(3, 1, 2));
    SessionId c = d.Joined(Recovering(3, 2, 2));
    d.Lose(b);
    CHECK(d.m.vacant_node() == 1);
    d.Lose(c);
    CHECK(d.m.vacant_node() == -1);
    d.Advance(kRootCauseWindow);
    REQUIRE(d.Restarts(a).size() == 1);
    CHECK(Contains(d.Restarts(a)[0].reason, "lost node 1"));  // the first loss is the cause
    CHECK(d.m.restarts_used() == 1);
  }
  SUBCASE("a survivor's worker gives up") {
    Driver d;
    SessionId a = d.Joined(Recovering(2, 0, 2));
    SessionId b = d.Joined(Recovering(2, 1, 2));
    d.Lose(b);
    CHECK(Contains(d.Replace(a, 0).message, "still vacant"));
    d.Report(a, WorkerFailure(0, 1));
    CHECK(d.m.vacant_node() == -1);
    d.Advance(kRootCauseWindow);
    REQUIRE(d.Restarts(a).size() == 1);
    CHECK(Contains(d.Restarts(a)[0].reason, "lost node 1"));
  }
  SUBCASE("no restart left") {
    Driver d;
    SessionId a = d.Joined(Recovering(2, 0, 0));
    SessionId b = d.Joined(Recovering(2, 1, 0));
    d.Lose(b);
    CHECK(d.m.vacant_node() == -1);
    d.Advance(kRootCauseWindow);
    CHECK(d.Failed(a));
  }
}

}  // namespace
}  // namespace launch::rendezvous
