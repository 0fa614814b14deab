#include "rendezvous/connection.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <utility>

#ifndef TCP_RTO_MAX_MS
#define TCP_RTO_MAX_MS 44  // Linux 6.15; older headers lack it
#endif

namespace launch::rendezvous {

std::string AddressString(const asio::ip::address& address) {
  if (address.is_v6() && address.to_v6().is_v4_mapped())
    return asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6()).to_string();
  return address.to_string();
}

std::shared_ptr<Connection> Connection::Create(tcp::socket socket, Receiver receiver,
                                               int max_nodes) {
  return std::shared_ptr<Connection>(new Connection(std::move(socket), receiver, max_nodes));
}

Connection::Connection(tcp::socket socket, Receiver receiver, int max_nodes)
    : socket_(std::move(socket)),
      receiver_(receiver),
      max_nodes_(max_nodes),
      read_timer_(socket_.get_executor()),
      write_timer_(socket_.get_executor()) {
  boost::system::error_code ec;
  auto endpoint = socket_.remote_endpoint(ec);
  remote_address_ = ec ? "?" : AddressString(endpoint.address());
  socket_.set_option(tcp::no_delay(true), ec);
}

void Connection::SetLiveness(std::chrono::milliseconds heartbeat_timeout) {
  read_timeout_ = LossDeadline(heartbeat_timeout);
  if (!socket_.is_open()) return;
  const int fd = socket_.native_handle();
  // Without a cap, TCP's retransmission backoff (0.2, 0.4, 0.8, 1.6, 3.2 s...) holds the first
  // frame after an outage for up to the outage's length again, and the read deadline fires
  // although the network is back (protocol.h, Liveness). Older kernels refuse it (EINVAL,
  // ENOPROTOOPT): the documented shorter tolerance.
  const int rto_max_ms = kRetransmitCap.count();
  ::setsockopt(fd, IPPROTO_TCP, TCP_RTO_MAX_MS, &rto_max_ms, sizeof(rto_max_ms));
  const unsigned int user_timeout_ms = static_cast<unsigned int>(read_timeout_.count());
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

void Connection::Start(Callbacks callbacks) {
  callbacks_ = std::move(callbacks);
  ReadHeader();
}

void Connection::ArmReadTimer() {
  uint64_t generation = ++read_generation_;
  read_timer_.expires_after(read_timeout_);
  read_timer_.async_wait(
      [self = shared_from_this(), generation](const boost::system::error_code& ec) {
        if (ec || self->closed_ || generation != self->read_generation_) return;
        self->Fail(Status::Timeout("no complete message within " +
                                   std::to_string(self->read_timeout_.count()) + " ms"));
      });
}

void Connection::ReadHeader() {
  if (closed_) return;
  ArmReadTimer();
  asio::async_read(socket_, asio::buffer(header_, kHeaderSize),
                   [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                     self->OnHeader(ec);
                   });
}

void Connection::StartAuthenticated(std::string session_key, MacDirection outgoing) {
  mac_key_ = std::move(session_key);
  outgoing_ = outgoing;
}

void Connection::OnHeader(const boost::system::error_code& ec) {
  if (closed_) return;
  if (ec) {
    Fail(ec == asio::error::eof ? Status::PeerLost("connection closed by peer")
                                : Status::PeerLost(ec.message()));
    return;
  }
  // Validate before allocating anything: the type's own limit, not the protocol's largest.
  StatusOr<FrameHeader> header = DecodeHeader(header_, UINT32_MAX);
  if (!header.ok()) {
    Fail(header.status());
    return;
  }
  const char* type = ToString(header->type);
  if (!authenticated() && !IsHandshakeMessage(header->type)) {
    Fail(Status::ProtocolError(std::string(type) + " before the handshake completed"));
    return;
  }
  const uint32_t limit = authenticated() ? MaxPayload(header->type, receiver_, max_nodes_)
                                         : std::min(MaxPayload(header->type, receiver_, max_nodes_),
                                                    kMaxHandshakePayload);
  if (limit == 0) {
    Fail(Status::ProtocolError(std::string(type) + " is never sent to " +
                               (receiver_ == Receiver::kServer ? "a server" : "an agent")));
    return;
  }
  const uint32_t mac_size = authenticated() ? kMacSize : 0;
  if (header->length > limit + mac_size) {
    Fail(Status::ProtocolError("a " + std::string(type) + " frame of " +
                               std::to_string(header->length) + " bytes (a " + type +
                               " carries at most " + std::to_string(limit + mac_size) + ")"));
    return;
  }
  if (header->length < mac_size) {
    Fail(Status::AuthFailed("frame without its MAC"));
    return;
  }
  frame_header_ = *header;
  body_.clear();
  body_received_ = 0;
  ReadBody();
}

void Connection::ReadBody() {
  // Grow as bytes arrive: a peer announcing a large frame and sending little costs little.
  constexpr size_t kChunk = 64 * 1024;
  size_t want = std::min<size_t>(frame_header_.length - body_received_, kChunk);
  if (want == 0) {
    OnFrameComplete();
    return;
  }
  body_.resize(body_received_ + want);
  asio::async_read(socket_, asio::buffer(&body_[body_received_], want),
                   [self = shared_from_this()](const boost::system::error_code& ec, size_t n) {
                     self->OnBody(ec, n);
                   });
}

void Connection::OnBody(const boost::system::error_code& ec, size_t bytes) {
  if (closed_) return;
  if (ec) {
    Fail(Status::PeerLost(ec == asio::error::eof ? "connection closed by peer" : ec.message()));
    return;
  }
  body_received_ += bytes;
  ReadBody();
}

void Connection::OnFrameComplete() {
  ++read_generation_;  // this frame made its deadline
  read_timer_.cancel();
  std::string_view payload = body_;
  if (authenticated()) {
    payload.remove_suffix(kMacSize);
    std::string frame(reinterpret_cast<const char*>(header_), kHeaderSize);
    frame.append(payload.data(), payload.size());
    MacDirection incoming =
        outgoing_ == MacDirection::kToServer ? MacDirection::kToAgent : MacDirection::kToServer;
    std::string expected = FrameMac(mac_key_, incoming, receive_sequence_++, frame);
    if (!ConstantTimeEquals(expected, std::string_view(body_).substr(payload.size()))) {
      Fail(Status::AuthFailed(std::string("bad MAC on a ") + ToString(frame_header_.type) +
                              " frame (forged, altered, replayed or out of order)"));
      return;
    }
  }
  StatusOr<Fields> fields = DecodeFields(payload);
  if (!fields.ok()) {
    Fail(fields.status());
    return;
  }
  Status valid = ValidateMessage(frame_header_.type, *fields);
  if (!valid.ok()) {
    Status why = valid.WithContext(ToString(frame_header_.type));
    if (frame_header_.type == MessageType::kJoin) {
      // Answered, not just closed: the refused agent names the reason ("field 'run_id' is 2000
      // bytes") instead of reporting a lost server, which is all a bare close tells it.
      ErrorMessage refused;
      refused.config_error = true;
      refused.message = "the rendezvous server refused this node's JOIN: " + why.message();
      Status sent = SendAndClose(MessageType::kError, ToFields(refused), why);
      if (!sent.ok()) Fail(why);  // too long to send: closed with the reason all the same
      return;
    }
    Fail(why);
    return;
  }
  body_.clear();
  body_.shrink_to_fit();
  if (callbacks_.on_frame && !detached_)
    callbacks_.on_frame(frame_header_.type, std::move(*fields));
  ReadHeader();
}

Status Connection::Send(MessageType type, const Fields& fields) {
  if (closed_ || close_after_write_) return Status::Ok();
  size_t mac_size = authenticated() ? kMacSize : 0;
  std::string frame = EncodeFrame(type, fields, mac_size);
  // What the other side accepts (OnHeader there).
  const Receiver peer = receiver_ == Receiver::kServer ? Receiver::kAgent : Receiver::kServer;
  size_t limit = MaxPayload(type, peer, max_nodes_);
  if (!authenticated()) limit = std::min<size_t>(limit, kMaxHandshakePayload);
  if (frame.size() - kHeaderSize > limit)  // the MAC is appended below
    return Status::ProtocolError(std::string(ToString(type)) + " of " +
                                 std::to_string(frame.size() - kHeaderSize) +
                                 " bytes exceeds the protocol's limit of " + std::to_string(limit));
  if (authenticated()) frame += FrameMac(mac_key_, outgoing_, send_sequence_++, frame);
  pending_bytes_ += frame.size();
  if (pending_bytes_ > kMaxPendingBytes) {
    Fail(Status::IoError("peer does not read (" + std::to_string(pending_bytes_) +
                         " bytes queued)"));
    return Status::Ok();
  }
  write_queue_.push_back(std::move(frame));
  if (!writing_) WriteNext();
  return Status::Ok();
}

Status Connection::SendAndClose(MessageType type, const Fields& fields, Status why) {
  Status sent = Send(type, fields);
  close_after_write_ = true;
  close_reason_ = std::move(why);
  if (!writing_) Close(close_reason_);
  return sent;
}

void Connection::WriteNext() {
  if (closed_) return;
  if (write_queue_.empty()) {
    writing_ = false;
    if (close_after_write_) Close(close_reason_);
    return;
  }
  writing_ = true;
  write_timer_.expires_after(write_timeout_);
  write_timer_.async_wait([self = shared_from_this()](const boost::system::error_code& ec) {
    if (ec || self->closed_) return;
    self->Fail(Status::Timeout("write not completed within " +
                               std::to_string(self->write_timeout_.count()) + " ms"));
  });
  asio::async_write(socket_, asio::buffer(write_queue_.front()),
                    [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                      if (self->closed_) return;
                      self->write_timer_.cancel();
                      if (ec) {
                        self->Fail(Status::PeerLost(ec.message()));
                        return;
                      }
                      self->pending_bytes_ -= self->write_queue_.front().size();
                      self->write_queue_.pop_front();
                      self->WriteNext();
                    });
}

void Connection::Fail(Status why) { Close(std::move(why)); }

void Connection::Close(Status why) {
  if (closed_) return;
  closed_ = true;
  boost::system::error_code ignored;
  read_timer_.cancel();
  write_timer_.cancel();
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  write_queue_.clear();
  // Posted: the owner may be inside on_frame right now. Clearing the callbacks afterwards
  // breaks the owner <-> connection reference cycle.
  asio::post(socket_.get_executor(), [self = shared_from_this(), why = std::move(why)]() {
    Callbacks callbacks = std::move(self->callbacks_);
    self->callbacks_ = {};
    if (!self->detached_ && callbacks.on_closed) callbacks.on_closed(why);
  });
}

void Connection::Detach() {
  detached_ = true;
  Close(Status::Ok());
}

}  // namespace launch::rendezvous
