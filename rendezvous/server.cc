#include "rendezvous/server.h"

#include <algorithm>
#include <utility>

#include "base/strings.h"
#include "rendezvous/auth.h"
#include "rendezvous/connection.h"

namespace launch::rendezvous {

// One connection: the handshake's state here; everything about the agent is in the machine.
struct RendezvousServer::Session {
  uint64_t id = 0;
  std::shared_ptr<Connection> conn;
  std::string server_nonce;
  std::string remote_address;
  std::string local_address;  // this server's address on the connection
  bool in_handshake = false;  // holds a handshake slot
  bool authenticated = false;
};

namespace {
// Pause after an accept that failed for want of resources (EMFILE, ENFILE, ENOBUFS): the
// pending connection stays in the backlog, so accepting again at once would spin.
constexpr std::chrono::milliseconds kAcceptBackoff{100};

// Closes a connection there is no room for, first telling the peer (one small unauthenticated
// frame, written without blocking; lost if the peer's window is full, which costs the peer
// only a clear message) that it may try again: an agent behind a NAT shared by many nodes, or
// one of thousands connecting at once, retries until join_timeout instead of failing.
void RefuseBusy(boost::asio::ip::tcp::socket& socket, const std::string& why) {
  ErrorMessage busy;
  busy.busy = true;
  busy.message = "the rendezvous server is busy: " + why;
  const std::string frame = EncodeFrame(MessageType::kError, ToFields(busy));
  boost::system::error_code ignored;
  socket.non_blocking(true, ignored);
  socket.write_some(boost::asio::buffer(frame), ignored);
  socket.close(ignored);
}
}  // namespace

std::shared_ptr<RendezvousServer> RendezvousServer::Create(boost::asio::io_context& io,
                                                           ServerOptions options) {
  return std::shared_ptr<RendezvousServer>(new RendezvousServer(io, std::move(options)));
}

RendezvousServer::RendezvousServer(boost::asio::io_context& io, ServerOptions options)
    : io_(io),
      options_(std::move(options)),
      machine_(options_.default_heartbeat_timeout),
      acceptor_(io),
      heartbeat_timer_(io),
      accept_backoff_timer_(io) {
  for (int t = 0; t < kTimerCount; ++t) timers_.emplace_back(io);
}

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
  for (auto& t : timers_) t.cancel();
  heartbeat_timer_.cancel();
  accept_backoff_timer_.cancel();
  for (auto& [id, s] : sessions_) s->conn->Detach();
  sessions_.clear();
  waiting_.clear();  // closes the sockets
}

void RendezvousServer::FailAndStop(const std::string& message) {
  if (stopped_ || failing_) return;
  Apply(machine_.FailAll(message, WallClockMicros()), WallClockMicros());
  failing_ = true;
  boost::system::error_code ignored;
  acceptor_.close(ignored);
  for (auto& t : timers_) t.cancel();
  heartbeat_timer_.cancel();
  accept_backoff_timer_.cancel();
  waiting_.clear();
  // Connections still in the handshake have no job to hear about; the others close after
  // their FAILED is flushed (SendAndClose above).
  for (auto& [id, s] : sessions_)
    if (!s->authenticated) s->conn->Close(Status::Ok());
}

void RendezvousServer::Log(const std::string& line) const {
  if (options_.log) options_.log(line);
}

void RendezvousServer::Accept() {
  if (stopped_ || failing_ || accepting_) return;
  accepting_ = true;
  std::weak_ptr<RendezvousServer> weak = shared_from_this();
  acceptor_.async_accept([weak](const boost::system::error_code& ec, tcp::socket socket) {
    auto self = weak.lock();
    if (!self) return;
    self->accepting_ = false;
    if (self->stopped_ || self->failing_ || ec == asio::error::operation_aborted) return;
    if (ec && ec != asio::error::connection_aborted) {
      // EMFILE and friends leave the connection in the backlog: accepting again at once
      // would spin at 100% CPU (and starve the agent sharing this thread).
      if (!self->accept_failing_)
        self->Log("cannot accept connections (" + ec.message() + "); retrying every " +
                  std::to_string(kAcceptBackoff.count()) + " ms");
      self->accept_failing_ = true;
      self->accept_backoff_timer_.expires_after(kAcceptBackoff);
      self->accept_backoff_timer_.async_wait([weak](const boost::system::error_code& e) {
        if (auto server = weak.lock(); server && !e) server->Accept();
      });
      return;
    }
    if (!ec) {
      if (self->accept_failing_) self->Log("accepting connections again");
      self->accept_failing_ = false;
      self->OnAccepted(std::move(socket));
    }
    self->Accept();
  });
}

void RendezvousServer::OnAccepted(tcp::socket socket) {
  boost::system::error_code ec1, ec2;
  const tcp::endpoint remote = socket.remote_endpoint(ec1);
  const tcp::endpoint local = socket.local_endpoint(ec2);
  if (ec1 || ec2) {
    boost::system::error_code ignored;
    socket.close(ignored);
    return;
  }
  if (connection_count() >= options_.max_connections) {
    RefuseBusy(socket, std::to_string(options_.max_connections) + " connections are open");
    return;
  }
  std::string remote_address = AddressString(remote.address());
  std::string local_address = AddressString(local.address());
  // Loopback peers run on this host (one machine standing in for many nodes in tests and
  // benchmarks); they count only toward the total.
  size_t& pending = pending_by_source_[remote_address];
  if (pending >= options_.max_handshakes_per_source && !IsLoopbackHost(remote_address)) {
    RefuseBusy(socket, std::to_string(pending) + " connections from " + remote_address +
                           " are in the handshake");
    return;
  }
  ++pending;
  if (handshakes_ >= options_.max_handshakes) {
    // Accepted (so the kernel's backlog never overflows into SYN retransmits, seconds for a
    // large job starting at once) but not read from: a descriptor, no buffer.
    waiting_.push_back(Waiting{std::move(socket), std::move(remote_address),
                               std::move(local_address), std::chrono::steady_clock::now()});
    return;
  }
  StartHandshake(std::move(socket), remote_address, local_address);
}

void RendezvousServer::StartHandshake(tcp::socket socket, const std::string& remote_address,
                                      const std::string& local_address) {
  auto session = std::make_unique<Session>();
  Session& s = *session;
  s.id = next_session_id_++;
  s.conn = Connection::Create(std::move(socket));
  s.server_nonce = RandomNonce();
  s.remote_address = remote_address;
  s.local_address = local_address;
  s.in_handshake = true;
  ++handshakes_;
  sessions_.emplace(s.id, std::move(session));
  const uint64_t id = s.id;
  std::weak_ptr<RendezvousServer> weak = shared_from_this();
  s.conn->SetReadTimeout(options_.handshake_timeout);
  s.conn->SetWriteTimeout(options_.write_timeout);
  s.conn->Start({[weak, id](MessageType type, Fields fields) {
                   if (auto server = weak.lock()) server->OnFrame(id, type, std::move(fields));
                 },
                 [weak, id](Status why) {
                   if (auto server = weak.lock()) server->OnClosed(id, why);
                 }});
  Status sent = s.conn->Send(MessageType::kChallenge, {{"nonce", s.server_nonce}});
  if (!sent.ok()) s.conn->Close(sent);
}

void RendezvousServer::Unpend(const std::string& remote_address) {
  auto it = pending_by_source_.find(remote_address);
  if (it != pending_by_source_.end() && --it->second == 0) pending_by_source_.erase(it);
}

void RendezvousServer::EndHandshake(Session& s) {
  if (!s.in_handshake) return;
  s.in_handshake = false;
  --handshakes_;
  Unpend(s.remote_address);
  // The slot goes to the longest-waiting connection whose agent may still be waiting (its
  // own handshake deadline is about ours, counted from its connect).
  const auto expired = std::chrono::steady_clock::now() - options_.handshake_timeout;
  while (handshakes_ < options_.max_handshakes && !waiting_.empty()) {
    Waiting next = std::move(waiting_.front());
    waiting_.pop_front();
    Unpend(next.remote_address);
    if (next.since < expired) {
      RefuseBusy(next.socket, "no handshake slot was free within the handshake timeout");
      continue;
    }
    ++pending_by_source_[next.remote_address];
    StartHandshake(std::move(next.socket), next.remote_address, next.local_address);
  }
}

void RendezvousServer::ArmHeartbeat() {
  heartbeat_interval_ = HeartbeatInterval(machine_.heartbeat_timeout());
  heartbeat_timer_.expires_after(heartbeat_interval_);
  std::weak_ptr<RendezvousServer> weak = shared_from_this();
  heartbeat_timer_.async_wait([weak](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (ec || !self || self->stopped_ || self->failing_) return;
    for (auto& [id, s] : self->sessions_) {
      if (!s->authenticated || s->conn->closed()) continue;
      Status sent = s->conn->Send(MessageType::kHeartbeat, {});
      if (!sent.ok()) s->conn->Close(sent);  // cannot happen (empty frame), but never ignore
    }
    self->ArmHeartbeat();
  });
}

void RendezvousServer::OnFrame(uint64_t id, MessageType type, Fields fields) {
  auto it = sessions_.find(id);
  if (stopped_ || failing_ || it == sessions_.end()) return;
  Session& s = *it->second;
  if (!s.authenticated) {
    if (type != MessageType::kHello) {
      s.conn->Close(Status::ProtocolError(std::string("expected HELLO, got ") + ToString(type)));
      return;
    }
    HandleHello(s, fields);
    return;
  }
  const int64_t now = WallClockMicros();
  switch (type) {
    case MessageType::kHeartbeat:
      Apply(machine_.OnHeartbeat(id, now), now);
      return;
    case MessageType::kJoin: {
      StatusOr<JoinRequest> join = ParseJoin(fields);  // validated by the connection already
      if (join.ok()) Apply(machine_.OnJoin(id, std::move(join).value(), now), now);
      return;
    }
    case MessageType::kReport: {
      StatusOr<FailureReport> report = ParseFailureReport(fields);
      if (report.ok()) Apply(machine_.OnReport(id, std::move(report).value(), now), now);
      return;
    }
    case MessageType::kSucceeded: {
      long long round = -1;
      ParseInt64(fields["round"], &round);
      Apply(machine_.OnSucceeded(id, static_cast<int>(round), now), now);
      return;
    }
    default:
      Log("closing host at " + s.remote_address + ": unexpected " + ToString(type) +
          " from an agent");
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
    Log("refused an agent at " + s.remote_address +
        ": wrong or missing rdzv_token (authentication failed)");
    ErrorMessage err;
    err.auth_error = true;
    err.message = "the rendezvous server refused this agent: wrong or missing rdzv_token";
    Status sent = s.conn->SendAndClose(MessageType::kError, ToFields(err));
    if (!sent.ok()) s.conn->Close(sent);
    return;
  }
  Status sent = s.conn->Send(
      MessageType::kWelcome,
      {{"proof", ComputeProof(options_.token, ProofRole::kServer, hello->nonce, s.server_nonce)}});
  if (!sent.ok()) {
    s.conn->Close(sent);
    return;
  }
  // Every later frame, both ways, carries a MAC under this session's key.
  s.conn->StartAuthenticated(SessionKey(options_.token, s.server_nonce, hello->nonce),
                             MacDirection::kToAgent);
  s.authenticated = true;
  s.conn->SetLiveness(machine_.heartbeat_timeout());
  EndHandshake(s);
  const int64_t now = WallClockMicros();
  Apply(machine_.OnAuthenticated(s.id, s.remote_address, s.local_address, now), now);
}

void RendezvousServer::OnClosed(uint64_t id, const Status& why) {
  auto it = sessions_.find(id);
  if (stopped_ || it == sessions_.end()) return;
  std::unique_ptr<Session> s = std::move(it->second);
  sessions_.erase(it);
  EndHandshake(*s);
  if (failing_ || !s->authenticated) return;
  const int64_t now = WallClockMicros();
  Apply(machine_.OnClosed(id, why, now), now);
}

void RendezvousServer::ArmTimer(TimerId timer, int64_t at_us, int64_t now_us) {
  const int t = static_cast<int>(timer);
  timer_at_us_[t] = at_us;
  timers_[t].expires_after(std::chrono::microseconds(std::max<int64_t>(0, at_us - now_us)));
  std::weak_ptr<RendezvousServer> weak = shared_from_this();
  timers_[t].async_wait([weak, timer, t](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (ec || !self || self->stopped_ || self->failing_) return;
    // The steady timer expired, so the deadline has come even if the wall clock was set
    // back meanwhile: never tell the machine an earlier time (it would ignore the firing).
    const int64_t now = std::max(WallClockMicros(), self->timer_at_us_[t]);
    self->Apply(self->machine_.OnTimer(timer, now), now);
  });
}

void RendezvousServer::Apply(Effects effects, int64_t now_us) {
  std::deque<Effect> work(std::make_move_iterator(effects.begin()),
                          std::make_move_iterator(effects.end()));
  auto more = [&](Effects next) {
    for (Effect& e : next) work.push_back(std::move(e));
  };
  while (!work.empty() && !stopped_) {
    Effect e = std::move(work.front());
    work.pop_front();
    auto it = sessions_.find(e.session);
    Connection* conn = it == sessions_.end() ? nullptr : it->second->conn.get();
    switch (e.kind) {
      case Effect::Kind::kSend:
        if (conn) {
          Status sent = conn->Send(e.type, e.fields);
          if (!sent.ok()) more(machine_.OnSendFailed(e.session, e.type, sent, now_us));
        }
        break;
      case Effect::Kind::kSendAndClose:
        if (conn) {
          Status sent = conn->SendAndClose(e.type, e.fields);
          if (!sent.ok()) {
            conn->Close(sent);
            more(machine_.OnSendFailed(e.session, e.type, sent, now_us));
          }
        }
        break;
      case Effect::Kind::kClose:
        if (conn) conn->Close(Status::Ok());
        break;
      case Effect::Kind::kArmTimer:
        ArmTimer(e.timer, e.at_us, now_us);
        break;
      case Effect::Kind::kCancelTimer:
        timers_[static_cast<int>(e.timer)].cancel();
        break;
      case Effect::Kind::kLog:
        Log(e.text);
        break;
      case Effect::Kind::kLiveness:
        for (auto& [id, s] : sessions_)
          if (s->authenticated) s->conn->SetLiveness(e.heartbeat_timeout);
        heartbeat_timer_.cancel();  // re-armed at the job's own pace
        ArmHeartbeat();
        break;
      case Effect::Kind::kIdle:
        if (on_idle_) on_idle_();
        break;
    }
  }
}

}  // namespace launch::rendezvous
