#pragma once

// Connection: one TCP socket speaking rendezvous frames, with a deadline on every frame read
// and every write. Shared by the server (one per agent) and the client. Internal to the module.
//
// Lifecycle: Create() -> Start(callbacks) -> Send()... -> Close() or SendAndClose().
// The connection keeps itself alive (enable_shared_from_this) while operations are pending.
// Callbacks run on the io_context's thread and never re-entrantly: on_closed is posted, so an
// owner may call Close() from inside on_frame. After Detach() no callback runs again; owners
// call it before they go away. Not thread-safe: use from the io_context's thread only.
//
// Limits: a frame is accepted only when its type is one this side receives and its length is
// within that type's limit (MaxPayload in protocol.h, for this side as `receiver`); both are
// checked from the 12-byte header, before anything is allocated for the body, and a frame
// beyond them closes the connection with a ProtocolError naming the type, its length and the
// limit (the owner logs it with the peer's address). A body is read in pieces as it arrives,
// never allocated up front from the length field.
//
// Authentication: a new connection accepts only handshake frames (protocol.h) of at most
// kMaxHandshakePayload bytes, so an unauthenticated peer costs a few KiB at most. Once the owner
// has verified the handshake it calls StartAuthenticated(session key): from then on every frame
// sent carries FrameMac(key, direction, sequence, frame) (auth.h) after its payload, and every
// frame received must carry a valid one for the next sequence number of the other direction
// (else the connection closes with AuthFailed).

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include <boost/asio.hpp>

#include "base/status.h"
#include "rendezvous/auth.h"
#include "rendezvous/protocol.h"

namespace launch::rendezvous {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  struct Callbacks {
    // A complete, well-formed frame (header checked, fields decoded and typed-validated).
    std::function<void(MessageType, Fields)> on_frame;
    // Called once when the connection ends: OK after a clean close we asked for, otherwise
    // why (Timeout for a missed deadline, PeerLost for EOF/reset, ProtocolError...).
    std::function<void(Status)> on_closed;
  };

  // `receiver`: which side of the protocol this connection is (it reads what the other side
  // sends); `max_nodes`: for an agent, the MAX node count it joins with (sizes ASSIGN).
  static std::shared_ptr<Connection> Create(tcp::socket socket, Receiver receiver,
                                            int max_nodes = kMaxNodes);

  // Starts the read loop. REQUIRES: called once.
  void Start(Callbacks callbacks);
  // Applies from the next frame on: the whole frame (header and payload) must arrive within
  // `timeout` after the reader starts waiting for it.
  void SetReadTimeout(std::chrono::milliseconds timeout) { read_timeout_ = timeout; }
  void SetWriteTimeout(std::chrono::milliseconds timeout) { write_timeout_ = timeout; }
  // An authenticated session's liveness (protocol.h): the read deadline becomes
  // LossDeadline(heartbeat_timeout), and so does the socket's TCP_USER_TIMEOUT (data
  // unacknowledged that long closes the connection with PeerLost); TCP retransmits at least
  // every kRetransmitCap (TCP_RTO_MAX_MS, Linux >= 6.15; best effort where the kernel lacks it).
  void SetLiveness(std::chrono::milliseconds heartbeat_timeout);

  // Queues a frame. ProtocolError (nothing sent, the connection stays open) when the message
  // exceeds the size the peer accepts for its type; OK when the connection is already closing (its
  // on_closed reports why).
  Status Send(MessageType type, const Fields& fields);
  // Sends, then closes once the frame is flushed (or the write deadline passes); on_closed
  // gets `why`.
  Status SendAndClose(MessageType type, const Fields& fields, Status why = Status::Ok());
  // See the header comment. `outgoing`: the direction of the frames this side sends.
  // REQUIRES: called once, from on_frame of the last handshake frame received or right after
  // the last handshake frame was sent, before anything else is sent.
  void StartAuthenticated(std::string session_key, MacDirection outgoing);
  bool authenticated() const { return !mac_key_.empty(); }
  // Closes now; on_closed(why) follows (posted). Idempotent.
  void Close(Status why);
  // Stops all callbacks and closes.
  void Detach();

  bool closed() const { return closed_; }
  // The peer's address as we see it ("10.0.0.2", "fe80::1"; IPv4-mapped IPv6 shown as IPv4).
  const std::string& remote_address() const { return remote_address_; }

  // Outgoing bytes beyond this close the connection (a peer that does not read).
  static constexpr size_t kMaxPendingBytes = kMaxPayloadSize + (16u << 20);

 private:
  Connection(tcp::socket socket, Receiver receiver, int max_nodes);
  void ReadHeader();
  void OnHeader(const boost::system::error_code& ec);
  void ReadBody();
  void OnBody(const boost::system::error_code& ec, size_t bytes);
  void OnFrameComplete();
  void ArmReadTimer();
  void WriteNext();
  void Fail(Status why);

  tcp::socket socket_;
  const Receiver receiver_;
  const int max_nodes_;
  asio::steady_timer read_timer_;
  asio::steady_timer write_timer_;
  Callbacks callbacks_;
  std::chrono::milliseconds read_timeout_{5000};
  std::chrono::milliseconds write_timeout_{5000};
  uint8_t header_[kHeaderSize] = {};
  FrameHeader frame_header_;
  std::string body_;          // payload (and MAC) of the frame being read, grown as it arrives
  size_t body_received_ = 0;  // bytes of body_ read so far
  std::string mac_key_;       // empty until StartAuthenticated
  MacDirection outgoing_ = MacDirection::kToServer;
  uint64_t send_sequence_ = 0;
  uint64_t receive_sequence_ = 0;
  std::deque<std::string> write_queue_;
  size_t pending_bytes_ = 0;
  bool writing_ = false;
  bool close_after_write_ = false;
  Status close_reason_;  // what on_closed reports after SendAndClose
  bool closed_ = false;
  bool detached_ = false;
  uint64_t read_generation_ = 0;  // which frame read the read timer belongs to
  std::string remote_address_;
};

// Text of an address, IPv4-mapped IPv6 unwrapped.
std::string AddressString(const asio::ip::address& address);

}  // namespace launch::rendezvous
