#pragma once

// RendezvousServer: where the agents of all nodes meet. One asio::io_context, one thread,
// any number of agents; it runs inside the agent of the node that owns the endpoint, or alone
// as `launch rdzv-server --port P`. It is the I/O shell around RoundMachine (round_machine.h),
// which takes every decision below; the shell accepts connections, runs the handshake, turns
// frames, closes and timer firings into the machine's inputs and carries out its effects.
//
// What it decides (see protocol.h for the messages):
//  * Membership. The first JOIN fixes the job's spec (run_id, MIN:MAX nodes, max_restarts, the
//    config fingerprint and the rdzv timeouts join/last_call/heartbeat). A later JOIN that
//    disagrees is refused alone (ERROR, exit 2) naming the field, both values and the host
//    that set the spec; the job forming or running goes on untouched. Explicit node ranks are
//    honoured. Two agents asking for the same rank: when the one holding it has been silent
//    (no frame) for more than a quarter of heartbeat_timeout it is replaced (closed with an
//    ERROR, a lost node if it was running), otherwise the newcomer alone is refused naming
//    both hosts. The rest get the free ranks in join order.
//  * Round closing. MAX joined: close now. MIN joined: close after last_call_timeout (more may
//    come). A later round (after a restart) closes as soon as every connected agent re-joined.
//    Not MIN within join_timeout: every waiting agent fails, naming the missing ranks; a later
//    round first waits one more join_timeout when agents of the last round are still connected
//    without having re-joined (stopping their workers, up to their stop_grace).
//  * The assignment: node ranks, global rank offsets (prefix sums of each node's local world
//    size, so nodes may run different numbers of workers), MASTER_PORT = the free port node 0
//    reserved, MASTER_ADDR = node 0's address as this server saw its connection, except when
//    that is loopback (node 0 runs on this host) and some agent came from another host: then
//    this server's own address on that agent's connection (what it reached). Each node gets
//    only its own row (no node table), so an ASSIGN is small at any scale.
//  * Liveness (protocol.h): heartbeats both ways every heartbeat_timeout / 5; an agent is lost
//    when nothing arrived from it for 1.5 x heartbeat_timeout or its socket had data
//    unacknowledged that long (TCP_USER_TIMEOUT), so an outage of up to 0.8 x heartbeat_timeout
//    costs nothing; EOF (an agent killed by SIGKILL) is seen at once. An agent cut off for
//    longer comes back on its own (a new session with its machine_rank, see the rank rule).
//  * Failures. The root cause of a round is its earliest failure by time, not the first report
//    to arrive: a report carries the failure's wall-clock time (corrected by the node's clock
//    offset measured at JOIN; a lost node counts from when the server saw it go), and the
//    server decides kRootCauseWindow after the first report, taking the earliest one received
//    by then. It is relayed verbatim to every agent. While restarts remain, a new round starts
//    (RESTART to all); with fewer than MIN nodes left it waits up to join_timeout for
//    replacement agents and fails with the root cause if none comes. Without restarts left:
//    FAILED to all. A node that reported success for the round and then leaves is no failure.
//    A node joining a running job below MAX starts a new round without spending a restart
//    (scale-up); at MAX it waits as a spare.
//  * In-place recovery (launch --recover in_place on every node; compared at JOIN). A REPLACE
//    for a dead worker is granted while restarts remain and the round has not failed: REPLACED
//    with the job's next generation, one restart. A lost node other than node 0 leaves its
//    place vacant for join_timeout instead of failing the round: the next JOIN for its rank (or
//    none) with its local_world_size is ASSIGNed that place in the running round with the next
//    generation (one restart); the others are told nothing. Otherwise (node 0, a second loss, a
//    failure meanwhile, no such JOIN in time) the loss fails the round as above. Every grant
//    and vacancy is logged, with how long the place stayed vacant.
//  * The end: DONE to every node of the round as soon as each reported success; FAILED (exit 2,
//    "never ran") to a spare that was never assigned. A message the server cannot send (beyond
//    the protocol's limit) fails the job with a message, never an exception.
//  * After a job ends and every agent has gone, the server forgets it and serves the next one.
//
// Strangers. Hostile input (garbage, a 4 GiB length prefix, a client that never speaks, a wrong
// token, a frame larger than its type allows) only costs that connection: header checks,
// against each message type's own limit (protocol.h MaxPayload: tens of KiB at most towards a
// server), precede allocation, and every read and write has a deadline. A connection is a
// stranger until its first valid JOIN; without a token anyone can authenticate, so the
// handshake counts as over only then, and the round machine hears of a session only then.
//  * At most max_handshakes strangers at once; more wait (accepted, a descriptor each,
//    nothing read) for a slot, which goes to the oldest waiting connection from the address
//    with the fewest strangers in the handshake, so a flood from a few addresses cannot keep
//    an agent from another one waiting behind it.
//  * A non-loopback address may have at most max_handshakes_per_source strangers in the
//    handshake or waiting; more are refused at once.
//  * Deadlines: a stranger must JOIN within handshake_timeout of its slot; while connections
//    wait, within busy_handshake_timeout (an agent needs two round trips), so slow strangers
//    make room quickly; a connection still waiting after handshake_timeout / 2 is refused,
//    before the agent's own handshake deadline passes.
//  * Every refusal is a "busy" ERROR, on which an agent retries until join_timeout (many
//    nodes behind one NAT address get in turn). A stranger closed or refused is logged with
//    its address, at most 5 lines per stranger_log_window and then one line with the count,
//    so a flood cannot flood the log.
// So a flood of strangers costs little memory (about max_handshakes x 20 KiB of buffers at
// most) and agents are still admitted. Out of descriptors (EMFILE), accepting pauses 100 ms
// instead of spinning.
//
// Thread-safety: none; every method and callback runs on the io_context's thread.
// Lifetime: create with Create(); Stop() before dropping the last reference.

#include <array>
#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio.hpp>

#include "base/status.h"
#include "rendezvous/protocol.h"
#include "rendezvous/round_machine.h"

namespace launch::rendezvous {

class Connection;

struct ServerOptions {
  std::string host = "0.0.0.0";  // address to listen on ("::" for IPv6, "127.0.0.1", ...)
  int port = 29500;              // 0 = any free port (see RendezvousServer::port())
  std::string token;             // shared secret; empty = no token (both sides must agree)
  // A new connection must authenticate and JOIN within this (see "Strangers" above).
  std::chrono::milliseconds handshake_timeout{5000};
  // ... and within this while other connections wait for a handshake slot.
  std::chrono::milliseconds busy_handshake_timeout{1000};
  // Read deadline for authenticated agents before the job's spec (with its heartbeat_timeout)
  // is known; and the write deadline for every frame.
  std::chrono::milliseconds default_heartbeat_timeout{10000};
  std::chrono::milliseconds write_timeout{5000};
  size_t max_connections = 8192;  // more are accepted, told "busy" and closed at once
  // Connections in the handshake at once, and per source address (see above). Loopback peers
  // count only toward the total: they are this host's own processes (tests and benchmarks
  // stand in for many nodes on one machine).
  size_t max_handshakes = 64;
  size_t max_handshakes_per_source = 8;
  // Lines about strangers closed or refused: at most 5 per window, then one with the count.
  std::chrono::milliseconds stranger_log_window{10000};
  // One line per notable event ("round 0 closed: 2 nodes ..."). Null = silent.
  std::function<void(const std::string&)> log;
  // The hosting agent's own join (RoundMachine::Expect): a join that disagrees with it is
  // refused even before that agent's own JOIN arrives. Unset for a standalone server, which
  // takes its spec from whoever joins first.
  std::optional<JoinRequest> expected_join;
  std::string expected_origin;  // how refusals name it
  // Called with the job's record (round_machine.h) whenever it changed: after the first JOIN,
  // and at each new round, restart or in-place generation; the store of a backend that lets
  // another server take the job over (etcd). Null = kept nowhere.
  std::function<void(const JobRecord&)> on_record;
};

class RendezvousServer : public std::enable_shared_from_this<RendezvousServer> {
 public:
  using JobState = rendezvous::JobState;

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
  // For a hosting agent that leaves: FAILED with `message` to every agent, then no more
  // accepting, frames or decisions. The connections close once their FAILED is flushed
  // (connection_count() falls to 0 while the io_context runs, bounded by write_timeout);
  // Stop() afterwards drops whatever is left. Idempotent.
  void FailAndStop(const std::string& message);

  // Takes over the job of `record` from a server lost with its host (RoundMachine::Resume).
  // REQUIRES: no JOIN handled yet.
  void Resume(const JobRecord& record, const std::string& reason);

  JobState state() const { return machine_.state(); }
  int round() const { return machine_.round(); }
  // Every open connection, those waiting for a handshake slot included.
  size_t connection_count() const { return sessions_.size() + waiting_.size(); }
  // Connections in the handshake (strangers: not joined yet) now.
  size_t handshake_count() const { return handshakes_; }

 private:
  struct Session;
  // An accepted connection waiting for a handshake slot.
  struct Waiting {
    boost::asio::ip::tcp::socket socket;
    std::string remote_address;
    std::string local_address;
    std::chrono::steady_clock::time_point since;
  };
  RendezvousServer(boost::asio::io_context& io, ServerOptions options);

  void Accept();
  void OnAccepted(boost::asio::ip::tcp::socket socket);
  void StartHandshake(boost::asio::ip::tcp::socket socket, const std::string& remote_address,
                      const std::string& local_address);
  // The session's handshake is over (joined, refused or closed): its slot goes to a waiting
  // connection.
  void EndHandshake(Session& s);
  void Unpend(const std::string& remote_address);
  void Unwait(const std::string& remote_address);
  // Closes a stranger with a "busy" ERROR (the agent retries) and frees its slot at once.
  void RefuseStranger(Session& s, const std::string& why);
  // Enforces the strangers' deadlines (see the header comment), every few hundred ms while
  // there are strangers or log lines held back.
  void ArmSweep();
  void Sweep();
  // A line about a stranger, rate-limited (ServerOptions::stranger_log_window).
  void LogStranger(const std::string& line);
  void FlushStrangerLog(std::chrono::steady_clock::time_point now);
  void OnFrame(uint64_t id, MessageType type, Fields fields);
  void OnClosed(uint64_t id, const Status& why);
  void HandleHello(Session& s, const Fields& fields);
  // Carries out the machine's effects; `now_us` is the time the input was given at;
  // `stranger_logs`: its lines go through LogStranger.
  void Apply(Effects effects, int64_t now_us, bool stranger_logs = false);
  void ArmTimer(TimerId timer, int64_t at_us, int64_t now_us);
  void ArmHeartbeat();
  void Log(const std::string& line) const;

  boost::asio::io_context& io_;
  ServerOptions options_;
  RoundMachine machine_;
  boost::asio::ip::tcp::acceptor acceptor_;
  std::vector<boost::asio::steady_timer> timers_;  // by TimerId
  int64_t timer_at_us_[kTimerCount] = {};          // deadline each timer was armed for
  boost::asio::steady_timer heartbeat_timer_;
  boost::asio::steady_timer accept_backoff_timer_;
  boost::asio::steady_timer sweep_timer_;
  bool sweeping_ = false;  // sweep_timer_ is armed
  std::chrono::milliseconds heartbeat_interval_{0};
  int bound_port_ = 0;
  bool stopped_ = false;
  bool failing_ = false;         // FailAndStop: the sessions drain, nothing else happens
  bool accepting_ = false;       // an async_accept is pending
  bool accept_failing_ = false;  // the last accept failed (logged once per episode)
  // What on_record last saw: round, restarts, generation, nodes (-1: nothing yet).
  std::array<int, 4> recorded_{-1, -1, -1, -1};

  std::map<uint64_t, std::unique_ptr<Session>> sessions_;
  uint64_t next_session_id_ = 1;
  size_t handshakes_ = 0;
  // Connections in the handshake or waiting for it, by source address.
  std::map<std::string, size_t> pending_by_source_;
  // Connections in the handshake, by source address (which waiting one gets a free slot).
  std::map<std::string, size_t> handshakes_by_source_;
  std::deque<Waiting> waiting_;                      // for a handshake slot, oldest first
  std::map<std::string, size_t> waiting_by_source_;  // how many of them, by source address
  // The stranger log's window: when it began, lines written, lines held back, the last one.
  std::chrono::steady_clock::time_point stranger_window_start_;
  size_t stranger_lines_ = 0;
  size_t stranger_held_ = 0;
  std::string stranger_last_;
};

}  // namespace launch::rendezvous
