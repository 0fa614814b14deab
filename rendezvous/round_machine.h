#pragma once

// RoundMachine: every decision of the rendezvous server (membership, round closing, rank
// assignment, root cause, restarts, the end of a job) as a pure state machine. Inputs are what
// happened to an authenticated session (JOIN, REPORT, SUCCEEDED, HEARTBEAT, its connection
// closed, a send that failed) and timer firings; outputs are Effects for the I/O shell
// (RendezvousServer) to carry out. No sockets, no timers, no clock: every input carries `now_us`,
// the server's wall clock in microseconds (WallClockMicros() in the shell, a fake in tests), and
// timers are asked for as absolute deadlines on that clock. The handshake is not in here: a
// session enters with OnAuthenticated.
//
// Rules (server.h states them for users):
//  * The first JOIN fixes the job's spec (run_id, MIN:MAX, max_restarts, fingerprint, the three
//    rdzv timeouts). A JOIN that disagrees is refused alone (ERROR, config_error) naming the
//    field, both values and the host that set the spec; the job goes on untouched.
//  * A node rank asked for by two sessions: when the holder has been silent for more than a
//    quarter of heartbeat_timeout it is replaced (ERROR to it, treated as lost); otherwise only
//    the newcomer is refused, naming both hosts.
//  * Round closing: MAX joined closes at once; MIN arms last_call; a later round closes when
//    every connected participant re-joined; below MIN at join_timeout the job fails, except that
//    a restart round waits one more join_timeout for members still connected and not yet
//    re-joined (stopping their workers: the hosting node's own agent may take stop_grace).
//  * A JOIN while the job runs: scale-up below MAX (no restart spent), otherwise a spare. A
//    spare never assigned gets FAILED when the job ends, never DONE.
//  * Failures: the earliest (by corrected time) within kRootCauseWindow of the first one is the
//    root cause; a restart while restarts remain, else FAILED. A member that reported success
//    and then leaves is benign.
//  * In-place recovery (the spec's recover_in_place, launch --recover in_place), while restarts
//    remain and the round has no failure: a REPLACE for a dead worker of a member is granted
//    (REPLACED with the next generation; one restart). A member other than node 0 that is lost
//    leaves its place vacant instead of failing the round: the next JOIN asking for its node
//    rank (or for none) with its local_world_size is ASSIGNed that place in the running round
//    (same ranks, master, round; the next generation; one restart), and the other members are
//    told nothing. No such JOIN within join_timeout, another failure, or a second loss: the lost
//    node is the round's failure as without recovery (a restart round). Node 0 hosts the
//    workers' store (MASTER_ADDR), so its loss always fails the round. One place is vacant at a
//    time. Generations are unique and increasing over the whole job.
//  * Every session gets at most one terminal message (DONE, FAILED or ERROR, then closed), and
//    every session still connected when the job ends gets exactly one.
//
// Thread-safety: none (the shell calls it from one thread). Cost: each input is O(log n) except
// those that end a round or the job, O(n log n) once per round.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "rendezvous/job_record.h"
#include "rendezvous/protocol.h"

namespace launch::rendezvous {

using SessionId = uint64_t;

enum class JobState { kIdle, kWaiting, kRunning, kDone, kFailed };

// The machine's timers; at most one of each is pending.
enum class TimerId { kJoin, kLastCall, kDecision, kVacancy };
inline constexpr int kTimerCount = 4;

// How long after a round's first failure the machine waits for an earlier one: longer than an
// agent needs to report once it has reaped a worker (drain its output, one message), shorter
// than anyone waits for a restart.
inline constexpr std::chrono::milliseconds kRootCauseWindow{300};

struct Effect {
  enum class Kind {
    kSend,          // send `type` with `fields` to `session`
    kSendAndClose,  // the same, then close it (DONE, FAILED, ERROR: the session's last word)
    kClose,         // close `session` without a message (a send to it failed)
    kArmTimer,      // arm `timer` to fire at `at_us` (replaces a pending one)
    kCancelTimer,   // cancel `timer`
    kLog,           // `text`: one line for the server's log
    kLiveness,      // every session's liveness now follows `heartbeat_timeout` (protocol.h:
                    // Connection::SetLiveness; the shell's own heartbeats at a fifth of it)
    kIdle,          // a finished job's last session closed: the job is forgotten
  };
  Kind kind = Kind::kLog;
  SessionId session = 0;
  MessageType type = MessageType::kHeartbeat;
  Fields fields;
  TimerId timer = TimerId::kJoin;
  int64_t at_us = 0;
  std::string text;
  std::chrono::milliseconds heartbeat_timeout{0};
};
using Effects = std::vector<Effect>;

class RoundMachine {
 public:
  // `default_heartbeat_timeout`: the liveness deadline before a job's spec is known.
  explicit RoundMachine(std::chrono::milliseconds default_heartbeat_timeout);

  // The spec of the job this machine is for, known before any JOIN: the hosting agent's own.
  // Until the first JOIN sets the spec, a join that disagrees with it is refused alone, as any
  // mismatch is once the job forms: another job's agent that reaches this port before the
  // host's own agent has joined must not make that job the one formed here. `origin` names
  // its holder in the refusal ("the agent hosting this rendezvous on host a").
  void Expect(JoinRequest spec, std::string origin);

  // Takes over the job of `record`, whose server was lost with its host (`reason` names it):
  // that server's round ended with it, so this machine starts the next round as a restart (one
  // restart spent; with none left the job is over and every JOIN is refused saying why). The
  // spec is the record's: a JOIN that disagrees is refused as ever. The round closes once
  // every node of the lost round but one (the lost host's) has joined, and at least MIN, after
  // last_call (a replacement node may still come), at once at MAX, or at join_timeout with MIN.
  // REQUIRES: no JOIN yet.
  Effects Resume(const JobRecord& record, const std::string& reason, int64_t now_us);
  // The job's record now; nullopt before the first JOIN set the spec.
  std::optional<JobRecord> Record() const;
  // Nodes of the latest round formed (JobRecord::num_nodes; 0: none yet).
  int last_num_nodes() const { return last_num_nodes_; }

  // A connection completed the handshake. `remote_address`: the peer's address as the server
  // sees it; `local_address`: the server's own address on that connection (what the peer
  // reached). REQUIRES: `id` new.
  Effects OnAuthenticated(SessionId id, std::string remote_address, std::string local_address,
                          int64_t now_us);
  // Frames from an authenticated session (already parsed). Unknown ids are ignored.
  Effects OnJoin(SessionId id, JoinRequest join, int64_t now_us);
  Effects OnReport(SessionId id, FailureReport report, int64_t now_us);
  Effects OnSucceeded(SessionId id, int round, int64_t now_us);
  // Answered with REPLACED: granted or refused (see the rules above).
  Effects OnReplace(SessionId id, ReplaceRequest request, int64_t now_us);
  Effects OnHeartbeat(SessionId id, int64_t now_us);
  // The connection is gone (EOF, deadline, a close the machine asked for). `why`: OK for a
  // clean close. The machine forgets the session.
  Effects OnClosed(SessionId id, const Status& why, int64_t now_us);
  // A Send of `type` to `id` failed (the message exceeds the protocol's limit; nothing was
  // sent): a job in progress fails with a message naming it; otherwise the session is closed.
  Effects OnSendFailed(SessionId id, MessageType type, const Status& why, int64_t now_us);
  // A timer armed by an Effect fired. Early or stale firings (before the deadline of the
  // arming that is pending, or with none pending) are ignored, so the shell need not filter.
  Effects OnTimer(TimerId timer, int64_t now_us);
  // FAILED with `message` to every session (the hosting agent is leaving); the job is over.
  Effects FailAll(const std::string& message, int64_t now_us);

  JobState state() const { return state_; }
  int round() const { return round_; }
  int restarts_used() const { return restarts_used_; }
  // The newest generation granted (0: none yet in this job).
  int generation() const { return generation_; }
  // The node rank whose place waits for a replacement node, or -1.
  int vacant_node() const { return vacancy_ ? vacancy_->node_rank : -1; }
  size_t session_count() const { return sessions_.size(); }
  std::chrono::milliseconds heartbeat_timeout() const;
  // Recounts everything the machine keeps incrementally; a message naming the first
  // disagreement, or "" (O(n): tests and the fuzzer).
  std::string CheckInvariants() const;

 private:
  struct Session {
    std::string remote_address;
    std::string local_address;
    std::string hostname;
    int64_t last_heard_us = 0;
    bool closing = false;             // its last word was sent (or it was replaced): counts no more
    bool participant = false;         // sent at least one accepted JOIN
    int requested_rank = -1;          // the node rank its last JOIN asked for
    std::optional<JoinRequest> join;  // pending JOIN for the round being formed
    uint64_t join_seq = 0;
    bool in_round = false;  // member of the running (or last) round
    int node_rank = -1;
    int local_world_size = 0;  // in the round it is a member of
    int rank_offset = 0;
    bool succeeded = false;
    bool ever_assigned = false;
    // Server wall clock minus the agent's, measured at its last JOIN (one-way: the transit
    // time is in it, milliseconds at most on a cluster network).
    int64_t clock_offset_us = 0;
  };
  // A lost member's place in the running round, kept for a replacement node.
  struct Vacancy {
    int node_rank = 0;
    int local_world_size = 0;
    int rank_offset = 0;
    std::string reason;    // "lost node 1 (host a (10.0.0.2))"
    FailureReport report;  // its loss, the round's failure if no replacement comes
    int64_t since_us = 0;  // server clock
  };
  struct PendingFailure {
    std::string reason;
    FailureReport report;
    int64_t at_us = 0;  // server clock
  };

  // Adds (+1) or removes (-1) a session's share of the counters and rank claims; called
  // around every change of the fields they summarise.
  void Count(SessionId id, const Session& s, int sign);
  void Refuse(SessionId id, Session& s, const std::string& message, bool config_error);
  void Terminate(SessionId id, Session& s, MessageType type, const Fields& fields);
  // The session no longer takes part (closed, or replaced): a loss when it was a member.
  void Drop(SessionId id, Session& s, const std::string& how, int64_t now_us);
  std::string SpecMismatch(const Session& s, const JoinRequest& join) const;
  std::string Describe(const Session& s) const;
  // Whether the loss of member `s` leaves its place vacant instead of failing the round.
  bool CanAwaitReplacement(const Session& s) const;
  // The vacancy's loss becomes the round's failure (no replacement, or something else failed).
  void AbandonVacancy(const std::string& why, int64_t now_us);
  void FillVacancy(SessionId id, Session& s, int64_t now_us);
  void MaybeCloseRound(int64_t now_us);
  void CloseRound(int64_t now_us);
  // MASTER_ADDR for a round whose nodes by rank are `nodes` (see CloseRound).
  std::string MasterAddress(const std::vector<const Session*>& nodes) const;
  void OnJoinTimeout(int64_t now_us);
  void ConsiderFailure(const std::string& reason, const FailureReport& report, int64_t at_us,
                       int64_t now_us);
  void AfterFailure(const std::string& reason, const FailureReport& report, int64_t now_us);
  void StartNewRound(bool counts_as_restart, const std::string& reason,
                     const std::optional<FailureReport>& report, int64_t now_us);
  void FailJob(const std::string& message, bool config_error,
               const std::optional<FailureReport>& report);
  void FinishJob();
  void MaybeForget();
  void Send(SessionId id, MessageType type, Fields fields);  // an Effect::Kind::kSend
  void Arm(TimerId timer, int64_t at_us);
  void Cancel(TimerId timer);
  void Log(std::string line);
  void Emit(Effect e) { out_.push_back(std::move(e)); }
  Effects Take();

  std::chrono::milliseconds default_heartbeat_timeout_;
  std::map<SessionId, Session> sessions_;
  Effects out_;  // effects of the input being handled

  JobState state_ = JobState::kIdle;
  std::optional<JoinRequest> spec_;      // from the first JOIN
  std::string spec_origin_;              // "host a (10.0.0.1), the first to join": who set it
  std::optional<JoinRequest> expected_;  // Expect(): checked while spec_ is unset
  std::string expected_origin_;
  int round_ = 0;
  int restarts_used_ = 0;
  int generation_ = 0;  // the newest in-place generation granted; never reset within a job
  std::optional<Vacancy> vacancy_;
  Assignment running_;  // the running round's fields common to every node (CloseRound)
  uint64_t next_join_seq_ = 1;
  bool last_call_armed_ = false;
  bool round_failed_ = false;                      // the running round already has its root cause
  std::optional<PendingFailure> pending_failure_;  // earliest failure of the running round
  std::string last_restart_reason_;                // what started the latest restart round
  std::optional<FailureReport> last_restart_report_;
  int64_t round_started_us_ = 0;
  bool join_extended_ = false;  // this restart round had its one more join_timeout
  int resumed_round_ = -1;      // Resume(): the round it started, which closes by resume_quorum_
  size_t resume_quorum_ = 0;
  int last_num_nodes_ = 0;        // nodes of the latest round formed (JobRecord::num_nodes)
  std::string finished_message_;  // why JOINs are refused after a Resume() with no restart left
  std::optional<int64_t> timer_at_[kTimerCount];  // deadline of each pending timer

  // Kept by Count() over sessions that are not closing.
  size_t joined_ = 0;                     // with a pending JOIN
  size_t participants_ = 0;               // participant
  size_t members_ = 0;                    // in_round
  size_t unfinished_ = 0;                 // in_round and not succeeded
  std::map<int, SessionId> rank_claims_;  // requested_rank of participants
};

}  // namespace launch::rendezvous
