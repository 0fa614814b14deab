// Stateful libFuzzer target: the rendezvous server's RoundMachine driven in-process by up to
// 8 fake sessions at a time, with sequences of JOIN (varied specs and ranks), REPORT,
// SUCCEEDED, REPLACE, HEARTBEAT, closes, failed sends, clock jumps and timer firings (early ones
// too) taken from the fuzz input. Traps when an invariant breaks:
//  * no exception escapes;
//  * every message the machine sends parses with the agent's own parser;
//  * a session gets at most one terminal message (DONE, FAILED, ERROR), nothing after it, and
//    every session still connected when a job ends has had exactly one;
//  * DONE only to a session that was assigned at some point;
//  * the node ranks of one round's ASSIGNs are a permutation of 0..n-1 (but for an ASSIGN into a
//    running round's vacant place, which carries a generation);
//  * granted generations strictly increase;
//  * restarts used never exceed max_restarts;
//  * the machine's state is bounded: it keeps exactly the sessions still open, and its
//    incremental counters agree with a recount (RoundMachine::CheckInvariants).
// Built with -DLAUNCH_BUILD_FUZZERS=ON (scripts/fuzz_rendezvous).

#include <fuzzer/FuzzedDataProvider.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "rendezvous/round_machine.h"

using namespace launch::rendezvous;

namespace {

// Names the broken invariant, then traps (libFuzzer keeps the input).
#define Check(cond)                                                                    \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "fuzz_server:%d: invariant broken: %s\n", __LINE__, #cond); \
      __builtin_trap();                                                                \
    }                                                                                  \
  } while (0)

struct FakeSession {
  SessionId id = 0;  // 0: slot free
  int terminal = 0;  // terminal messages received
  bool assigned = false;
  bool closing = false;  // the server asked to close; OnClosed not delivered yet
};

class Run {
 public:
  explicit Run(FuzzedDataProvider& in) : in_(in), m_(std::chrono::milliseconds(1000)) {
    base_.run_id = "job";
    base_.min_nodes = in_.ConsumeIntegralInRange(1, 4);
    base_.max_nodes = in_.ConsumeIntegralInRange(base_.min_nodes, 5);
    base_.max_restarts = in_.ConsumeIntegralInRange(0, 3);
    base_.fingerprint = "fp";
    base_.join_timeout_s = 2;
    base_.last_call_timeout_s = in_.ConsumeBool() ? 0 : 0.5;
    base_.heartbeat_timeout_s = 1;
    base_.master_port = 29500;
    base_.recover_in_place = in_.ConsumeBool();
  }

  void Go() {
    while (in_.remaining_bytes() > 0) Step();
    // The end: every pending close is delivered, every timer fires.
    FlushCloses();
    Advance(60'000);
  }

 private:
  FakeSession& Slot() { return slots_[in_.ConsumeIntegralInRange(0, 7)]; }

  void Step() {
    FakeSession& s = Slot();
    const int op = in_.ConsumeIntegralInRange(0, 12);
    if (s.id == 0 && op <= 6) {  // a new connection completes its handshake first
      s = FakeSession{};
      s.id = next_id_++;
      Apply(
          m_.OnAuthenticated(s.id, in_.ConsumeBool() ? "127.0.0.1" : "10.0.0.9", "10.0.0.1", now_));
    }
    switch (op) {
      case 0:
      case 1:
      case 2:
        Apply(m_.OnJoin(s.id, MakeJoin(), now_));
        break;
      case 3: {
        FailureReport r;
        r.round = in_.ConsumeBool() ? m_.round() : in_.ConsumeIntegralInRange(0, 5);
        r.global_rank = in_.ConsumeIntegralInRange(-1, 8);
        r.exit_code = in_.ConsumeIntegralInRange(-1, 255);
        r.reason = "exited";
        r.time_us =
            in_.ConsumeBool() ? 0 : now_ + in_.ConsumeIntegralInRange(-2'000'000, 2'000'000);
        Apply(m_.OnReport(s.id, r, now_));
        break;
      }
      case 4:
        Apply(m_.OnSucceeded(
            s.id, in_.ConsumeBool() ? m_.round() : in_.ConsumeIntegralInRange(-1, 5), now_));
        break;
      case 5:
        Apply(m_.OnHeartbeat(s.id, now_));
        break;
      case 6: {
        if (in_.ConsumeIntegralInRange(0, 15) != 0) break;  // rare: it ends the job
        const auto type = static_cast<MessageType>(
            in_.ConsumeIntegralInRange(1, static_cast<int>(kLastMessageType)));
        Apply(m_.OnSendFailed(s.id, type, launch::Status::ProtocolError("too large"), now_));
        break;
      }
      case 7:  // the peer goes away
        if (s.id != 0) {
          const SessionId id = s.id;
          s = FakeSession{};
          Apply(m_.OnClosed(id, launch::Status::PeerLost("reset"), now_));
        }
        break;
      case 8:
        FlushCloses();
        break;
      case 9:
        Advance(in_.ConsumeIntegralInRange(0, 3000));
        break;
      case 10: {  // a firing at any time: early, stale or never armed
        const auto t = static_cast<TimerId>(in_.ConsumeIntegralInRange(0, kTimerCount - 1));
        Apply(m_.OnTimer(t, now_));
        break;
      }
      case 11:
        if (in_.ConsumeIntegralInRange(0, 15) == 0) Apply(m_.FailAll("host leaving", now_));
        break;
      case 12: {
        ReplaceRequest r;
        r.round = in_.ConsumeBool() ? m_.round() : in_.ConsumeIntegralInRange(0, 5);
        r.global_rank = in_.ConsumeIntegralInRange(0, 8);
        r.reason = "killed by SIGKILL";
        if (s.id != 0) Apply(m_.OnReplace(s.id, r, now_));
        break;
      }
    }
  }

  JoinRequest MakeJoin() {
    JoinRequest j = base_;
    j.node_rank = in_.ConsumeIntegralInRange(-1, base_.max_nodes);
    j.local_world_size = in_.ConsumeIntegralInRange(1, 3);
    j.hostname = "h" + std::to_string(in_.ConsumeIntegralInRange(0, 9));
    j.clock_us = in_.ConsumeBool() ? 0 : now_ + in_.ConsumeIntegralInRange(-1'000'000, 1'000'000);
    switch (in_.ConsumeIntegralInRange(0, 12)) {  // now and then, a disagreeing agent
      case 0:
        j.run_id = "other";
        break;
      case 1:
        j.max_nodes = base_.max_nodes + 1;
        break;
      case 2:
        j.heartbeat_timeout_s = 2;
        break;
      case 3:
        j.max_restarts = base_.max_restarts + 1;
        break;
      default:
        break;
    }
    return j;
  }

  void FlushCloses() {
    for (FakeSession& s : slots_) {
      if (s.id == 0 || !s.closing) continue;
      const SessionId id = s.id;
      s = FakeSession{};
      Apply(m_.OnClosed(id, launch::Status::Ok(), now_));
    }
  }

  // Moves the clock and fires due timers at their deadlines, as the server's timers do.
  void Advance(int64_t ms) {
    const int64_t until = now_ + ms * 1000;
    while (true) {
      int best = -1;
      for (int t = 0; t < kTimerCount; ++t)
        if (timers_[t] && *timers_[t] <= until && (best < 0 || *timers_[t] < *timers_[best]))
          best = t;
      if (best < 0) break;
      now_ = *timers_[best];
      timers_[best].reset();
      Apply(m_.OnTimer(static_cast<TimerId>(best), now_));
    }
    now_ = until;
  }

  FakeSession* Find(SessionId id) {
    for (FakeSession& s : slots_)
      if (s.id == id) return &s;
    return nullptr;
  }

  void Apply(const Effects& effects) {
    const JobState before = state_;
    std::map<int, std::vector<int>> ranks;  // round -> node ranks assigned in this batch
    std::map<int, int> num_nodes;
    for (const Effect& e : effects) {
      switch (e.kind) {
        case Effect::Kind::kSend:
        case Effect::Kind::kSendAndClose: {
          FakeSession* s = Find(e.session);
          Check(s != nullptr && !s->closing && s->terminal == 0);
          Check(ValidateMessage(e.type, e.fields).ok());
          const bool terminal = e.type == MessageType::kDone || e.type == MessageType::kFailed ||
                                e.type == MessageType::kError;
          Check(terminal == (e.kind == Effect::Kind::kSendAndClose));
          if (e.type == MessageType::kDone) Check(s->assigned);
          if (e.type == MessageType::kReplaced) {
            auto a = ParseReplaceAnswer(e.fields);
            Check(a.ok());
            if (a->generation > 0) {
              Check(a->generation > generation_);
              generation_ = a->generation;
            }
          }
          if (e.type == MessageType::kAssign) {
            auto a = ParseAssignment(e.fields);
            Check(a.ok());
            if (a->generation > 0) {
              Check(a->generation > generation_ && a->node_rank < a->num_nodes);
              generation_ = a->generation;
            } else {
              ranks[a->round].push_back(a->node_rank);
              num_nodes[a->round] = a->num_nodes;
            }
            Check(a->restart_count <= a->max_restarts);
            s->assigned = true;
          }
          if (terminal) {
            ++s->terminal;
            s->closing = true;
          }
          break;
        }
        case Effect::Kind::kClose: {
          FakeSession* s = Find(e.session);
          Check(s != nullptr && !s->closing);
          s->closing = true;
          break;
        }
        case Effect::Kind::kArmTimer:
          timers_[static_cast<int>(e.timer)] = e.at_us;
          break;
        case Effect::Kind::kCancelTimer:
          timers_[static_cast<int>(e.timer)].reset();
          break;
        default:
          break;
      }
    }
    for (auto& [round, got] : ranks) {
      std::set<int> distinct(got.begin(), got.end());
      Check(static_cast<int>(got.size()) == num_nodes[round]);
      Check(distinct.size() == got.size() && *distinct.begin() == 0 &&
            *distinct.rbegin() == num_nodes[round] - 1);
    }
    const std::string broken = m_.CheckInvariants();
    if (!broken.empty()) std::fprintf(stderr, "fuzz_server: %s\n", broken.c_str());
    Check(broken.empty());
    size_t open = 0;
    for (const FakeSession& s : slots_) open += s.id != 0 ? 1 : 0;
    Check(m_.session_count() == open);
    state_ = m_.state();
    if (state_ == JobState::kIdle) generation_ = 0;  // the next job counts from 1 again
    const bool ended =
        (before == JobState::kWaiting || before == JobState::kRunning) &&
        (state_ == JobState::kDone || state_ == JobState::kFailed || state_ == JobState::kIdle);
    if (ended)
      for (const FakeSession& s : slots_)
        if (s.id != 0) Check(s.terminal == 1 || (s.closing && s.terminal == 0));
  }

  FuzzedDataProvider& in_;
  RoundMachine m_;
  JoinRequest base_;
  FakeSession slots_[8];
  SessionId next_id_ = 1;
  int64_t now_ = 1'700'000'000'000'000;
  std::optional<int64_t> timers_[kTimerCount];
  JobState state_ = JobState::kIdle;
  int generation_ = 0;  // the newest granted
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  try {
    Run run(in);
    run.Go();
  } catch (...) {
    __builtin_trap();  // an exception would take down the hosting agent
  }
  return 0;
}
