#include "rendezvous/round_machine.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <utility>

#include "base/strings.h"

namespace launch::rendezvous {

namespace {

int64_t Micros(double seconds) { return static_cast<int64_t>(seconds * 1e6 + 0.5); }

std::string Quote(const std::string& s) { return "'" + SanitizeForTerminal(s) + "'"; }

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

std::string NodeCount(const JoinRequest& r) {
  return r.min_nodes == r.max_nodes
             ? std::to_string(r.min_nodes)
             : std::to_string(r.min_nodes) + ":" + std::to_string(r.max_nodes);
}

// "1-3, 5, 9-12" for sorted ranks, at most `max_items` items then "...".
std::string RankRanges(const std::vector<int>& ranks, size_t max_items) {
  std::vector<std::string> items;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (items.size() == max_items) {
      items.push_back("...");
      break;
    }
    items.push_back(j == i ? std::to_string(ranks[i])
                           : std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]));
    i = j + 1;
  }
  return Join(items, ", ");
}

}  // namespace

RoundMachine::RoundMachine(std::chrono::milliseconds default_heartbeat_timeout)
    : default_heartbeat_timeout_(default_heartbeat_timeout) {}

std::chrono::milliseconds RoundMachine::heartbeat_timeout() const {
  if (!spec_) return default_heartbeat_timeout_;
  return std::chrono::milliseconds(Micros(spec_->heartbeat_timeout_s) / 1000);
}

std::optional<JobRecord> RoundMachine::Record() const {
  if (!spec_) return std::nullopt;
  JobRecord r;
  r.spec = *spec_;
  r.spec.clock_us = 0;  // the first joiner's clock then: not part of the spec
  r.spec_origin = spec_origin_;
  r.round = round_;
  r.restarts_used = restarts_used_;
  r.generation = generation_;
  r.num_nodes = last_num_nodes_;
  return r;
}

Effects RoundMachine::Resume(const JobRecord& record, const std::string& reason, int64_t now_us) {
  spec_ = record.spec;
  spec_origin_ = record.spec_origin;
  round_ = record.round + 1;
  restarts_used_ = record.restarts_used;
  generation_ = record.generation;
  last_num_nodes_ = record.num_nodes;
  round_started_us_ = now_us;
  Effect liveness;
  liveness.kind = Effect::Kind::kLiveness;
  liveness.heartbeat_timeout = heartbeat_timeout();
  Emit(std::move(liveness));
  if (restarts_used_ >= spec_->max_restarts) {
    state_ = JobState::kFailed;
    finished_message_ = reason + ", and the job has no restart left (max_restarts " +
                        std::to_string(spec_->max_restarts) + ")";
    Log("job '" + SanitizeForTerminal(spec_->run_id) + "' is over: " + finished_message_);
    return Take();
  }
  ++restarts_used_;
  // The root cause if this round never re-forms ("job failed: <it>; no replacement ...").
  last_restart_reason_ = reason;
  state_ = JobState::kWaiting;
  resumed_round_ = round_;
  const int survivors = std::max(record.num_nodes - 1, spec_->min_nodes);
  resume_quorum_ = static_cast<size_t>(std::min(survivors, spec_->max_nodes));
  Arm(TimerId::kJoin, now_us + Micros(spec_->join_timeout_s));
  Log("taking over job '" + SanitizeForTerminal(spec_->run_id) + "' at round " +
      std::to_string(round_) + " (restart " + std::to_string(restarts_used_) + " of " +
      std::to_string(spec_->max_restarts) + "): " + reason + "; waiting for " +
      std::to_string(resume_quorum_) + " node(s)");
  return Take();
}

Effects RoundMachine::Take() {
  Effects out;
  out.swap(out_);
  return out;
}

void RoundMachine::Log(std::string line) {
  Effect e;
  e.kind = Effect::Kind::kLog;
  e.text = std::move(line);
  Emit(std::move(e));
}

void RoundMachine::Send(SessionId id, MessageType type, Fields fields) {
  Effect e;
  e.kind = Effect::Kind::kSend;
  e.session = id;
  e.type = type;
  e.fields = std::move(fields);
  Emit(std::move(e));
}

void RoundMachine::Arm(TimerId timer, int64_t at_us) {
  timer_at_[static_cast<int>(timer)] = at_us;
  Effect e;
  e.kind = Effect::Kind::kArmTimer;
  e.timer = timer;
  e.at_us = at_us;
  Emit(std::move(e));
}

void RoundMachine::Cancel(TimerId timer) {
  if (!timer_at_[static_cast<int>(timer)]) return;
  timer_at_[static_cast<int>(timer)].reset();
  Effect e;
  e.kind = Effect::Kind::kCancelTimer;
  e.timer = timer;
  Emit(std::move(e));
}

std::string RoundMachine::Describe(const Session& s) const {
  std::string host = s.hostname.empty() ? "?" : SanitizeForTerminal(s.hostname);
  return "host " + host + " (" + s.remote_address + ")";
}

void RoundMachine::Count(SessionId id, const Session& s, int sign) {
  if (s.closing) return;
  auto add = [sign](size_t* n, bool yes) {
    if (yes) *n += sign;
  };
  add(&joined_, s.join.has_value());
  add(&participants_, s.participant);
  add(&members_, s.in_round);
  add(&unfinished_, s.in_round && !s.succeeded);
  if (s.participant && s.requested_rank >= 0) {
    if (sign > 0) {
      rank_claims_[s.requested_rank] = id;
    } else {
      auto it = rank_claims_.find(s.requested_rank);
      if (it != rank_claims_.end() && it->second == id) rank_claims_.erase(it);
    }
  }
}

void RoundMachine::Terminate(SessionId id, Session& s, MessageType type, const Fields& fields) {
  Count(id, s, -1);
  s.closing = true;
  Effect e;
  e.kind = Effect::Kind::kSendAndClose;
  e.session = id;
  e.type = type;
  e.fields = fields;
  Emit(std::move(e));
}

void RoundMachine::Refuse(SessionId id, Session& s, const std::string& message, bool config_error) {
  Log("refused " + Describe(s) + ": " + message);
  ErrorMessage err;
  err.config_error = config_error;
  err.message = message;
  Terminate(id, s, MessageType::kError, ToFields(err));
}

Effects RoundMachine::OnAuthenticated(SessionId id, std::string remote_address,
                                      std::string local_address, int64_t now_us) {
  Session& s = sessions_[id];
  s.remote_address = std::move(remote_address);
  s.local_address = std::move(local_address);
  s.last_heard_us = now_us;
  return Take();
}

Effects RoundMachine::OnHeartbeat(SessionId id, int64_t now_us) {
  auto it = sessions_.find(id);
  if (it != sessions_.end()) it->second.last_heard_us = now_us;
  return Take();
}

void RoundMachine::Expect(JoinRequest spec, std::string origin) {
  expected_ = std::move(spec);
  expected_origin_ = std::move(origin);
}

std::string RoundMachine::SpecMismatch(const Session& s, const JoinRequest& j) const {
  const JoinRequest& spec = spec_ ? *spec_ : *expected_;
  const std::string& origin = spec_ ? spec_origin_ : expected_origin_;
  std::string who = Describe(s);
  auto mismatch = [&](const std::string& field, const std::string& mine,
                      const std::string& theirs) {
    return field + " mismatch: " + who + " has " + mine + " but " + origin + " has " + theirs;
  };
  if (j.run_id != spec.run_id) return mismatch("run_id", Quote(j.run_id), Quote(spec.run_id));
  if (j.min_nodes != spec.min_nodes || j.max_nodes != spec.max_nodes)
    return mismatch("num_machines (nnodes)", NodeCount(j), NodeCount(spec));
  if (j.max_restarts != spec.max_restarts)
    return mismatch("max_restarts", std::to_string(j.max_restarts),
                    std::to_string(spec.max_restarts));
  if (j.fingerprint != spec.fingerprint)
    return mismatch("config fingerprint", Quote(j.fingerprint), Quote(spec.fingerprint));
  // The timeouts decide when this server gives up on an agent and how often agents prove they
  // live: two values in one job make a healthy node look lost (M4).
  if (j.join_timeout_s != spec.join_timeout_s)
    return mismatch("join_timeout", Seconds(j.join_timeout_s), Seconds(spec.join_timeout_s));
  if (j.last_call_timeout_s != spec.last_call_timeout_s)
    return mismatch("last_call_timeout", Seconds(j.last_call_timeout_s),
                    Seconds(spec.last_call_timeout_s));
  if (j.heartbeat_timeout_s != spec.heartbeat_timeout_s)
    return mismatch("heartbeat_timeout", Seconds(j.heartbeat_timeout_s),
                    Seconds(spec.heartbeat_timeout_s));
  // One node replacing its workers alone while another restarts everyone would leave the
  // survivors of one waiting for a generation that never comes.
  if (j.recover_in_place != spec.recover_in_place)
    return mismatch("recover", j.recover_in_place ? "in_place" : "restart",
                    spec.recover_in_place ? "in_place" : "restart");
  if (j.node_rank >= spec.max_nodes)
    return "machine_rank " + std::to_string(j.node_rank) + " of " + who +
           " is not below num_machines " + std::to_string(spec.max_nodes);
  return "";
}

Effects RoundMachine::OnJoin(SessionId id, JoinRequest join, int64_t now_us) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.closing) return Take();
  Session& s = it->second;
  s.last_heard_us = now_us;
  s.hostname = join.hostname;
  if (join.clock_us > 0) s.clock_offset_us = now_us - join.clock_us;
  if (state_ == JobState::kDone || state_ == JobState::kFailed) {
    Refuse(id, s,
           finished_message_.empty() ? "the job on this rendezvous has already finished"
                                     : "the job is over: " + finished_message_,
           false);
    return Take();
  }
  if (!spec_) {
    std::string mismatch = expected_ ? SpecMismatch(s, join) : "";
    if (!mismatch.empty()) {
      Refuse(id, s, mismatch, true);
      return Take();
    }
    if (join.node_rank >= join.max_nodes) {
      Refuse(id, s,
             "machine_rank " + std::to_string(join.node_rank) + " is not below num_machines " +
                 std::to_string(join.max_nodes),
             true);
      return Take();
    }
    spec_ = join;
    spec_origin_ = Describe(s) + ", the first to join,";
    state_ = JobState::kWaiting;
    round_ = 0;
    restarts_used_ = 0;
    round_started_us_ = now_us;
    Effect liveness;
    liveness.kind = Effect::Kind::kLiveness;
    liveness.heartbeat_timeout = heartbeat_timeout();
    Emit(std::move(liveness));
    // The join deadline for round 0 starts with the first agent.
    Arm(TimerId::kJoin, now_us + Micros(spec_->join_timeout_s));
    Log("job '" + SanitizeForTerminal(spec_->run_id) + "': first agent " + Describe(s) +
        " joined; waiting for " +
        (spec_->min_nodes == spec_->max_nodes
             ? std::to_string(spec_->min_nodes)
             : std::to_string(spec_->min_nodes) + " to " + std::to_string(spec_->max_nodes)) +
        " nodes");
  } else {
    // Refused alone: a stray agent (another job's, a typo in its flags) must not take down
    // the job that is forming or running here.
    std::string mismatch = SpecMismatch(s, join);
    if (!mismatch.empty()) {
      Refuse(id, s, mismatch, true);
      return Take();
    }
  }
  if (join.node_rank >= 0) {
    auto claim = rank_claims_.find(join.node_rank);
    if (claim != rank_claims_.end() && claim->second != id) {
      const SessionId holder_id = claim->second;
      Session& holder = sessions_.at(holder_id);
      const int64_t silent_us = now_us - holder.last_heard_us;
      const int64_t interval_us = heartbeat_timeout().count() * 1000 / 4;
      const std::string rank = "machine_rank " + std::to_string(join.node_rank);
      if (silent_us > interval_us) {
        // A live agent sends a frame every interval: this one is frozen or half-open, and
        // the newcomer is its replacement (a restarted machine), so waiting for the read
        // deadline would only delay the job.
        std::string why = Describe(s) + " replaces " + Describe(holder) + " as " + rank +
                          ": nothing heard from it for " + std::to_string(silent_us / 1000) + " ms";
        Log(why);
        ErrorMessage err;
        err.config_error = false;
        err.message = why;
        Effect e;
        e.kind = Effect::Kind::kSendAndClose;
        e.session = holder_id;
        e.type = MessageType::kError;
        e.fields = ToFields(err);
        Emit(std::move(e));
        Drop(holder_id, holder, "replaced by " + Describe(s), now_us);
        if (state_ != JobState::kWaiting && state_ != JobState::kRunning) return Take();
      } else {
        Refuse(id, s,
               "duplicate " + rank + ": " + Describe(holder) + " holds it (heard from " +
                   std::to_string(silent_us / 1000) + " ms ago) and " + Describe(s) +
                   " claims it too",
               true);
        return Take();
      }
    }
  }
  const bool was_member = state_ == JobState::kRunning && s.in_round;
  Count(id, s, -1);
  s.participant = true;
  s.requested_rank = join.node_rank;
  s.join = std::move(join);
  s.join_seq = next_join_seq_++;
  if (was_member) s.in_round = false;
  Count(id, s, +1);

  if (state_ == JobState::kRunning) {
    if (was_member) {
      // A member that re-joins on its own lost its workers' state: a failure of that node,
      // so everyone re-forms.
      if (vacancy_) AbandonVacancy("another node re-joined", now_us);
      FailureReport r;
      r.round = round_;
      r.host = s.hostname;
      r.node_rank = s.node_rank;
      r.reason = "node re-joined while the round was running";
      if (!round_failed_) ConsiderFailure(r.reason + " (" + Describe(s) + ")", r, now_us, now_us);
      return Take();
    }
    if (pending_failure_ || round_failed_) {
      Log(Describe(s) + " joined while round " + std::to_string(round_) +
          " is failing; it takes part in the next round");
      return Take();
    }
    if (vacancy_) {
      if ((s.join->node_rank < 0 || s.join->node_rank == vacancy_->node_rank) &&
          s.join->local_world_size == vacancy_->local_world_size) {
        FillVacancy(id, s, now_us);
      } else {
        // Waits for the round after this one (no scale-up either: that would end the
        // recovery without counting the loss as a restart).
        Log(Describe(s) + " cannot take node " + std::to_string(vacancy_->node_rank) +
            "'s place (" +
            (s.join->local_world_size != vacancy_->local_world_size
                 ? "local_world_size " + std::to_string(s.join->local_world_size) +
                       ", the lost node's was " + std::to_string(vacancy_->local_world_size)
                 : "it asks for machine_rank " + std::to_string(s.join->node_rank)) +
            "); it waits for the next round");
      }
      return Take();
    }
    if (members_ < static_cast<size_t>(spec_->max_nodes)) {
      StartNewRound(/*counts_as_restart=*/false, "scale-up: " + Describe(s) + " joined",
                    std::nullopt, now_us);
    } else {
      Log(Describe(s) + " waits as a spare: the job already has its maximum of " +
          std::to_string(spec_->max_nodes) + " nodes");
    }
    return Take();
  }
  MaybeCloseRound(now_us);
  return Take();
}

void RoundMachine::MaybeCloseRound(int64_t now_us) {
  if (state_ != JobState::kWaiting || !spec_) return;
  const size_t min_nodes = static_cast<size_t>(spec_->min_nodes);
  const size_t max_nodes = static_cast<size_t>(spec_->max_nodes);
  if (joined_ >= max_nodes) {
    CloseRound(now_us);
    return;
  }
  if (joined_ < min_nodes) return;
  // A re-formed round waits for every agent still connected (they are stopping their workers
  // and come back within moments; one that hangs is bounded by join_timeout), and no longer.
  if (round_ == resumed_round_) {
    // Taken over from a lost server: nobody here was told to re-join, so wait for the lost
    // round's other nodes, then last_call for a node taking the lost host's place.
    if (joined_ < resume_quorum_) return;
  } else if (round_ > 0) {
    if (joined_ >= participants_) CloseRound(now_us);
    return;
  }
  if (spec_->last_call_timeout_s <= 0) {
    CloseRound(now_us);
    return;
  }
  if (last_call_armed_) return;
  last_call_armed_ = true;
  Arm(TimerId::kLastCall, now_us + Micros(spec_->last_call_timeout_s));
}

std::string RoundMachine::MasterAddress(const std::vector<const Session*>& nodes) const {
  const std::string& own = nodes[0]->remote_address;
  if (!IsLoopbackHost(own)) return own;
  // Node 0 reached the server over loopback, so it runs on the server's host. Other nodes
  // must not get a loopback address: hand out the server's own address on a connection that
  // came from another host (that host reached it, so it is routable), members first.
  auto usable = [](const Session& s) {
    return !s.closing && !IsLoopbackHost(s.remote_address) && !s.local_address.empty() &&
           !IsLoopbackHost(s.local_address);
  };
  for (const Session* s : nodes)
    if (usable(*s)) return s->local_address;
  for (const auto& [id, s] : sessions_)
    if (usable(s)) return s.local_address;
  return own;  // everyone is on this host
}

void RoundMachine::CloseRound(int64_t now_us) {
  Cancel(TimerId::kJoin);
  Cancel(TimerId::kLastCall);
  last_call_armed_ = false;

  std::vector<std::pair<uint64_t, SessionId>> joined;
  joined.reserve(joined_);
  for (const auto& [id, s] : sessions_)
    if (s.join && !s.closing) joined.emplace_back(s.join_seq, id);
  std::sort(joined.begin(), joined.end());
  const size_t n = std::min(joined.size(), static_cast<size_t>(spec_->max_nodes));
  // Explicit ranks below n first; explicit ranks that no longer fit (elastic jobs that formed
  // with fewer nodes) and unassigned agents fill the free ranks in join order.
  std::vector<SessionId> by_rank(n);
  std::vector<bool> taken(n, false);
  std::vector<SessionId> rest;
  for (size_t i = 0; i < n; ++i) {
    const SessionId id = joined[i].second;
    const int want = sessions_.at(id).join->node_rank;
    if (want >= 0 && static_cast<size_t>(want) < n && !taken[want]) {
      by_rank[want] = id;
      taken[want] = true;
    } else {
      rest.push_back(id);
    }
  }
  size_t next = 0;
  for (SessionId id : rest) {
    while (taken[next]) ++next;
    by_rank[next] = id;
    taken[next] = true;
  }
  std::vector<Session*> nodes(n);
  std::vector<const Session*> const_nodes(n);
  for (size_t r = 0; r < n; ++r) const_nodes[r] = nodes[r] = &sessions_.at(by_rank[r]);

  Assignment a;
  a.round = round_;
  a.restart_count = restarts_used_;
  a.max_restarts = spec_->max_restarts;
  a.num_nodes = static_cast<int>(n);
  last_num_nodes_ = a.num_nodes;
  a.run_id = spec_->run_id;
  std::vector<int> offsets(n);
  int offset = 0;
  for (size_t r = 0; r < n; ++r) {
    offsets[r] = offset;
    offset += nodes[r]->join->local_world_size;
  }
  a.world_size = offset;
  a.master_addr = MasterAddress(const_nodes);
  a.master_port = nodes[0]->join->master_port;
  running_ = a;
  // No node table: each agent needs only its own row, and a table sent to every node costs
  // O(n^2) bytes per round (1 GiB at 8192 nodes) and outgrows the frame limit.
  Fields shared = ToFields(a);
  for (size_t r = 0; r < n; ++r) {
    Session& s = *nodes[r];
    const int local_world_size = s.join->local_world_size;
    Count(by_rank[r], s, -1);
    s.in_round = true;
    s.node_rank = static_cast<int>(r);
    s.local_world_size = local_world_size;
    s.rank_offset = offsets[r];
    s.succeeded = false;
    s.ever_assigned = true;
    s.join.reset();
    Count(by_rank[r], s, +1);
    Effect e;
    e.kind = Effect::Kind::kSend;
    e.session = by_rank[r];
    e.type = MessageType::kAssign;
    e.fields = shared;
    e.fields["node_rank"] = std::to_string(r);
    e.fields["rank_offset"] = std::to_string(offsets[r]);
    e.fields["local_world_size"] = std::to_string(local_world_size);
    Emit(std::move(e));
  }
  state_ = JobState::kRunning;
  round_failed_ = false;
  pending_failure_.reset();
  Cancel(TimerId::kDecision);
  Log("round " + std::to_string(round_) + " closed: " + std::to_string(n) + " nodes, world size " +
      std::to_string(a.world_size) + ", master " + FormatEndpoint(a.master_addr, a.master_port) +
      " (" + std::to_string((now_us - round_started_us_) / 1000) + " ms)");
  if (a.master_addr != nodes[0]->remote_address)
    Log("node 0 (" + Describe(*nodes[0]) +
        ") is on this server's host and reached it over loopback; MASTER_ADDR is " + a.master_addr +
        ", the address other nodes reached this host at");
}

void RoundMachine::OnJoinTimeout(int64_t now_us) {
  if (state_ != JobState::kWaiting) return;
  if (joined_ >= static_cast<size_t>(spec_->min_nodes)) {
    CloseRound(now_us);
    return;
  }
  // Bounded lists: the message travels in every FAILED and must stay readable at any scale.
  constexpr size_t kListed = 8;
  std::set<int> claimed;
  std::vector<std::string> present;
  for (const auto& [id, s] : sessions_) {
    if (!s.join || s.closing) continue;
    if (s.join->node_rank >= 0) claimed.insert(s.join->node_rank);
    if (present.size() < kListed)
      present.push_back(Describe(s) + (s.join->node_rank >= 0
                                           ? " as rank " + std::to_string(s.join->node_rank)
                                           : ""));
  }
  if (joined_ > kListed) present.push_back("and " + std::to_string(joined_ - kListed) + " more");
  std::vector<int> unclaimed;
  for (int r = 0; r < spec_->min_nodes; ++r)
    if (!claimed.count(r)) unclaimed.push_back(r);
  std::string message = "rendezvous timed out after " +
                        std::to_string(static_cast<long long>(spec_->join_timeout_s)) +
                        " s: " + std::to_string(joined_) + " of " +
                        std::to_string(spec_->min_nodes) + " nodes joined (" + Join(present, ", ") +
                        "); missing " + std::to_string(spec_->min_nodes - joined_) +
                        " node(s), unclaimed node ranks: " + RankRanges(unclaimed, 16);
  if (round_ > 0) {
    // Members told to restart that are still connected but have not joined again are stopping
    // their workers (up to their stop_grace, which may be as long as join_timeout: the hosting
    // node's own agent among them). They are alive and on their way: one more join_timeout.
    std::vector<std::string> stopping;
    for (const auto& [id, s] : sessions_)
      if (s.participant && !s.closing && !s.join && stopping.size() < kListed)
        stopping.push_back(Describe(s));
    if (!stopping.empty() && !join_extended_) {
      join_extended_ = true;
      Log("round " + std::to_string(round_) + ": " + std::to_string(joined_) + " of " +
          std::to_string(spec_->min_nodes) + " nodes joined within join_timeout (" +
          Seconds(spec_->join_timeout_s) + "); waiting one more join_timeout for the connected " +
          "node(s) still stopping their workers: " + Join(stopping, ", "));
      Arm(TimerId::kJoin, now_us + Micros(spec_->join_timeout_s));
      return;
    }
    if (!stopping.empty())
      message += "; still connected but not joined again after twice join_timeout: " +
                 Join(stopping, ", ");
    // A restart round that never re-formed: no replacement for a lost node arrived. The job
    // ends with the failure that started the round as its root cause.
    FailJob("job failed: " + last_restart_reason_ + "; no replacement node joined: " + message,
            /*config_error=*/false, last_restart_report_);
    return;
  }
  FailJob(message, /*config_error=*/true, std::nullopt);
}

Effects RoundMachine::OnReport(SessionId id, FailureReport report, int64_t now_us) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.closing) return Take();
  Session& s = it->second;
  s.last_heard_us = now_us;
  if (state_ != JobState::kRunning || !s.in_round || report.round != round_) return Take();
  // The server knows who the sender is; the report's host/node fields are its own word.
  report.host = s.hostname;
  report.node_rank = s.node_rank;
  if (round_failed_) {
    Log("later failure in round " + std::to_string(round_) + " from " + Describe(s) + ": " +
        SanitizeForTerminal(report.reason));
    return Take();
  }
  if (vacancy_) AbandonVacancy("a worker failed on " + Describe(s), now_us);
  const int64_t at = report.time_us > 0 ? report.time_us + s.clock_offset_us : now_us;
  ConsiderFailure("worker failure on " + Describe(s), report, at, now_us);
  return Take();
}

void RoundMachine::ConsiderFailure(const std::string& reason, const FailureReport& report,
                                   int64_t at_us, int64_t now_us) {
  if (pending_failure_) {
    if (at_us >= pending_failure_->at_us) {
      Log("later failure in round " + std::to_string(round_) + ": " + reason + ": " +
          SanitizeForTerminal(report.reason));
      return;
    }
    Log("earlier failure in round " + std::to_string(round_) + " (by " +
        std::to_string((pending_failure_->at_us - at_us) / 1000) + " ms): " + reason);
    pending_failure_ = PendingFailure{reason, report, at_us};
    return;
  }
  pending_failure_ = PendingFailure{reason, report, at_us};
  Arm(TimerId::kDecision, now_us + kRootCauseWindow.count() * 1000);
}

Effects RoundMachine::OnSucceeded(SessionId id, int round, int64_t now_us) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.closing) return Take();
  Session& s = it->second;
  s.last_heard_us = now_us;
  if (state_ != JobState::kRunning || !s.in_round || round != round_ || s.succeeded) return Take();
  Count(id, s, -1);
  s.succeeded = true;
  Count(id, s, +1);
  // A failure waiting for its decision ends this round whatever the others report.
  // So does a vacant place: its ranks have not finished.
  if (unfinished_ == 0 && !pending_failure_ && !round_failed_ && !vacancy_) FinishJob();
  return Take();
}

void RoundMachine::Drop(SessionId id, Session& s, const std::string& how, int64_t now_us) {
  const bool member = s.in_round;
  const bool succeeded = s.succeeded;
  const bool participant = s.participant;
  Count(id, s, -1);
  s.closing = true;
  if (state_ == JobState::kRunning && member) {
    if (succeeded) {
      // Its workers are done; nothing of the round depends on it any more.
      Log("node " + std::to_string(s.node_rank) + ", " + Describe(s) +
          ", left after reporting success; waiting for the other nodes");
    } else if (!round_failed_) {
      Log("lost node " + std::to_string(s.node_rank) + ", " + Describe(s) + ": " + how);
      FailureReport r;
      r.round = round_;
      r.host = s.hostname;
      r.node_rank = s.node_rank;
      r.reason = "node lost (" + how + ")";
      const std::string reason =
          "lost node " + std::to_string(s.node_rank) + " (" + Describe(s) + ")";
      if (CanAwaitReplacement(s)) {
        vacancy_ = Vacancy{s.node_rank, s.local_world_size, s.rank_offset, reason, r, now_us};
        Arm(TimerId::kVacancy, now_us + Micros(spec_->join_timeout_s));
        Log("node " + std::to_string(s.node_rank) + "'s workers (ranks " +
            std::to_string(s.rank_offset) + "-" +
            std::to_string(s.rank_offset + s.local_world_size - 1) +
            ") are recovered in place: waiting up to " + Seconds(spec_->join_timeout_s) +
            " (join_timeout) for a node to join as machine_rank " + std::to_string(s.node_rank) +
            " (or without one) with " + std::to_string(s.local_world_size) +
            " workers; the other nodes' workers wait for it");
        return;
      }
      if (spec_->recover_in_place && s.node_rank == 0)
        Log("node 0 hosts the workers' store (MASTER_ADDR): its loss restarts every node, "
            "in-place recovery or not");
      if (vacancy_) AbandonVacancy("node " + std::to_string(s.node_rank) + " was lost too", now_us);
      ConsiderFailure(reason, r, now_us, now_us);
    } else {
      Log("lost " + Describe(s) + " after the round's failure: " + how);
    }
  } else if (state_ == JobState::kWaiting && participant) {
    Log(Describe(s) + " left while the round was forming: " + how);
    MaybeCloseRound(now_us);
  }
}

Effects RoundMachine::OnClosed(SessionId id, const Status& why, int64_t now_us) {
  auto it = sessions_.find(id);
  if (it == sessions_.end()) return Take();
  Session& s = it->second;
  if (!s.closing) {
    // A peer that broke the protocol after authenticating holds the token (or forged a
    // frame): worth a line whatever the job's state.
    if (why.code() == Status::Code::kAuthFailed || why.code() == Status::Code::kProtocolError)
      Log("closed the connection of " + Describe(s) + ": " + why.message());
    Drop(id, s, why.ok() ? "connection closed" : why.message(), now_us);
  }
  sessions_.erase(id);
  MaybeForget();
  return Take();
}

Effects RoundMachine::OnSendFailed(SessionId id, MessageType type, const Status& why,
                                   int64_t now_us) {
  (void)now_us;
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.closing) return Take();
  Session& s = it->second;
  std::string message =
      std::string("could not send ") + ToString(type) + " to " + Describe(s) + ": " + why.message();
  if (state_ == JobState::kWaiting || state_ == JobState::kRunning) {
    FailJob("job failed: " + message, /*config_error=*/false, std::nullopt);
    return Take();
  }
  Log(message);
  Count(id, s, -1);
  s.closing = true;
  Effect e;
  e.kind = Effect::Kind::kClose;
  e.session = id;
  Emit(std::move(e));
  return Take();
}

Effects RoundMachine::OnTimer(TimerId timer, int64_t now_us) {
  std::optional<int64_t>& at = timer_at_[static_cast<int>(timer)];
  if (!at || now_us < *at) return Take();
  at.reset();
  switch (timer) {
    case TimerId::kJoin:
      OnJoinTimeout(now_us);
      break;
    case TimerId::kLastCall:
      if (state_ == JobState::kWaiting && joined_ >= static_cast<size_t>(spec_->min_nodes))
        CloseRound(now_us);
      break;
    case TimerId::kVacancy:
      if (vacancy_ && state_ == JobState::kRunning)
        AbandonVacancy("no node joined to replace it within join_timeout (" +
                           Seconds(spec_->join_timeout_s) + ")",
                       now_us);
      break;
    case TimerId::kDecision:
      if (pending_failure_ && state_ == JobState::kRunning && !round_failed_) {
        PendingFailure root = std::move(*pending_failure_);
        pending_failure_.reset();
        round_failed_ = true;
        AfterFailure(root.reason, root.report, now_us);
      }
      break;
  }
  return Take();
}

void RoundMachine::AfterFailure(const std::string& reason, const FailureReport& report,
                                int64_t now_us) {
  const size_t left = participants_;
  const size_t min = static_cast<size_t>(spec_->min_nodes);
  if (restarts_used_ < spec_->max_restarts) {
    ++restarts_used_;
    // Below MIN the new round waits, up to join_timeout, for replacement agents (a restarted
    // machine, or another one taking the lost node's rank), as torchrun's dynamic rendezvous
    // waits for its join timeout; OnJoinTimeout ends the job with this failure if none comes.
    const std::string wait =
        left >= min
            ? std::string()
            : "; " + std::to_string(left) + " node(s) left, waiting up to " +
                  std::to_string(static_cast<long long>(spec_->join_timeout_s)) +
                  " s (join_timeout) for " + std::to_string(min - left) + " replacement node(s)";
    last_restart_reason_ = reason;
    last_restart_report_ = report;
    StartNewRound(/*counts_as_restart=*/true,
                  reason + "; restart " + std::to_string(restarts_used_) + " of " +
                      std::to_string(spec_->max_restarts) + wait,
                  report, now_us);
    return;
  }
  FailJob("job failed: " + reason + "; no restarts left (max_restarts " +
              std::to_string(spec_->max_restarts) + ")",
          /*config_error=*/false, report);
}

void RoundMachine::StartNewRound(bool counts_as_restart, const std::string& reason,
                                 const std::optional<FailureReport>& report, int64_t now_us) {
  ++round_;
  Cancel(TimerId::kLastCall);
  Cancel(TimerId::kDecision);
  Cancel(TimerId::kVacancy);
  vacancy_.reset();
  last_call_armed_ = false;
  round_failed_ = false;
  pending_failure_.reset();
  state_ = JobState::kWaiting;
  round_started_us_ = now_us;
  join_extended_ = false;
  Log("starting round " + std::to_string(round_) + ": " + reason);
  RestartNotice notice;
  notice.next_round = round_;
  notice.counts_as_restart = counts_as_restart;
  notice.reason = reason;
  notice.report = report;
  const Fields fields = ToFields(notice);
  for (auto& [id, s] : sessions_) {
    if (!s.participant || s.closing) continue;
    Count(id, s, -1);
    s.in_round = false;
    s.succeeded = false;
    Count(id, s, +1);
    if (s.join) continue;  // spares and newcomers already wait
    Send(id, MessageType::kRestart, fields);
  }
  Arm(TimerId::kJoin, now_us + Micros(spec_->join_timeout_s));
  MaybeCloseRound(now_us);
}

void RoundMachine::FailJob(const std::string& message, bool config_error,
                           const std::optional<FailureReport>& report) {
  for (int t = 0; t < kTimerCount; ++t) Cancel(static_cast<TimerId>(t));
  vacancy_.reset();
  state_ = JobState::kFailed;
  Log(message);
  JobFailure failure;
  failure.message = message;
  failure.config_error = config_error;
  failure.report = report;
  const Fields fields = ToFields(failure);
  for (auto& [id, s] : sessions_)
    if (!s.closing) Terminate(id, s, MessageType::kFailed, fields);
}

void RoundMachine::FinishJob() {
  for (int t = 0; t < kTimerCount; ++t) Cancel(static_cast<TimerId>(t));
  state_ = JobState::kDone;
  Log("job done: every node reported success (round " + std::to_string(round_) + ")");
  size_t spares = 0;
  for (auto& [id, s] : sessions_) {
    if (s.closing) continue;
    if (s.in_round || s.ever_assigned) {
      Terminate(id, s, MessageType::kDone, {});
      continue;
    }
    // Exit 0 would claim this agent's work was done; it never started (H4).
    JobFailure f;
    f.config_error = true;
    f.message = s.participant
                    ? "this agent never ran: the job " + Quote(spec_->run_id) +
                          " already had its maximum of " + std::to_string(spec_->max_nodes) +
                          " nodes, and it finished without needing a spare"
                    : "the job " + Quote(spec_->run_id) + " finished before this agent joined";
    ++spares;
    Terminate(id, s, MessageType::kFailed, ToFields(f));
  }
  if (spares > 0)
    Log(std::to_string(spares) + " agent(s) never ran (spares beyond the job's maximum)");
}

void RoundMachine::MaybeForget() {
  if ((state_ != JobState::kDone && state_ != JobState::kFailed) || !sessions_.empty()) return;
  if (!finished_message_.empty()) return;  // a taken-over job that was over: keep saying so
  const std::chrono::milliseconds before = heartbeat_timeout();
  state_ = JobState::kIdle;
  spec_.reset();
  spec_origin_.clear();
  round_ = 0;
  restarts_used_ = 0;
  generation_ = 0;
  resumed_round_ = -1;
  resume_quorum_ = 0;
  last_num_nodes_ = 0;
  vacancy_.reset();
  round_failed_ = false;
  pending_failure_.reset();
  last_call_armed_ = false;
  last_restart_reason_.clear();
  last_restart_report_.reset();
  if (heartbeat_timeout() != before) {
    Effect e;
    e.kind = Effect::Kind::kLiveness;
    e.heartbeat_timeout = heartbeat_timeout();
    Emit(std::move(e));
  }
  Effect idle;
  idle.kind = Effect::Kind::kIdle;
  Emit(std::move(idle));
}

Effects RoundMachine::FailAll(const std::string& message, int64_t now_us) {
  (void)now_us;
  if (state_ != JobState::kWaiting && state_ != JobState::kRunning) {  // no job in progress
    JobFailure f;
    f.message = message;
    const Fields fields = ToFields(f);
    for (auto& [id, s] : sessions_)
      if (!s.closing) Terminate(id, s, MessageType::kFailed, fields);
    return Take();
  }
  FailJob(message, /*config_error=*/false, std::nullopt);
  return Take();
}

std::string RoundMachine::CheckInvariants() const {
  size_t joined = 0, participants = 0, members = 0, unfinished = 0;
  std::map<int, SessionId> claims;
  for (const auto& [id, s] : sessions_) {
    if (s.closing) continue;
    joined += s.join ? 1 : 0;
    participants += s.participant ? 1 : 0;
    members += s.in_round ? 1 : 0;
    unfinished += s.in_round && !s.succeeded ? 1 : 0;
    if (s.participant && s.requested_rank >= 0) {
      if (!claims.emplace(s.requested_rank, id).second)
        return "two sessions claim node rank " + std::to_string(s.requested_rank);
    }
  }
  if (joined != joined_) return "joined count drifted";
  if (participants != participants_) return "participant count drifted";
  if (members != members_) return "member count drifted";
  if (unfinished != unfinished_) return "unfinished count drifted";
  if (claims != rank_claims_) return "rank claims drifted";
  if (spec_ && restarts_used_ > spec_->max_restarts) return "more restarts than max_restarts";
  if (!spec_ && state_ != JobState::kIdle) return "a job without a spec";
  if (spec_ && members_ > static_cast<size_t>(spec_->max_nodes)) return "more members than MAX";
  if (vacancy_ && state_ != JobState::kRunning) return "a vacant place outside a running round";
  if (vacancy_ && !timer_at_[static_cast<int>(TimerId::kVacancy)])
    return "a vacant place without its deadline";
  if (vacancy_) {
    for (const auto& [id, s] : sessions_)
      if (!s.closing && s.in_round && s.node_rank == vacancy_->node_rank)
        return "node rank " + std::to_string(s.node_rank) + " is vacant and held";
  }
  return "";
}

}  // namespace launch::rendezvous
