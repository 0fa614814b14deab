// Hostile or broken peers over real sockets: garbage, a 4 GiB length prefix, a client that
// never speaks, a wrong token, an agent that goes silent after joining. Each must cost only its
// own connection while real agents rendezvous next to it.

#include <doctest/doctest.h>

#include "rendezvous/auth.h"
#include "rendezvous/protocol.h"
#include "rendezvous/test_util.h"

namespace launch::rendezvous {
namespace {

using namespace testing;
using std::chrono::milliseconds;
using tcp = asio::ip::tcp;

// A raw TCP peer on the test's io_context: writes what it is told, reads everything, and
// notes when the server closes the connection.
struct RawPeer : std::enable_shared_from_this<RawPeer> {
  explicit RawPeer(asio::io_context& io) : socket(io) {}
  void Connect(int port) {
    socket.connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)});
    Read();
  }
  void Read() {
    socket.async_read_some(asio::buffer(chunk), [self = shared_from_this()](
                                                    const boost::system::error_code& ec, size_t n) {
      if (ec) {
        self->closed = true;
        self->closed_at = Clock::now();
        return;
      }
      self->received.append(self->chunk, n);
      self->Read();
    });
  }
  void Write(const std::string& bytes) {
    auto data = std::make_shared<std::string>(bytes);
    asio::async_write(socket, asio::buffer(*data),
                      [data](const boost::system::error_code&, size_t) {});
  }
  // The first complete frame in `received`, if any.
  std::optional<Frame> FirstFrame() const {
    if (received.size() < kHeaderSize) return std::nullopt;
    auto h = DecodeHeader(reinterpret_cast<const uint8_t*>(received.data()));
    if (!h.ok() || received.size() < kHeaderSize + h->length) return std::nullopt;
    auto f = DecodeFrame(received.substr(0, kHeaderSize + h->length));
    if (!f.ok()) return std::nullopt;
    return *f;
  }
  tcp::socket socket;
  char chunk[4096];
  std::string received;
  bool closed = false;
  Clock::time_point closed_at;
};

// Two real agents complete a rendezvous while `disturb` runs against the same server.
void RendezvousSucceedsBeside(Harness& h) {
  Recorder& a = h.AddClient(Join(2, 2, -1));
  Recorder& b = h.AddClient(Join(2, 2, -1));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  CHECK_FALSE(a.finished());
}

TEST_CASE("GarbageClosesOnlyThatConnection") {
  Harness h;
  auto peer = std::make_shared<RawPeer>(h.io);
  peer->Connect(h.server->port());
  std::string garbage;
  for (int i = 0; i < 200; ++i) garbage.push_back(static_cast<char>((i * 37 + 11) & 0xff));
  peer->Write(garbage);
  REQUIRE(RunUntil(
      h.io, [&] { return peer->closed; }, milliseconds(2000)));
  RendezvousSucceedsBeside(h);
}

TEST_CASE("FourGigabyteLengthPrefixIsRefusedBeforeAllocation") {
  Harness h;
  auto peer = std::make_shared<RawPeer>(h.io);
  peer->Connect(h.server->port());
  std::string header(kMagic, 4);
  header += std::string("\x00\x01\x00\x02\xff\xff\xff\xf0", 8);  // v1, HELLO, ~4 GiB
  peer->Write(header);
  REQUIRE(RunUntil(
      h.io, [&] { return peer->closed; }, milliseconds(2000)));
  RendezvousSucceedsBeside(h);
}

TEST_CASE("SilentClientIsDroppedAfterTheHandshakeDeadline") {
  ServerOptions options;
  options.handshake_timeout = milliseconds(300);
  Harness h(options);
  auto peer = std::make_shared<RawPeer>(h.io);
  auto start = Clock::now();
  peer->Connect(h.server->port());
  RendezvousSucceedsBeside(h);  // while the silent one holds its connection
  REQUIRE(RunUntil(
      h.io, [&] { return peer->closed; }, milliseconds(3000)));
  auto took = peer->closed_at - start;
  CHECK(took >= milliseconds(250));
  CHECK(took < milliseconds(2000));
}

TEST_CASE("SlowDripOfAFrameHitsTheFrameDeadline") {
  ServerOptions options;
  options.handshake_timeout = milliseconds(300);
  Harness h(options);
  auto peer = std::make_shared<RawPeer>(h.io);
  peer->Connect(h.server->port());
  // One byte of a header every 100 ms: each read makes progress, the frame never completes.
  std::string header(kMagic, 4);
  auto start = Clock::now();
  for (int i = 0; i < 20 && !peer->closed; ++i) {
    peer->Write(std::string(1, header[i % 4]));
    RunUntil(
        h.io, [&] { return peer->closed; }, milliseconds(100));
  }
  CHECK(peer->closed);
  CHECK(peer->closed_at - start < milliseconds(1500));
}

TEST_CASE("WrongTokenIsRefusedOnBothSides") {
  ServerOptions options;
  options.token = "right";
  Harness h(options);
  Recorder& bad = h.AddClient(Join(2, 2, -1), "wrong");
  REQUIRE(RunUntil(h.io, [&] { return bad.finished(); }));
  REQUIRE(bad.failed.has_value());
  CHECK(bad.failed->code() == Status::Code::kAuthFailed);
  CHECK(bad.failed->message().find("wrong or missing rdzv_token") != std::string::npos);
  CHECK(h.LogContains("wrong or missing rdzv_token"));
  Recorder& none = h.AddClient(Join(2, 2, -1), "");
  REQUIRE(RunUntil(h.io, [&] { return none.finished(); }));
  CHECK(none.failed->code() == Status::Code::kAuthFailed);
  // The right token works.
  Recorder& a = h.AddClient(Join(2, 2, -1), "right");
  Recorder& b = h.AddClient(Join(2, 2, -1), "right");
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
}

TEST_CASE("ServerWithoutTheTokenIsRefusedByTheAgent") {
  Harness h;  // no token on the server: an agent holding one must not trust it
  Recorder& r = h.AddClient(Join(1, 1, -1), "secret");
  REQUIRE(RunUntil(h.io, [&] { return r.finished(); }));
  REQUIRE(r.failed.has_value());
  CHECK(r.failed->code() == Status::Code::kAuthFailed);
}

TEST_CASE("AgentSilentAfterJoiningIsDeclaredLostWithinHeartbeatTimeout") {
  Harness h;
  JoinRequest j = Join(2, 2, -1);
  j.heartbeat_timeout_s = 0.4;
  Recorder& a = h.AddClient(j);
  // The raw peer authenticates and joins properly, then never sends another byte.
  auto peer = std::make_shared<RawPeer>(h.io);
  peer->Connect(h.server->port());
  REQUIRE(RunUntil(h.io, [&] { return peer->FirstFrame().has_value(); }));
  std::string server_nonce = peer->FirstFrame()->fields["nonce"];
  Hello hello;
  hello.nonce = RandomNonce();
  hello.proof = ComputeProof("", ProofRole::kAgent, server_nonce, hello.nonce);
  peer->Write(EncodeFrame(MessageType::kHello, ToFields(hello)));
  peer->Write(EncodeFrame(MessageType::kJoin, ToFields(j)));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty(); }));
  auto assigned = Clock::now();
  REQUIRE(RunUntil(
      h.io, [&] { return a.finished(); }, milliseconds(3000)));
  auto took = Clock::now() - assigned;
  CHECK(took < milliseconds(1500));
  REQUIRE(a.failed.has_value());
  INFO(a.failed->message());
  CHECK(a.failed->message().find("lost node") != std::string::npos);
}

TEST_CASE("ManyBadConnectionsDoNotStopTheServer") {
  ServerOptions options;
  options.handshake_timeout = milliseconds(200);
  Harness h(options);
  std::vector<std::shared_ptr<RawPeer>> peers;
  for (int i = 0; i < 50; ++i) {
    auto p = std::make_shared<RawPeer>(h.io);
    p->Connect(h.server->port());
    if (i % 2) p->Write(std::string(kMagic, 4) + std::string(8, '\xff'));
    peers.push_back(p);
  }
  RendezvousSucceedsBeside(h);
  REQUIRE(RunUntil(h.io, [&] {
    for (auto& p : peers)
      if (!p->closed) return false;
    return true;
  }));
}

}  // namespace
}  // namespace launch::rendezvous
