#include "rendezvous/client.h"

#include <algorithm>

#include "base/strings.h"
#include "rendezvous/auth.h"
#include "rendezvous/connection.h"

namespace launch::rendezvous {

std::shared_ptr<RendezvousClient> RendezvousClient::Create(boost::asio::io_context& io,
                                                           ClientOptions options,
                                                           ClientEvents events) {
  return std::shared_ptr<RendezvousClient>(
      new RendezvousClient(io, std::move(options), std::move(events)));
}

RendezvousClient::RendezvousClient(boost::asio::io_context& io, ClientOptions options,
                                   ClientEvents events)
    : io_(io),
      options_(std::move(options)),
      events_(std::move(events)),
      endpoint_text_(FormatEndpoint(options_.host, options_.port)),
      resolver_(io),
      retry_timer_(io),
      heartbeat_timer_(io) {}

RendezvousClient::~RendezvousClient() {
  if (conn_) conn_->Detach();
}

std::chrono::milliseconds RendezvousClient::HeartbeatTimeout() const {
  return std::chrono::milliseconds(
      static_cast<long long>(options_.join.heartbeat_timeout_s * 1000.0 + 0.5));
}

void RendezvousClient::Start() {
  deadline_ =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(static_cast<long long>(options_.join.join_timeout_s * 1000));
  Resolve();
}

void RendezvousClient::Resolve() {
  resolver_.async_resolve(options_.host, std::to_string(options_.port),
                          [self = shared_from_this()](const boost::system::error_code& ec,
                                                      tcp::resolver::results_type results) {
                            if (self->finished_) return;
                            if (ec || results.empty()) {
                              self->RetryLater("cannot resolve '" + self->options_.host +
                                               "': " + (ec ? ec.message() : "no addresses"));
                              return;
                            }
                            self->endpoints_.clear();
                            for (const auto& entry : results)
                              self->endpoints_.push_back(entry.endpoint());
                            self->next_endpoint_ = 0;
                            self->Connect();
                          });
}

void RendezvousClient::Connect() {
  // Each resolved address in turn, each with an optional local bind; after the last, back off
  // and resolve again.
  if (next_endpoint_ >= endpoints_.size()) {
    RetryLater(last_connect_error_.empty() ? "no address to try" : last_connect_error_);
    return;
  }
  const tcp::endpoint target = endpoints_[next_endpoint_++];
  auto socket = std::make_shared<tcp::socket>(io_);
  boost::system::error_code ec;
  socket->open(target.protocol(), ec);
  if (!ec && !options_.local_address.empty()) {
    auto local = asio::ip::make_address(options_.local_address, ec);
    if (ec) {
      JobFailure f;
      f.config_error = true;
      f.message = "cannot bind the local address '" + options_.local_address + "': " + ec.message();
      Fail(Status::InvalidConfig(f.message), f);
      return;
    }
    if (local.is_v4() != target.address().is_v4()) {
      // An IPv6 address of the endpoint cannot be reached from an IPv4 local address.
      last_connect_error_ = "no address of the family of '" + options_.local_address + "'";
      Connect();
      return;
    }
    socket->bind(tcp::endpoint(local, 0), ec);
    if (ec) {
      JobFailure f;
      f.config_error = true;
      f.message = "cannot bind the local address '" + options_.local_address + "': " + ec.message();
      Fail(Status::InvalidConfig(f.message), f);
      return;
    }
  }
  if (ec) {
    last_connect_error_ = ec.message();
    Connect();
    return;
  }
  // The connect attempt itself is bounded by the retry timer's next tick.
  socket->async_connect(target,
                        [self = shared_from_this(), socket](const boost::system::error_code& ec) {
                          if (self->finished_) return;
                          self->retry_timer_.cancel();
                          if (ec == asio::error::connection_refused && self->reconnecting_) {
                            // It answered a moment ago; now nothing listens: the hosting
                            // agent is gone, and the job with it.
                            JobFailure f;
                            f.message = "lost the rendezvous server at " + self->endpoint_text_ +
                                        ", and it now refuses connections: the agent hosting "
                                        "it is gone";
                            self->Fail(Status::PeerLost(f.message), f);
                            return;
                          }
                          if (ec == asio::error::operation_aborted) {
                            // Our own timer below closed it: nothing answered (a blackholed
                            // host), which is what the user needs to read, not "canceled".
                            self->last_connect_error_ = "no answer to the connection attempt";
                            self->Connect();
                            return;
                          }
                          if (ec) {
                            self->last_connect_error_ = ec.message();
                            self->Connect();  // the next address, or back off
                            return;
                          }
                          self->OnConnected(std::move(*socket));
                        });
  // Bounded by the retry timer's tick and by join_timeout, so that the last attempt does not
  // run past the deadline the failure names.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline_ - std::chrono::steady_clock::now());
  retry_timer_.expires_after(
      std::max(std::chrono::milliseconds(1),
               std::min<std::chrono::milliseconds>(options_.handshake_timeout, left)));
  retry_timer_.async_wait([socket](const boost::system::error_code& ec) {
    if (!ec) {
      boost::system::error_code ignored;
      socket->close(ignored);  // the pending connect completes with operation_aborted
    }
  });
}

void RendezvousClient::RetryLater(const std::string& why) {
  last_connect_error_ = why;
  auto now = std::chrono::steady_clock::now();
  if (now >= deadline_) {
    JobFailure f;
    const std::string within =
        " within " + std::to_string(static_cast<long long>(options_.join.join_timeout_s)) +
        " s (join_timeout): " + why;
    if (reconnecting_) {
      f.message =
          "lost the rendezvous server at " + endpoint_text_ + " and could not re-join" + within;
      Fail(Status::PeerLost(f.message), f);
      return;
    }
    f.config_error = true;
    f.message = "cannot reach the rendezvous server at " + endpoint_text_ + within;
    Fail(Status::Timeout(f.message), f);
    return;
  }
  // Said at once and every kWaitReport while it lasts: a typo in the address, or a node 0 that
  // is not up yet, must not look like a hang for join_timeout (600 s by default).
  // (A re-join after a lost server has its own reports: ElasticAgent's.)
  if (!reconnecting_ && options_.log && (!reported_wait_ || now - *reported_wait_ >= kWaitReport)) {
    reported_wait_ = now;
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline_ - now).count();
    options_.log("waiting for the rendezvous server at " + endpoint_text_ + ": " + why +
                 "; retrying until join_timeout (" +
                 std::to_string(static_cast<long long>(options_.join.join_timeout_s)) + " s, " +
                 std::to_string(static_cast<long long>(left)) + " s left)");
  }
  auto delay = std::min(retry_delay_,
                        std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - now));
  retry_delay_ = std::min(retry_delay_ * 2, options_.max_retry_delay);
  retry_timer_.expires_after(delay);
  retry_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->finished_) return;
    self->Resolve();
  });
}

void RendezvousClient::OnConnected(tcp::socket socket) {
  conn_ = Connection::Create(std::move(socket), Receiver::kAgent, options_.join.max_nodes);
  heard_since_welcome_ = false;
  // Bounded by join_timeout as the connection attempt is (Connect), so that a server that
  // accepts and never answers fails the join at its deadline, not a handshake later.
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline_ - std::chrono::steady_clock::now());
  conn_->SetReadTimeout(
      std::max(std::chrono::milliseconds(1),
               std::min<std::chrono::milliseconds>(options_.handshake_timeout, left)));
  conn_->SetWriteTimeout(options_.write_timeout);
  std::weak_ptr<RendezvousClient> weak = shared_from_this();
  conn_->Start({[weak](MessageType type, Fields fields) {
                  if (auto self = weak.lock()) self->OnFrame(type, std::move(fields));
                },
                [weak](Status why) {
                  if (auto self = weak.lock()) self->OnClosed(why);
                }});
}

void RendezvousClient::OnFrame(MessageType type, Fields fields) {
  if (finished_) return;
  heard_from_server_ = true;  // whatever it says, a launch rendezvous server is there
  if (type == MessageType::kError) {
    StatusOr<ErrorMessage> err = ParseError(fields);
    if (err.ok() && err->busy && !heard_since_welcome_) {
      // No room on the server now, or our JOIN came too late (the server says so only before
      // it took one): a fresh connection later, like a refused connect.
      RetryConnection(err->message);
      return;
    }
    JobFailure f;
    f.message = err.ok() ? err->message : "malformed ERROR from the rendezvous server";
    f.config_error = err.ok() && (err->config_error || err->auth_error);
    f.message += " (rendezvous " + endpoint_text_ + ")";
    Status s = err.ok() && err->auth_error ? Status::AuthFailed(f.message)
               : f.config_error            ? Status::InvalidConfig(f.message)
                                           : Status::PeerLost(f.message);
    Fail(s, f);
    return;
  }
  if (!welcomed_) {
    if (type == MessageType::kChallenge && nonce_.empty()) {
      nonce_ = RandomNonce();
      Hello hello;
      hello.nonce = nonce_;
      hello.proof = ComputeProof(options_.token, ProofRole::kAgent, fields["nonce"], nonce_);
      server_nonce_ = fields["nonce"];
      SendOrFail(MessageType::kHello, ToFields(hello));
      return;
    }
    if (type == MessageType::kWelcome && !nonce_.empty()) {
      std::string expected =
          ComputeProof(options_.token, ProofRole::kServer, nonce_, server_nonce_);
      if (!ConstantTimeEquals(expected, fields["proof"])) {
        JobFailure f;
        f.config_error = true;
        f.message = "the rendezvous server at " + endpoint_text_ +
                    " could not prove the shared token (wrong rdzv_token on the server?)";
        Fail(Status::AuthFailed(f.message), f);
        return;
      }
      welcomed_ = true;
      reconnecting_ = false;
      conn_->StartAuthenticated(SessionKey(options_.token, server_nonce_, nonce_),
                                MacDirection::kToServer);
      conn_->SetLiveness(HeartbeatTimeout());
      options_.join.clock_us = WallClockMicros();  // the server measures our clock offset
      SendOrFail(MessageType::kJoin, ToFields(options_.join));
      ArmHeartbeat();
      return;
    }
    JobFailure f;
    f.config_error = true;
    f.message = std::string("unexpected ") + ToString(type) + " during the handshake with " +
                endpoint_text_;
    Fail(Status::ProtocolError(f.message), f);
    return;
  }
  heard_since_welcome_ = true;
  switch (type) {
    case MessageType::kHeartbeat:
      return;
    case MessageType::kAssign: {
      StatusOr<Assignment> a = ParseAssignment(fields);
      if (a.ok() && events_.on_assigned) events_.on_assigned(*a);
      return;
    }
    case MessageType::kReplaced: {
      StatusOr<ReplaceAnswer> a = ParseReplaceAnswer(fields);
      if (a.ok() && events_.on_replaced) events_.on_replaced(*a);
      return;
    }
    case MessageType::kRestart: {
      StatusOr<RestartNotice> n = ParseRestart(fields);
      if (n.ok() && events_.on_restart) events_.on_restart(*n);
      return;
    }
    case MessageType::kDone: {
      finished_ = true;
      heartbeat_timer_.cancel();
      if (conn_) conn_->Detach();
      if (events_.on_done) events_.on_done();
      return;
    }
    case MessageType::kFailed: {
      StatusOr<JobFailure> f = ParseJobFailure(fields);
      JobFailure failure =
          f.ok() ? *f : JobFailure{"malformed FAILED message", false, std::nullopt};
      Status s = failure.config_error ? Status::InvalidConfig(failure.message)
                                      : Status::WorkerFailed(failure.message);
      Fail(s, failure);
      return;
    }
    default:
      return;  // nothing else is meaningful from a server; ignore rather than die
  }
}

void RendezvousClient::DropConnection() {
  heartbeat_timer_.cancel();
  if (conn_) conn_->Detach();
  conn_.reset();
  nonce_.clear();
  server_nonce_.clear();
  welcomed_ = false;
}

void RendezvousClient::RetryConnection(const std::string& why) {
  DropConnection();
  RetryLater(why);
}

void RendezvousClient::OnClosed(const Status& why) {
  if (finished_ || lost_) return;
  JobFailure f;
  if (!welcomed_ && reconnecting_) {
    // The server spoke launch's protocol a moment ago: a handshake cut short is the network
    // (or a busy server), retried like a failed connect.
    RetryConnection("no handshake: " + (why.ok() ? std::string("closed") : why.message()));
    return;
  }
  if (!welcomed_ && why.code() == Status::Code::kTimeout &&
      (heard_from_server_ || ++silent_handshakes_ < kSilentHandshakesBeforeGivingUp)) {
    // Connected, but no handshake in time: a server whose handshake slots are all taken (a
    // flood of strangers) answers late or says "busy" (then it has spoken, and is retried
    // until join_timeout); a port held by something else never answers, and is named after a
    // few silent attempts rather than waited on for join_timeout.
    const std::string what = "no handshake from " + endpoint_text_ + " (" + why.message() +
                             "): the rendezvous server is busy, or the port is not a launch "
                             "rendezvous server";
    if (!warned_handshake_ && options_.log) options_.log(what + "; retrying");
    warned_handshake_ = true;
    RetryConnection(what);
    return;
  }
  if (!welcomed_) {
    f.config_error = true;
    // DecodeHeader's words for a frame with our magic and another version: a launch server
    // of another release, which the agents of that release can still join.
    if (!why.ok() && StartsWith(why.message(), "protocol version ")) {
      f.message = "the rendezvous server at " + endpoint_text_ +
                  " runs another release of launch (" + why.message() +
                  "): use the same launch on every node";
      Fail(Status::ProtocolError(f.message), f);
      return;
    }
    f.message = "the rendezvous endpoint " + endpoint_text_ +
                " is in use by something that is not a launch rendezvous server (no handshake: " +
                (why.ok() ? "closed" : why.message()) + ")";
    Fail(Status::ProtocolError(f.message), f);
    return;
  }
  f.message = "lost the rendezvous server at " + endpoint_text_ + ": " +
              (why.ok() ? "connection closed" : why.message());
  if (!events_.on_lost) {
    Fail(Status::PeerLost(f.message), f);
    return;
  }
  DropConnection();
  lost_ = true;
  events_.on_lost(Status::PeerLost(f.message));
}

void RendezvousClient::Reconnect(int master_port, const std::string& host, int port) {
  if (finished_ || !lost_) return;
  lost_ = false;
  reconnecting_ = true;
  if (!host.empty() && (host != options_.host || port != options_.port)) {
    // Another server: what we learnt about the old endpoint says nothing about it.
    options_.host = host;
    options_.port = port;
    endpoint_text_ = FormatEndpoint(host, port);
    heard_from_server_ = false;
    silent_handshakes_ = 0;
    warned_handshake_ = false;
  }
  if (master_port > 0) options_.join.master_port = master_port;
  reported_wait_.reset();
  retry_delay_ = std::chrono::milliseconds(20);
  last_connect_error_.clear();
  Start();
}

void RendezvousClient::ArmHeartbeat() {
  heartbeat_timer_.expires_after(HeartbeatInterval(HeartbeatTimeout()));
  heartbeat_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->finished_ || !self->conn_ || !self->welcomed_) return;
    self->SendOrFail(MessageType::kHeartbeat, {});
    self->ArmHeartbeat();
  });
}

void RendezvousClient::Rejoin(int master_port) {
  if (finished_ || !conn_ || !welcomed_) return;
  if (master_port > 0) options_.join.master_port = master_port;
  options_.join.clock_us = WallClockMicros();
  SendOrFail(MessageType::kJoin, ToFields(options_.join));
}

void RendezvousClient::ReportFailure(const FailureReport& report) {
  if (finished_ || !conn_ || !welcomed_) return;
  SendOrFail(MessageType::kReport, ToFields(report));
}

bool RendezvousClient::AskReplace(const ReplaceRequest& request) {
  if (finished_ || !conn_ || !welcomed_) return false;
  SendOrFail(MessageType::kReplace, ToFields(request));
  return !finished_;
}

void RendezvousClient::ReportSuccess(int round) {
  if (finished_ || !conn_ || !welcomed_) return;
  SendOrFail(MessageType::kSucceeded, {{"round", std::to_string(round)}});
}

void RendezvousClient::SendOrFail(MessageType type, const Fields& fields) {
  Status sent = conn_->Send(type, fields);
  if (sent.ok()) return;
  JobFailure f;
  f.message = "could not send " + std::string(ToString(type)) +
              " to the rendezvous server: " + sent.message();
  Fail(sent, f);
}

void RendezvousClient::Fail(Status status, JobFailure failure) {
  if (finished_) return;
  finished_ = true;
  retry_timer_.cancel();
  heartbeat_timer_.cancel();
  resolver_.cancel();
  if (conn_) conn_->Detach();
  if (events_.on_failed) events_.on_failed(status, failure);
}

void RendezvousClient::Close() {
  finished_ = true;
  retry_timer_.cancel();
  heartbeat_timer_.cancel();
  resolver_.cancel();
  if (conn_) conn_->Detach();
}

}  // namespace launch::rendezvous
