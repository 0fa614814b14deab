#include "rendezvous/server.h"

#include <algorithm>
#include <sstream>
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
  std::string local_address;                    // this server's address on the connection
  std::chrono::steady_clock::time_point since;  // when its handshake began
  bool in_handshake = false;                    // holds a handshake slot (until it joins)
  bool authenticated = false;
  bool joined = false;   // sent a valid JOIN: the round machine knows it
  bool refused = false;  // closed by RefuseStranger (logged there)
};

namespace {
// Pause after an accept that failed for want of resources (EMFILE, ENFILE, ENOBUFS): the
// pending connection stays in the backlog, so accepting again at once would spin.
constexpr std::chrono::milliseconds kAcceptBackoff{100};
// Lines about strangers per ServerOptions::stranger_log_window.
constexpr size_t kStrangerLogLines = 5;

ErrorMessage Busy(const std::string& why) {
  ErrorMessage busy;
  busy.busy = true;
  busy.message = "the rendezvous server is busy: " + why;
  return busy;
}

// Closes a connection there is no room for, first telling the peer (one small unauthenticated
// frame, written without blocking; lost if the peer's window is full, which costs the peer
// only a clear message) that it may try again: an agent behind a NAT shared by many nodes, or
// one of thousands connecting at once, retries until join_timeout instead of failing.
void RefuseBusy(boost::asio::ip::tcp::socket& socket, const std::string& why) {
  const std::string frame = EncodeFrame(MessageType::kError, ToFields(Busy(why)));
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
      accept_backoff_timer_(io),
      sweep_timer_(io),
      stranger_window_start_(std::chrono::steady_clock::now()) {
  for (int t = 0; t < kTimerCount; ++t) timers_.emplace_back(io);
  if (options_.expected_join) machine_.Expect(*options_.expected_join, options_.expected_origin);
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
  sweep_timer_.cancel();
  for (auto& [id, s] : sessions_) s->conn->Detach();
  sessions_.clear();
  waiting_.clear();  // closes the sockets
  waiting_by_source_.clear();
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
  sweep_timer_.cancel();
  waiting_.clear();
  waiting_by_source_.clear();
  // Strangers have no job to hear about; the others close after their FAILED is flushed
  // (SendAndClose above).
  for (auto& [id, s] : sessions_)
    if (!s->joined) s->conn->Close(Status::Ok());
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
    const std::string why = std::to_string(options_.max_connections) + " connections are open";
    LogStranger("refused a connection from " + AddressString(remote.address()) + ": " + why);
    RefuseBusy(socket, why);
    return;
  }
  std::string remote_address = AddressString(remote.address());
  std::string local_address = AddressString(local.address());
  // Loopback peers run on this host (one machine standing in for many nodes in tests and
  // benchmarks); they count only toward the total.
  size_t& pending = pending_by_source_[remote_address];
  if (pending >= options_.max_handshakes_per_source && !IsLoopbackHost(remote_address)) {
    const std::string why =
        std::to_string(pending) + " connections from " + remote_address + " are in the handshake";
    LogStranger("refused a connection from " + remote_address + ": " + why);
    RefuseBusy(socket, why);
    return;
  }
  ++pending;
  if (handshakes_ >= options_.max_handshakes) {
    // Accepted (so the kernel's backlog never overflows into SYN retransmits, seconds for a
    // large job starting at once) but not read from: a descriptor, no buffer.
    ++waiting_by_source_[remote_address];
    waiting_.push_back(Waiting{std::move(socket), std::move(remote_address),
                               std::move(local_address), std::chrono::steady_clock::now()});
    ArmSweep();
    return;
  }
  StartHandshake(std::move(socket), remote_address, local_address);
}

void RendezvousServer::StartHandshake(tcp::socket socket, const std::string& remote_address,
                                      const std::string& local_address) {
  auto session = std::make_unique<Session>();
  Session& s = *session;
  s.id = next_session_id_++;
  s.conn = Connection::Create(std::move(socket), Receiver::kServer);
  s.server_nonce = RandomNonce();
  s.remote_address = remote_address;
  s.local_address = local_address;
  s.since = std::chrono::steady_clock::now();
  s.in_handshake = true;
  ++handshakes_;
  ++handshakes_by_source_[remote_address];
  ArmSweep();
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

void RendezvousServer::Unwait(const std::string& remote_address) {
  auto it = waiting_by_source_.find(remote_address);
  if (it != waiting_by_source_.end() && --it->second == 0) waiting_by_source_.erase(it);
}

void RendezvousServer::EndHandshake(Session& s) {
  if (!s.in_handshake) return;
  s.in_handshake = false;
  --handshakes_;
  Unpend(s.remote_address);
  auto it = handshakes_by_source_.find(s.remote_address);
  if (it != handshakes_by_source_.end() && --it->second == 0) handshakes_by_source_.erase(it);
  // The slot goes to the oldest waiting connection from the address with the fewest strangers
  // in the handshake: the strangers of a flood hold most slots, so an agent from anywhere
  // else is next. (Sweep refuses those that waited too long.)
  while (handshakes_ < options_.max_handshakes && !waiting_.empty()) {
    auto in_handshake = [this](const std::string& source) {
      auto h = handshakes_by_source_.find(source);
      return h == handshakes_by_source_.end() ? size_t{0} : h->second;
    };
    // One look per waiting address (usually few), then one pass to that address's oldest.
    const std::string* source = &waiting_.front().remote_address;
    size_t fewest = in_handshake(*source);
    for (auto w = waiting_by_source_.begin(); w != waiting_by_source_.end() && fewest > 0; ++w) {
      const size_t count = in_handshake(w->first);
      if (count < fewest) {
        source = &w->first;
        fewest = count;
      }
    }
    auto best = std::find_if(waiting_.begin(), waiting_.end(),
                             [&](const Waiting& w) { return w.remote_address == *source; });
    Waiting next = std::move(*best);
    waiting_.erase(best);
    Unwait(next.remote_address);
    StartHandshake(std::move(next.socket), next.remote_address, next.local_address);
  }
}

void RendezvousServer::RefuseStranger(Session& s, const std::string& why) {
  if (s.refused) return;
  s.refused = true;
  LogStranger("closed the connection from " + s.remote_address + " before it joined: " + why);
  Status sent = s.conn->SendAndClose(MessageType::kError, ToFields(Busy(why)));
  if (!sent.ok()) s.conn->Close(sent);
  EndHandshake(s);
}

void RendezvousServer::ArmSweep() {
  if (sweeping_ || stopped_ || failing_) return;
  sweeping_ = true;
  const auto shortest = std::min(options_.handshake_timeout, options_.busy_handshake_timeout);
  sweep_timer_.expires_after(std::max(shortest / 4, std::chrono::milliseconds(10)));
  std::weak_ptr<RendezvousServer> weak = shared_from_this();
  sweep_timer_.async_wait([weak](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (!self) return;
    self->sweeping_ = false;
    if (ec || self->stopped_ || self->failing_) return;
    self->Sweep();
  });
}

void RendezvousServer::Sweep() {
  using std::chrono::duration_cast;
  using std::chrono::milliseconds;
  const auto now = std::chrono::steady_clock::now();
  // Waiting connections first: their agents' own handshake deadlines run from their connect.
  const auto queue_limit = options_.handshake_timeout / 2;
  for (auto w = waiting_.begin(); w != waiting_.end();) {
    if (now - w->since < queue_limit) {
      ++w;
      continue;
    }
    const std::string why = "no handshake slot was free within " +
                            std::to_string(queue_limit.count()) + " ms (" +
                            std::to_string(handshakes_) + " connections in the handshake)";
    LogStranger("refused a connection from " + w->remote_address + ": " + why);
    RefuseBusy(w->socket, why);
    Unpend(w->remote_address);
    Unwait(w->remote_address);
    w = waiting_.erase(w);
  }
  // Strangers past their deadline; a short one while others wait for their slots.
  const bool crowded = !waiting_.empty();
  const auto limit = crowded ? std::min(options_.handshake_timeout, options_.busy_handshake_timeout)
                             : options_.handshake_timeout;
  std::vector<uint64_t> late;
  for (auto& [id, session] : sessions_)
    if (session->in_handshake && now - session->since >= limit) late.push_back(id);
  for (uint64_t id : late) {
    auto it = sessions_.find(id);
    if (it == sessions_.end() || !it->second->in_handshake) continue;
    Session& s = *it->second;
    RefuseStranger(
        s, std::string(s.authenticated ? "authenticated but sent no JOIN" : "no handshake") +
               " within " + std::to_string(limit.count()) + " ms" +
               (crowded ? " while " + std::to_string(waiting_.size()) + " other connections waited"
                        : ""));
  }
  FlushStrangerLog(now);
  if (handshakes_ > 0 || !waiting_.empty() || stranger_held_ > 0) ArmSweep();
}

void RendezvousServer::LogStranger(const std::string& line) {
  FlushStrangerLog(std::chrono::steady_clock::now());
  if (stranger_lines_ < kStrangerLogLines) {
    ++stranger_lines_;
    Log(line);
    return;
  }
  ++stranger_held_;
  stranger_last_ = line;
  ArmSweep();  // says how many were held back once the window is over
}

void RendezvousServer::FlushStrangerLog(std::chrono::steady_clock::time_point now) {
  if (now - stranger_window_start_ < options_.stranger_log_window) return;
  if (stranger_held_ > 0) {
    std::ostringstream line;
    line << stranger_held_ << " more connections closed or refused before joining in "
         << options_.stranger_log_window.count() / 1000.0
         << " s (not logged one by one); the last: " << stranger_last_;
    Log(line.str());
  }
  stranger_window_start_ = now;
  stranger_lines_ = 0;
  stranger_held_ = 0;
  stranger_last_.clear();
}

void RendezvousServer::ArmHeartbeat() {
  heartbeat_interval_ = HeartbeatInterval(machine_.heartbeat_timeout());
  heartbeat_timer_.expires_after(heartbeat_interval_);
  std::weak_ptr<RendezvousServer> weak = shared_from_this();
  heartbeat_timer_.async_wait([weak](const boost::system::error_code& ec) {
    auto self = weak.lock();
    if (ec || !self || self->stopped_ || self->failing_) return;
    for (auto& [id, s] : self->sessions_) {
      if (!s->joined || s->conn->closed()) continue;
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
  if (!s.joined) {
    if (type == MessageType::kHeartbeat) return;
    if (type != MessageType::kJoin) {
      s.conn->Close(Status::ProtocolError(std::string(ToString(type)) + " before a JOIN"));
      return;
    }
    // The handshake is over: the slot is free, liveness is the job's, and the round machine
    // hears of the session.
    s.joined = true;
    EndHandshake(s);
    s.conn->SetLiveness(machine_.heartbeat_timeout());
    const int64_t now = WallClockMicros();
    Effects effects = machine_.OnAuthenticated(s.id, s.remote_address, s.local_address, now);
    StatusOr<JoinRequest> join = ParseJoin(fields);  // validated by the connection already
    if (join.ok()) {
      Effects more = machine_.OnJoin(id, std::move(join).value(), now);
      effects.insert(effects.end(), std::make_move_iterator(more.begin()),
                     std::make_move_iterator(more.end()));
    }
    // A first JOIN the machine refuses (another job's, a taken rank...) is still a stranger's
    // as far as the log goes: a flood of them costs a few lines.
    const bool refused = std::any_of(effects.begin(), effects.end(), [&](const Effect& e) {
      return e.kind == Effect::Kind::kSendAndClose && e.session == id;
    });
    Apply(std::move(effects), now, refused);
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
    case MessageType::kReplace: {
      StatusOr<ReplaceRequest> request = ParseReplaceRequest(fields);
      if (request.ok()) Apply(machine_.OnReplace(id, std::move(request).value(), now), now);
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
    s.refused = true;  // logged here
    LogStranger("refused an agent at " + s.remote_address +
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
  // Without a token anyone gets here: still a stranger, in its handshake slot, until it JOINs.
  s.authenticated = true;
}

void RendezvousServer::OnClosed(uint64_t id, const Status& why) {
  auto it = sessions_.find(id);
  if (stopped_ || it == sessions_.end()) return;
  std::unique_ptr<Session> s = std::move(it->second);
  sessions_.erase(it);
  EndHandshake(*s);
  if (!s->joined) {
    // A connect-and-close (a port probe, an agent giving up) is not worth a line; a stranger
    // that broke the protocol, sent too much or too little in time is.
    const bool quiet = why.ok() || (why.code() == Status::Code::kPeerLost && !s->authenticated);
    if (!failing_ && !s->refused && !quiet)
      LogStranger("closed the connection from " + s->remote_address +
                  " before it joined: " + why.message());
    return;
  }
  if (failing_) return;
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

void RendezvousServer::Apply(Effects effects, int64_t now_us, bool stranger_logs) {
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
        if (stranger_logs) {
          LogStranger(e.text);
        } else {
          Log(e.text);
        }
        break;
      case Effect::Kind::kLiveness:
        for (auto& [id, s] : sessions_)
          if (s->joined) s->conn->SetLiveness(e.heartbeat_timeout);
        heartbeat_timer_.cancel();  // re-armed at the job's own pace
        ArmHeartbeat();
        break;
      case Effect::Kind::kIdle:  // the machine forgot the job; the server holds nothing of it
        break;
    }
  }
  if (options_.on_record && !stopped_) {
    // Compared through the counters (every input comes here: heartbeats too), built only when
    // one changed.
    const std::array<int, 4> now{machine_.round(), machine_.restarts_used(), machine_.generation(),
                                 machine_.last_num_nodes()};
    if (now != recorded_) {
      if (std::optional<JobRecord> record = machine_.Record()) {
        recorded_ = now;
        options_.on_record(*record);
      }
    }
  }
}

void RendezvousServer::Resume(const JobRecord& record, const std::string& reason) {
  const int64_t now = WallClockMicros();
  Apply(machine_.Resume(record, reason, now), now);
}

}  // namespace launch::rendezvous
