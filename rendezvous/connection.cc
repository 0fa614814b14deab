#include "rendezvous/connection.h"

#include <utility>

namespace launch::rendezvous {

std::string AddressString(const asio::ip::address& address) {
  if (address.is_v6() && address.to_v6().is_v4_mapped())
    return asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6()).to_string();
  return address.to_string();
}

std::shared_ptr<Connection> Connection::Create(tcp::socket socket) {
  return std::shared_ptr<Connection>(new Connection(std::move(socket)));
}

Connection::Connection(tcp::socket socket)
    : socket_(std::move(socket)),
      read_timer_(socket_.get_executor()),
      write_timer_(socket_.get_executor()) {
  boost::system::error_code ec;
  auto endpoint = socket_.remote_endpoint(ec);
  remote_address_ = ec ? "?" : AddressString(endpoint.address());
  socket_.set_option(tcp::no_delay(true), ec);
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

void Connection::OnHeader(const boost::system::error_code& ec) {
  if (closed_) return;
  if (ec) {
    Fail(ec == asio::error::eof ? Status::PeerLost("connection closed by peer")
                                : Status::PeerLost(ec.message()));
    return;
  }
  // Validate before allocating: the length is bounded by kMaxPayloadSize here.
  StatusOr<FrameHeader> header = DecodeHeader(header_);
  if (!header.ok()) {
    Fail(header.status());
    return;
  }
  frame_header_ = *header;
  body_.assign(frame_header_.length, '\0');
  asio::async_read(socket_, asio::buffer(body_),
                   [self = shared_from_this()](const boost::system::error_code& ec, size_t) {
                     self->OnBody(ec);
                   });
}

void Connection::OnBody(const boost::system::error_code& ec) {
  if (closed_) return;
  if (ec) {
    Fail(Status::PeerLost(ec == asio::error::eof ? "connection closed by peer" : ec.message()));
    return;
  }
  ++read_generation_;  // this frame made its deadline
  read_timer_.cancel();
  StatusOr<Fields> fields = DecodeFields(body_);
  if (!fields.ok()) {
    Fail(fields.status());
    return;
  }
  Status valid = ValidateMessage(frame_header_.type, *fields);
  if (!valid.ok()) {
    Fail(valid.WithContext(ToString(frame_header_.type)));
    return;
  }
  body_.clear();
  body_.shrink_to_fit();
  if (callbacks_.on_frame && !detached_)
    callbacks_.on_frame(frame_header_.type, std::move(*fields));
  ReadHeader();
}

void Connection::Send(MessageType type, const Fields& fields) {
  if (closed_ || close_after_write_) return;
  std::string frame = EncodeFrame(type, fields);
  pending_bytes_ += frame.size();
  if (pending_bytes_ > kMaxPendingBytes) {
    Fail(Status::IoError("peer does not read (" + std::to_string(pending_bytes_) +
                         " bytes queued)"));
    return;
  }
  write_queue_.push_back(std::move(frame));
  if (!writing_) WriteNext();
}

void Connection::SendAndClose(MessageType type, const Fields& fields) {
  Send(type, fields);
  close_after_write_ = true;
  if (!writing_) Close(Status::Ok());
}

void Connection::WriteNext() {
  if (closed_) return;
  if (write_queue_.empty()) {
    writing_ = false;
    if (close_after_write_) Close(Status::Ok());
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
