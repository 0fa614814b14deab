#include "rendezvous/server.h"

#include <algorithm>
#include <set>
#include <vector>

#include "base/strings.h"
#include "rendezvous/auth.h"
#include "rendezvous/connection.h"

namespace launch::rendezvous {

namespace {
std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0 + 0.5));
}
std::string Quote(const std::string& s) { return "'" + SanitizeForTerminal(s) + "'"; }
}  // namespace

// One agent's connection and what the server knows about it.
struct RendezvousServer::Session {
  uint64_t id = 0;
  std::shared_ptr<Connection> conn;
  std::string server_nonce;
  bool authenticated = false;
  bool participant = false;         // sent at least one JOIN (an agent of this job)
  int requested_rank = -1;          // the node rank its last JOIN asked for
  std::optional<JoinRequest> join;  // pending JOIN for the round being formed
  uint64_t join_seq = 0;
  std::string hostname;
  // Membership in the running round.
  bool in_round = false;
  int node_rank = -1;
  bool succeeded = false;
  // Server wall clock minus the agent's, measured at its last JOIN (one-way: the message's
  // transit time is in it, milliseconds at most on a cluster network).
  int64_t clock_offset_us = 0;
};

namespace {
// How long after a round's first failure report the server waits for an earlier one: longer
// than an agent needs to report (drain the failed worker's output, one message) once it has
// reaped a worker, shorter than anyone waits for a restart.
constexpr std::chrono::milliseconds kRootCauseWindow{300};
}  // namespace

std::shared_ptr<RendezvousServer> RendezvousServer::Create(boost::asio::io_context& io,
                                                           ServerOptions options) {
  return std::shared_ptr<RendezvousServer>(new RendezvousServer(io, std::move(options)));
}

RendezvousServer::RendezvousServer(boost::asio::io_context& io, ServerOptions options)
    : io_(io),
      options_(std::move(options)),
      acceptor_(io),
      join_timer_(io),
      last_call_timer_(io),
      heartbeat_timer_(io),
      decision_timer_(io) {}

RendezvousServer::~RendezvousServer() { Stop(); }

Status RendezvousServer::Listen() {
  boost::system::error_code ec;
  auto address = asio::ip::make_address(options_.host, ec);
  if (ec)
    return Status::InvalidConfig("rendezvous listen address '" + options_.host +
                                 "' is not an IP address");
  tcp::endpoint endpoint(address, static_cast<unsigned short>(options_.port));
  std::string where = FormatEndpoint(options_.host, options_.port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (ec == asio::error::address_in_use)
    return Status::IoError("rendezvous port " + where + " is already in use");
  if (ec == boost::system::errc::address_not_available)
    return Status::IoError("cannot listen on " + where + ": the address is not on this machine");
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return Status::IoError("cannot listen on " + where + ": " + ec.message());
  bound_port_ = acceptor_.local_endpoint(ec).port();
  Accept();
  ArmHeartbeat();
  return Status::Ok();
}

void RendezvousServer::Stop() {
  if (stopped_) return;
  stopped_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  join_timer_.cancel();
  last_call_timer_.cancel();
  heartbeat_timer_.cancel();
  decision_timer_.cancel();
  for (auto& [id, s] : sessions_) s->conn->Detach();
  sessions_.clear();
}

void RendezvousServer::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

std::string RendezvousServer::Describe(const Session& s) const {
  std::string host = s.hostname.empty() ? "?" : SanitizeForTerminal(s.hostname);
  return "host " + host + " (" + s.conn->remote_address() + ")";
}

std::chrono::milliseconds RendezvousServer::HeartbeatTimeout() const {
  return spec_ ? Millis(spec_->heartbeat_timeout_s) : options_.default_heartbeat_timeout;
}

void RendezvousServer::Accept() {
  acceptor_.async_accept(
      [self = shared_from_this()](const boost::system::error_code& ec, tcp::socket socket) {
        if (self->stopped_) return;
        if (!ec) {
          if (self->sessions_.size() >= self->options_.max_connections) {
            boost::system::error_code ignored;
            socket.close(ignored);
          } else {
            auto session = std::make_unique<Session>();
            session->id = self->next_session_id_++;
            session->conn = Connection::Create(std::move(socket));
            session->server_nonce = RandomNonce();
            Session& s = *session;
            self->sessions_.emplace(s.id, std::move(session));
            uint64_t id = s.id;
            std::weak_ptr<RendezvousServer> weak = self;
            s.conn->SetReadTimeout(self->options_.handshake_timeout);
            s.conn->SetWriteTimeout(self->options_.write_timeout);
            s.conn->Start({[weak, id](MessageType type, Fields fields) {
                             if (auto server = weak.lock())
                               server->OnFrame(id, type, std::move(fields));
                           },
                           [weak, id](Status why) {
                             if (auto server = weak.lock()) server->OnClosed(id, why);
                           }});
            s.conn->Send(MessageType::kChallenge, {{"nonce", s.server_nonce}});
          }
        } else if (ec == asio::error::operation_aborted) {
          return;
        }
        // EMFILE and friends: keep accepting; the failed connection is simply gone.
        self->Accept();
      });
}

void RendezvousServer::ArmHeartbeat() {
  heartbeat_timer_.expires_after(std::max(HeartbeatTimeout() / 4, std::chrono::milliseconds(10)));
  heartbeat_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->stopped_) return;
    for (auto& [id, s] : self->sessions_) {
      if (s->authenticated && !s->conn->closed()) s->conn->Send(MessageType::kHeartbeat, {});
    }
    self->ArmHeartbeat();
  });
}

void RendezvousServer::OnFrame(uint64_t id, MessageType type, Fields fields) {
  auto it = sessions_.find(id);
  if (stopped_ || it == sessions_.end()) return;
  Session& s = *it->second;
  if (!s.authenticated) {
    if (type != MessageType::kHello) {
      s.conn->Close(Status::ProtocolError(std::string("expected HELLO, got ") + ToString(type)));
      return;
    }
    HandleHello(s, fields);
    return;
  }
  switch (type) {
    case MessageType::kHeartbeat:
      return;
    case MessageType::kJoin: {
      StatusOr<JoinRequest> join = ParseJoin(fields);  // validated by the connection already
      if (join.ok()) HandleJoin(s, std::move(join).value());
      return;
    }
    case MessageType::kReport: {
      StatusOr<FailureReport> report = ParseFailureReport(fields);
      if (report.ok()) HandleReport(s, std::move(report).value());
      return;
    }
    case MessageType::kSucceeded: {
      long long round = -1;
      ParseInt64(fields["round"], &round);
      HandleSucceeded(s, static_cast<int>(round));
      return;
    }
    default:
      Log("closing " + Describe(s) + ": unexpected " + ToString(type) + " from an agent");
      s.conn->Close(Status::ProtocolError(std::string("unexpected ") + ToString(type)));
      return;
  }
}

void RendezvousServer::HandleHello(Session& s, const Fields& fields) {
  StatusOr<Hello> hello = ParseHello(fields);
  if (!hello.ok()) {
    s.conn->Close(hello.status());
    return;
  }
  std::string expected =
      ComputeProof(options_.token, ProofRole::kAgent, s.server_nonce, hello->nonce);
  if (!ConstantTimeEquals(expected, hello->proof)) {
    Log("refused an agent at " + s.conn->remote_address() +
        ": wrong or missing rdzv_token (authentication failed)");
    ErrorMessage err;
    err.auth_error = true;
    err.message = "the rendezvous server refused this agent: wrong or missing rdzv_token";
    s.conn->SendAndClose(MessageType::kError, ToFields(err));
    return;
  }
  s.authenticated = true;
  s.conn->SetReadTimeout(HeartbeatTimeout());
  s.conn->Send(
      MessageType::kWelcome,
      {{"proof", ComputeProof(options_.token, ProofRole::kServer, hello->nonce, s.server_nonce)}});
  // Every later frame, both ways, carries a MAC under this session's key.
  s.conn->StartAuthenticated(SessionKey(options_.token, s.server_nonce, hello->nonce),
                             MacDirection::kToAgent);
}

std::string RendezvousServer::SpecMismatch(const Session& s, const JoinRequest& j) const {
  const JoinRequest& spec = *spec_;
  std::string who = Describe(s);
  auto mismatch = [&](const std::string& field, const std::string& mine,
                      const std::string& theirs) {
    return field + " mismatch: " + who + " has " + mine + " but " + spec_origin_ +
           ", the first to join, has " + theirs;
  };
  if (j.run_id != spec.run_id) return mismatch("run_id", Quote(j.run_id), Quote(spec.run_id));
  if (j.min_nodes != spec.min_nodes || j.max_nodes != spec.max_nodes) {
    auto nn = [](const JoinRequest& r) {
      return r.min_nodes == r.max_nodes
                 ? std::to_string(r.min_nodes)
                 : std::to_string(r.min_nodes) + ":" + std::to_string(r.max_nodes);
    };
    return mismatch("num_machines (nnodes)", nn(j), nn(spec));
  }
  if (j.max_restarts != spec.max_restarts)
    return mismatch("max_restarts", std::to_string(j.max_restarts),
                    std::to_string(spec.max_restarts));
  if (j.fingerprint != spec.fingerprint)
    return mismatch("config fingerprint", Quote(j.fingerprint), Quote(spec.fingerprint));
  if (j.node_rank >= spec.max_nodes)
    return "machine_rank " + std::to_string(j.node_rank) + " of " + who +
           " is not below num_machines " + std::to_string(spec.max_nodes);
  return "";
}

void RendezvousServer::Refuse(Session& s, const std::string& message, bool config_error) {
  Log("refused " + Describe(s) + ": " + message);
  ErrorMessage err;
  err.config_error = config_error;
  err.message = message;
  s.conn->SendAndClose(MessageType::kError, ToFields(err));
}

void RendezvousServer::HandleJoin(Session& s, JoinRequest join) {
  s.hostname = join.hostname;
  if (join.clock_us > 0) s.clock_offset_us = WallClockMicros() - join.clock_us;
  if (state_ == JobState::kDone || state_ == JobState::kFailed) {
    Refuse(s, "the job on this rendezvous has already finished", false);
    return;
  }
  if (!spec_) {
    if (join.node_rank >= join.max_nodes) {
      Refuse(s,
             "machine_rank " + std::to_string(join.node_rank) + " is not below num_machines " +
                 std::to_string(join.max_nodes),
             true);
      return;
    }
    spec_ = join;
    spec_origin_ = Describe(s);
    state_ = JobState::kWaiting;
    round_ = 0;
    restarts_used_ = 0;
    round_started_ = std::chrono::steady_clock::now();
    for (auto& [id, other] : sessions_)
      if (other->authenticated) other->conn->SetReadTimeout(HeartbeatTimeout());
    heartbeat_timer_.cancel();  // re-armed at the job's own pace
    ArmHeartbeat();
    // The join deadline for round 0 starts with the first agent.
    uint64_t generation = ++timer_generation_;
    join_timer_.expires_after(Millis(spec_->join_timeout_s));
    join_timer_.async_wait(
        [self = shared_from_this(), generation](const boost::system::error_code& ec) {
          if (ec || self->stopped_ || generation != self->timer_generation_) return;
          self->OnJoinTimeout();
        });
    Log("job '" + SanitizeForTerminal(spec_->run_id) + "': first agent " + Describe(s) +
        " joined; waiting for " +
        (spec_->min_nodes == spec_->max_nodes
             ? std::to_string(spec_->min_nodes)
             : std::to_string(spec_->min_nodes) + " to " + std::to_string(spec_->max_nodes)) +
        " nodes");
  } else {
    std::string mismatch = SpecMismatch(s, join);
    if (!mismatch.empty()) {
      if (state_ == JobState::kWaiting && round_ == 0) {
        FailJob(mismatch, /*config_error=*/true, std::nullopt);
      } else {
        Refuse(s, mismatch, true);
      }
      return;
    }
  }
  // Two agents asking for the same node rank.
  if (join.node_rank >= 0) {
    for (auto& [id, other] : sessions_) {
      if (other.get() == &s || other->conn->closed()) continue;
      bool clash = other->participant && other->requested_rank == join.node_rank;
      if (!clash) continue;
      std::string message = "duplicate machine_rank " + std::to_string(join.node_rank) + ": " +
                            Describe(*other) + " and " + Describe(s) + " both claim it";
      if (state_ == JobState::kWaiting && round_ == 0) {
        FailJob(message, /*config_error=*/true, std::nullopt);
      } else {
        Refuse(s, message, true);
      }
      return;
    }
  }
  s.participant = true;
  s.requested_rank = join.node_rank;
  s.join = std::move(join);
  s.join_seq = next_join_seq_++;

  if (state_ == JobState::kRunning) {
    if (s.in_round) {
      // A member that re-joins on its own (it lost its workers' state): treat as a failure
      // of that node so everyone re-forms.
      s.in_round = false;
      FailureReport r;
      r.round = round_;
      r.host = s.hostname;
      r.node_rank = s.node_rank;
      r.reason = "node re-joined while the round was running";
      if (!round_failed_) {
        round_failed_ = true;
        AfterFailure(r.reason, r);
      }
      return;
    }
    size_t members = 0;
    for (auto& [id, other] : sessions_) members += other->in_round ? 1 : 0;
    if (members < static_cast<size_t>(spec_->max_nodes)) {
      StartNewRound(/*counts_as_restart=*/false, "scale-up: " + Describe(s) + " joined",
                    std::nullopt);
    } else {
      Log(Describe(s) + " waits as a spare: the job already has its maximum of " +
          std::to_string(spec_->max_nodes) + " nodes");
    }
    return;
  }
  MaybeCloseRound();
}

size_t RendezvousServer::CountJoined() const {
  size_t n = 0;
  for (auto& [id, s] : sessions_) n += (s->join && !s->conn->closed()) ? 1 : 0;
  return n;
}

size_t RendezvousServer::CountParticipants() const {
  size_t n = 0;
  for (auto& [id, s] : sessions_) n += (s->participant && !s->conn->closed()) ? 1 : 0;
  return n;
}

void RendezvousServer::MaybeCloseRound() {
  if (state_ != JobState::kWaiting || !spec_) return;
  size_t joined = CountJoined();
  size_t min_nodes = static_cast<size_t>(spec_->min_nodes);
  size_t max_nodes = static_cast<size_t>(spec_->max_nodes);
  if (joined >= max_nodes) {
    CloseRound();
    return;
  }
  if (joined < min_nodes) return;
  // A re-formed round waits for every agent still connected (they are stopping their workers
  // and come back within moments; one that hangs is bounded by join_timeout), and no longer.
  if (round_ > 0) {
    if (joined >= CountParticipants()) CloseRound();
    return;
  }
  if (spec_->last_call_timeout_s <= 0) {
    CloseRound();
    return;
  }
  if (last_call_armed_) return;
  last_call_armed_ = true;
  uint64_t generation = timer_generation_;
  last_call_timer_.expires_after(Millis(spec_->last_call_timeout_s));
  last_call_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->stopped_ || generation != self->timer_generation_) return;
        if (self->state_ == JobState::kWaiting &&
            self->CountJoined() >= static_cast<size_t>(self->spec_->min_nodes))
          self->CloseRound();
      });
}

void RendezvousServer::CloseRound() {
  ++timer_generation_;
  join_timer_.cancel();
  last_call_timer_.cancel();
  last_call_armed_ = false;

  std::vector<Session*> joined;
  for (auto& [id, s] : sessions_)
    if (s->join && !s->conn->closed()) joined.push_back(s.get());
  std::sort(joined.begin(), joined.end(),
            [](const Session* a, const Session* b) { return a->join_seq < b->join_seq; });
  size_t n = std::min(joined.size(), static_cast<size_t>(spec_->max_nodes));
  // Explicit ranks below n first; explicit ranks that no longer fit (elastic jobs that
  // formed with fewer nodes) and unassigned agents fill the free ranks in join order.
  std::vector<Session*> by_rank(n, nullptr);
  std::vector<Session*> rest;
  for (size_t i = 0; i < joined.size(); ++i) {
    Session* s = joined[i];
    int want = s->join->node_rank;
    if (i < n && want >= 0 && static_cast<size_t>(want) < n && by_rank[want] == nullptr) {
      by_rank[want] = s;
    } else if (i < n) {
      rest.push_back(s);
    }
  }
  size_t next = 0;
  for (Session* s : rest) {
    while (by_rank[next] != nullptr) ++next;
    by_rank[next] = s;
  }
  Assignment a;
  a.round = round_;
  a.restart_count = restarts_used_;
  a.max_restarts = spec_->max_restarts;
  a.num_nodes = static_cast<int>(n);
  a.run_id = spec_->run_id;
  int offset = 0;
  for (size_t r = 0; r < n; ++r) {
    NodeInfo info;
    info.node_rank = static_cast<int>(r);
    info.host = by_rank[r]->join->hostname;
    info.address = by_rank[r]->conn->remote_address();
    info.local_world_size = by_rank[r]->join->local_world_size;
    info.rank_offset = offset;
    offset += info.local_world_size;
    a.nodes.push_back(std::move(info));
  }
  a.world_size = offset;
  a.master_addr = by_rank[0]->conn->remote_address();
  a.master_port = by_rank[0]->join->master_port;
  // Encode the shared part (with the node table) once; only three fields differ per node.
  Fields fields = ToFields(a);
  for (size_t r = 0; r < n; ++r) {
    Session* s = by_rank[r];
    s->in_round = true;
    s->node_rank = static_cast<int>(r);
    s->succeeded = false;
    s->join.reset();
    fields["node_rank"] = std::to_string(r);
    fields["rank_offset"] = std::to_string(a.nodes[r].rank_offset);
    fields["local_world_size"] = std::to_string(a.nodes[r].local_world_size);
    s->conn->Send(MessageType::kAssign, fields);
  }
  state_ = JobState::kRunning;
  round_failed_ = false;
  pending_failure_.reset();
  auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
      std::chrono::steady_clock::now() - round_started_);
  Log("round " + std::to_string(round_) + " closed: " + std::to_string(n) + " nodes, world size " +
      std::to_string(a.world_size) + ", master " + FormatEndpoint(a.master_addr, a.master_port) +
      " (" + std::to_string(took.count()) + " ms)");
}

void RendezvousServer::OnJoinTimeout() {
  if (state_ != JobState::kWaiting) return;
  size_t joined = CountJoined();
  if (joined >= static_cast<size_t>(spec_->min_nodes)) {
    CloseRound();
    return;
  }
  std::set<int> claimed;
  std::vector<std::string> present;
  for (auto& [id, s] : sessions_) {
    if (!s->join || s->conn->closed()) continue;
    if (s->join->node_rank >= 0) claimed.insert(s->join->node_rank);
    present.push_back(Describe(*s) + (s->join->node_rank >= 0
                                          ? " as rank " + std::to_string(s->join->node_rank)
                                          : ""));
  }
  std::vector<std::string> unclaimed;
  for (int r = 0; r < spec_->min_nodes; ++r)
    if (!claimed.count(r)) unclaimed.push_back(std::to_string(r));
  std::string message = "rendezvous timed out after " +
                        std::to_string(static_cast<long long>(spec_->join_timeout_s)) +
                        " s: " + std::to_string(joined) + " of " +
                        std::to_string(spec_->min_nodes) + " nodes joined (" + Join(present, ", ") +
                        "); missing " + std::to_string(spec_->min_nodes - joined) +
                        " node(s), unclaimed node ranks: " + Join(unclaimed, ", ");
  if (round_ > 0) {
    // A restart round that never re-formed: no replacement for a lost node arrived. The job
    // ends with the failure that started the round as its root cause.
    FailJob("job failed: " + last_restart_reason_ + "; no replacement node joined: " + message,
            /*config_error=*/false, last_restart_report_);
    return;
  }
  FailJob(message, /*config_error=*/true, std::nullopt);
}

void RendezvousServer::HandleReport(Session& s, FailureReport report) {
  if (state_ != JobState::kRunning || !s.in_round || report.round != round_) return;
  // The server knows who the sender is; the report's host/node fields are its own word.
  report.host = s.hostname;
  report.node_rank = s.node_rank;
  if (round_failed_) {
    Log("later failure in round " + std::to_string(round_) + " from " + Describe(s) + ": " +
        SanitizeForTerminal(report.reason));
    return;
  }
  const int64_t at = report.time_us > 0 ? report.time_us + s.clock_offset_us : WallClockMicros();
  ConsiderFailure("worker failure on " + Describe(s), report, at);
}

void RendezvousServer::ConsiderFailure(const std::string& reason, const FailureReport& report,
                                       int64_t at_us) {
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
  const uint64_t generation = timer_generation_;
  decision_timer_.expires_after(kRootCauseWindow);
  decision_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->stopped_ || generation != self->timer_generation_) return;
        self->DecideFailure();
      });
}

void RendezvousServer::DecideFailure() {
  if (!pending_failure_ || state_ != JobState::kRunning || round_failed_) return;
  PendingFailure root = std::move(*pending_failure_);
  pending_failure_.reset();
  round_failed_ = true;
  AfterFailure(root.reason, root.report);
}

void RendezvousServer::HandleSucceeded(Session& s, int round) {
  if (state_ != JobState::kRunning || !s.in_round || round != round_) return;
  s.succeeded = true;
  for (auto& [id, other] : sessions_)
    if (other->in_round && !other->succeeded) return;
  FinishJob();
}

void RendezvousServer::OnClosed(uint64_t id, const Status& why) {
  auto it = sessions_.find(id);
  if (stopped_ || it == sessions_.end()) return;
  std::unique_ptr<Session> s = std::move(it->second);
  sessions_.erase(it);
  // A peer that broke the protocol after authenticating holds the token (or forged a frame):
  // worth a line whatever the job's state.
  if (s->authenticated &&
      (why.code() == Status::Code::kAuthFailed || why.code() == Status::Code::kProtocolError))
    Log("closed the connection of " + Describe(*s) + ": " + why.message());
  if (state_ == JobState::kRunning && s->in_round && !round_failed_) {
    std::string how = why.ok() ? "connection closed" : why.message();
    Log("lost node " + std::to_string(s->node_rank) + ", " + Describe(*s) + ": " + how);
    FailureReport r;
    r.round = round_;
    r.host = s->hostname;
    r.node_rank = s->node_rank;
    r.reason = "node lost (" + how + ")";
    ConsiderFailure("lost node " + std::to_string(s->node_rank) + " (" + Describe(*s) + ")", r,
                    WallClockMicros());
  } else if (state_ == JobState::kRunning && s->in_round) {
    Log("lost " + Describe(*s) + " after the round's failure: " + why.ToString());
  } else if (state_ == JobState::kWaiting && s->participant) {
    Log(Describe(*s) + " left while the round was forming: " + why.ToString());
    MaybeCloseRound();
  }
  ResetIfIdle();
}

void RendezvousServer::AfterFailure(const std::string& reason, const FailureReport& report) {
  const size_t left = CountParticipants();
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
                  report);
    return;
  }
  FailJob("job failed: " + reason + "; no restarts left (max_restarts " +
              std::to_string(spec_->max_restarts) + ")",
          /*config_error=*/false, report);
}

void RendezvousServer::StartNewRound(bool counts_as_restart, const std::string& reason,
                                     const std::optional<FailureReport>& report) {
  ++round_;
  ++timer_generation_;
  last_call_timer_.cancel();
  last_call_armed_ = false;
  state_ = JobState::kWaiting;
  round_started_ = std::chrono::steady_clock::now();
  Log("starting round " + std::to_string(round_) + ": " + reason);
  RestartNotice notice;
  notice.next_round = round_;
  notice.counts_as_restart = counts_as_restart;
  notice.reason = reason;
  notice.report = report;
  Fields fields = ToFields(notice);
  for (auto& [id, s] : sessions_) {
    if (!s->participant || s->conn->closed()) continue;
    s->in_round = false;
    if (!s->join) s->conn->Send(MessageType::kRestart, fields);  // spares already wait
  }
  uint64_t generation = timer_generation_;
  join_timer_.expires_after(Millis(spec_->join_timeout_s));
  join_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->stopped_ || generation != self->timer_generation_) return;
        self->OnJoinTimeout();
      });
  MaybeCloseRound();
}

void RendezvousServer::FailJob(const std::string& message, bool config_error,
                               const std::optional<FailureReport>& report) {
  ++timer_generation_;
  join_timer_.cancel();
  last_call_timer_.cancel();
  state_ = JobState::kFailed;
  Log(message);
  JobFailure failure;
  failure.message = message;
  failure.config_error = config_error;
  failure.report = report;
  Fields fields = ToFields(failure);
  for (auto& [id, s] : sessions_) {
    if (s->authenticated) {
      s->conn->SendAndClose(MessageType::kFailed, fields);
    } else {
      s->conn->Close(Status::Ok());
    }
  }
}

void RendezvousServer::FinishJob() {
  ++timer_generation_;
  state_ = JobState::kDone;
  Log("job done: every node reported success (round " + std::to_string(round_) + ")");
  for (auto& [id, s] : sessions_) {
    if (s->authenticated) {
      s->conn->SendAndClose(MessageType::kDone, {});
    } else {
      s->conn->Close(Status::Ok());
    }
  }
}

void RendezvousServer::ResetIfIdle() {
  if ((state_ != JobState::kDone && state_ != JobState::kFailed) || !sessions_.empty()) return;
  state_ = JobState::kIdle;
  spec_.reset();
  spec_origin_.clear();
  round_ = 0;
  restarts_used_ = 0;
  round_failed_ = false;
  if (on_idle_) on_idle_();
}

}  // namespace launch::rendezvous
