#pragma once

// RendezvousServer: where the agents of all nodes meet. One asio::io_context, one thread,
// any number of agents; it runs inside the agent of the node that owns the endpoint, or alone
// as `launch rdzv-server --port P`.
//
// What it decides (see protocol.h for the messages):
//  * Membership. The first JOIN fixes the job's spec (run_id, MIN:MAX nodes, max_restarts, the
//    config fingerprint and the rdzv timeouts); a later JOIN that disagrees is refused with the
//    field and both values — before the first round closes, every waiting agent fails with it,
//    so nobody waits for a timeout. Explicit node ranks are honoured; two agents asking for the
//    same rank fail at once, naming both hosts. The rest get the free ranks in join order.
//  * Round closing. MAX joined: close now. MIN joined: close after last_call_timeout (more may
//    come). A later round (after a restart) closes as soon as every connected agent re-joined.
//    Not MIN within join_timeout: every waiting agent fails, naming the missing ranks.
//  * The assignment: node ranks, global rank offsets (prefix sums of each node's local world
//    size, so nodes may run different numbers of workers), MASTER_ADDR = node 0's address as
//    this server saw its connection, MASTER_PORT = the free port node 0 reserved and sent.
//  * Liveness. Every frame read has a deadline of heartbeat_timeout (agents send heartbeats at
//    a quarter of it); EOF (an agent killed by SIGKILL) is seen at once.
//  * Failures. The root cause of a round is its earliest failure by time, not the first report
//    to arrive: a report carries the failure's wall-clock time (corrected by the node's clock
//    offset measured at JOIN; a lost node counts from when the server saw it go), and the
//    server decides kRootCauseWindow after the first report, taking the earliest one received
//    by then (agents report a failure as soon as the worker's output is drained, before its
//    siblings stop, so a collateral failure elsewhere cannot overtake it). It is relayed
//    verbatim to every agent. While restarts remain, a new round starts (RESTART to all);
//    with fewer than MIN nodes left it waits up to join_timeout for replacement agents (a
//    restarted machine, or another one taking the lost node rank) and fails with the root
//    cause if none comes. Without restarts left: FAILED to all. A node joining a running job below
//    MAX starts a new round without spending a restart (scale-up).
//  * Success: DONE to every agent as soon as every node of the round reported success.
//  * After a job ends and every agent has gone, the server forgets it and serves the next one.
//
// Hostile input (garbage, a 4 GiB length prefix, a client that never speaks, a wrong token) only
// costs that connection: header checks precede allocation and every read and write has a
// deadline.
//
// Thread-safety: none; every method and callback runs on the io_context's thread.
// Lifetime: create with Create(); Stop() before dropping the last reference.

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio.hpp>

#include "base/status.h"
#include "rendezvous/protocol.h"

namespace launch::rendezvous {

class Connection;

struct ServerOptions {
  std::string host = "0.0.0.0";  // address to listen on ("::" for IPv6, "127.0.0.1", ...)
  int port = 29500;              // 0 = any free port (see RendezvousServer::port())
  std::string token;             // shared secret; empty = no token (both sides must agree)
  // A new connection must authenticate within this.
  std::chrono::milliseconds handshake_timeout{5000};
  // Read deadline for authenticated agents before the job's spec (with its heartbeat_timeout)
  // is known; and the write deadline for every frame.
  std::chrono::milliseconds default_heartbeat_timeout{5000};
  std::chrono::milliseconds write_timeout{5000};
  size_t max_connections = 8192;  // more are accepted and closed at once
  // One line per notable event ("round 0 closed: 2 nodes ..."). Null = silent.
  std::function<void(const std::string&)> log;
};

class RendezvousServer : public std::enable_shared_from_this<RendezvousServer> {
 public:
  enum class JobState { kIdle, kWaiting, kRunning, kDone, kFailed };

  static std::shared_ptr<RendezvousServer> Create(boost::asio::io_context& io,
                                                  ServerOptions options);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  // Binds and listens. IoError with one line naming the address when the port is in use or
  // the address is not local ("rendezvous port 127.0.0.1:29500 is already in use").
  // REQUIRES: called once, before the io_context runs the server's work.
  Status Listen();
  // The bound port (useful with port 0). REQUIRES: Listen() succeeded.
  int port() const { return bound_port_; }
  // Closes the acceptor, every connection and timer. Idempotent.
  void Stop();

  JobState state() const { return state_; }
  int round() const { return round_; }
  size_t connection_count() const { return sessions_.size(); }
  // Called each time a finished job's last connection has closed (the job was forgotten).
  void SetIdleCallback(std::function<void()> on_idle) { on_idle_ = std::move(on_idle); }

 private:
  struct Session;
  RendezvousServer(boost::asio::io_context& io, ServerOptions options);

  void Accept();
  void OnFrame(uint64_t id, MessageType type, Fields fields);
  void OnClosed(uint64_t id, const Status& why);
  void HandleHello(Session& s, const Fields& fields);
  void HandleJoin(Session& s, JoinRequest join);
  void HandleReport(Session& s, FailureReport report);
  void HandleSucceeded(Session& s, int round);
  // Compares a JOIN with the job's spec; "" when it matches.
  std::string SpecMismatch(const Session& s, const JoinRequest& join) const;
  void Refuse(Session& s, const std::string& message, bool config_error);
  void MaybeCloseRound();
  void CloseRound();
  void OnJoinTimeout();
  void AfterFailure(const std::string& reason, const FailureReport& report);
  // A failure of the running round, at `at_us` on the server's clock: a candidate root cause
  // until DecideFailure (kRootCauseWindow after the first one).
  void ConsiderFailure(const std::string& reason, const FailureReport& report, int64_t at_us);
  void DecideFailure();
  void StartNewRound(bool counts_as_restart, const std::string& reason,
                     const std::optional<FailureReport>& report);
  void FailJob(const std::string& message, bool config_error,
               const std::optional<FailureReport>& report);
  void FinishJob();
  void ArmHeartbeat();
  void ResetIfIdle();
  std::chrono::milliseconds HeartbeatTimeout() const;
  size_t CountJoined() const;
  size_t CountParticipants() const;
  void Log(const std::string& line) const;
  std::string Describe(const Session& s) const;

  boost::asio::io_context& io_;
  ServerOptions options_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer join_timer_;
  boost::asio::steady_timer last_call_timer_;
  boost::asio::steady_timer heartbeat_timer_;
  boost::asio::steady_timer decision_timer_;
  int bound_port_ = 0;
  bool stopped_ = false;
  std::function<void()> on_idle_;

  std::map<uint64_t, std::unique_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 1;
  uint64_t next_join_seq_ = 1;

  JobState state_ = JobState::kIdle;
  std::optional<JoinRequest> spec_;  // from the first JOIN
  std::string spec_origin_;          // "host a (10.0.0.1)": who set the spec
  int round_ = 0;
  int restarts_used_ = 0;
  bool last_call_armed_ = false;
  bool round_failed_ = false;  // the running round already has its root cause
  struct PendingFailure {
    std::string reason;
    FailureReport report;
    int64_t at_us = 0;  // server clock
  };
  std::optional<PendingFailure> pending_failure_;  // earliest failure of the running round
  std::string last_restart_reason_;                // what started the latest restart round
  std::optional<FailureReport> last_restart_report_;
  std::chrono::steady_clock::time_point round_started_;
  uint64_t timer_generation_ = 0;  // invalidates join/last-call timers of older rounds
};

}  // namespace launch::rendezvous
