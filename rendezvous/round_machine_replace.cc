// RoundMachine (round_machine.h), in-place recovery: a dead worker's rank replaced alone
// (REPLACE), and a lost node's place held open and filled by a joining node, both without
// restarting the round's other nodes. The rest of the machine is in round_machine.cc.

#include <algorithm>

#include "base/strings.h"
#include "rendezvous/round_machine.h"

namespace launch::rendezvous {

Effects RoundMachine::OnReplace(SessionId id, ReplaceRequest request, int64_t now_us) {
  auto it = sessions_.find(id);
  if (it == sessions_.end() || it->second.closing) return Take();
  Session& s = it->second;
  s.last_heard_us = now_us;
  ReplaceAnswer answer;
  answer.round = request.round;
  answer.global_rank = request.global_rank;
  std::string refusal;
  if (state_ != JobState::kRunning || !s.in_round || request.round != round_) {
    refusal = "round " + std::to_string(request.round) + " is not running";
  } else if (!spec_->recover_in_place) {
    refusal = "the job restarts every node on a failure (--recover restart)";
  } else if (request.global_rank < s.rank_offset ||
             request.global_rank >= s.rank_offset + s.local_world_size) {
    refusal = "rank " + std::to_string(request.global_rank) + " is not one of this node's";
  } else if (pending_failure_ || round_failed_) {
    refusal = "round " + std::to_string(round_) + " has already failed; every node restarts";
  } else if (vacancy_) {
    // Two recoveries at once would announce two generations to one set of survivors.
    refusal = "node " + std::to_string(vacancy_->node_rank) +
              "'s place is still vacant: one recovery at a time";
  } else if (restarts_used_ >= spec_->max_restarts) {
    refusal = "no restarts left (max_restarts " + std::to_string(spec_->max_restarts) + ")";
  }
  if (!refusal.empty()) {
    answer.restart_count = restarts_used_;
    answer.message = refusal;
    Log("rank " + std::to_string(request.global_rank) + " on " + Describe(s) +
        " is not replaced in place: " + refusal);
  } else {
    answer.generation = ++generation_;
    answer.restart_count = ++restarts_used_;
    Log("rank " + std::to_string(request.global_rank) + " on node " + std::to_string(s.node_rank) +
        ", " + Describe(s) + ", " + SanitizeForTerminal(request.reason) +
        ": replaced alone, generation " + std::to_string(generation_) + " (restart " +
        std::to_string(restarts_used_) + " of " + std::to_string(spec_->max_restarts) +
        ", in place)");
  }
  Send(id, MessageType::kReplaced, ToFields(answer));
  return Take();
}

bool RoundMachine::CanAwaitReplacement(const Session& s) const {
  return spec_ && spec_->recover_in_place && s.node_rank != 0 && !vacancy_ && !pending_failure_ &&
         !round_failed_ && restarts_used_ < spec_->max_restarts;
}

void RoundMachine::AbandonVacancy(const std::string& why, int64_t now_us) {
  if (!vacancy_) return;
  Vacancy v = std::move(*vacancy_);
  vacancy_.reset();
  Cancel(TimerId::kVacancy);
  Log("node " + std::to_string(v.node_rank) + " is not recovered in place: " + why +
      "; its loss fails round " + std::to_string(round_) + " as with --recover restart");
  v.report.reason += "; " + why;
  ConsiderFailure(v.reason, v.report, v.since_us, now_us);
}

void RoundMachine::FillVacancy(SessionId id, Session& s, int64_t now_us) {
  const Vacancy v = std::move(*vacancy_);
  vacancy_.reset();
  Cancel(TimerId::kVacancy);
  ++restarts_used_;
  ++generation_;
  const int local_world_size = s.join->local_world_size;
  Count(id, s, -1);
  s.in_round = true;
  s.node_rank = v.node_rank;
  s.local_world_size = local_world_size;
  s.rank_offset = v.rank_offset;
  s.succeeded = false;
  s.ever_assigned = true;
  s.join.reset();
  Count(id, s, +1);
  // restart_count stays the round's: it is every worker's TORCHELASTIC_RESTART_COUNT, on which
  // their store keys depend (the survivors' and the replacements' must agree).
  Assignment a = running_;
  a.node_rank = v.node_rank;
  a.rank_offset = v.rank_offset;
  a.local_world_size = local_world_size;
  a.generation = generation_;
  a.lost_ms_ago = static_cast<int>(std::min<int64_t>((now_us - v.since_us) / 1000, 1 << 30));
  Send(id, MessageType::kAssign, ToFields(a));
  Log(Describe(s) + " takes the place of node " + std::to_string(v.node_rank) + " in round " +
      std::to_string(round_) + " (ranks " + std::to_string(v.rank_offset) + "-" +
      std::to_string(v.rank_offset + local_world_size - 1) + ", in place): generation " +
      std::to_string(generation_) + ", restart " + std::to_string(restarts_used_) + " of " +
      std::to_string(spec_->max_restarts) + "; the place was vacant for " +
      std::to_string((now_us - v.since_us) / 1000) + " ms");
}

}  // namespace launch::rendezvous
