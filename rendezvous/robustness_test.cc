// Hostile or broken peers over real sockets: garbage, a 4 GiB length prefix, a client that
// never speaks, a wrong token, an agent that goes silent after joining. Each must cost only its
// own connection while real agents rendezvous next to it.

#include <doctest/doctest.h>

#include "rendezvous/auth.h"
#include "rendezvous/connection.h"
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

bool AllClosed(const std::vector<std::shared_ptr<RawPeer>>& peers) {
  for (const auto& p : peers)
    if (!p->closed) return false;
  return true;
}

// A frame as an authenticated agent sends it: header, payload, MAC for `sequence`.
std::string MacedFrame(const std::string& key, uint64_t sequence, MessageType type,
                       const Fields& fields) {
  std::string frame = EncodeFrame(type, fields, kMacSize);
  return frame + FrameMac(key, MacDirection::kToServer, sequence, frame);
}

// Connects a raw peer and completes the handshake with the empty token; returns the session
// key. REQUIRES: the server has no token.
std::string Handshake(Harness& h, RawPeer& peer) {
  peer.Connect(h.server->port());
  REQUIRE(RunUntil(h.io, [&] { return peer.FirstFrame().has_value(); }));
  std::string server_nonce = peer.FirstFrame()->fields["nonce"];
  Hello hello;
  hello.nonce = RandomNonce();
  hello.proof = ComputeProof("", ProofRole::kAgent, server_nonce, hello.nonce);
  peer.Write(EncodeFrame(MessageType::kHello, ToFields(hello)));
  return SessionKey("", server_nonce, hello.nonce);
}

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
  peer->Write(
      MacedFrame(SessionKey("", server_nonce, hello.nonce), 0, MessageType::kJoin, ToFields(j)));
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

TEST_CASE("BeforeTheHandshakeOnlySmallHandshakeFramesAreRead") {
  Harness h;
  // A HELLO claiming 1 MiB: refused from its header, nothing allocated for it.
  auto big = std::make_shared<RawPeer>(h.io);
  big->Connect(h.server->port());
  std::string header(kMagic, 4);
  header += std::string("\x00\x01\x00\x02\x00\x10\x00\x00", 8);  // v1, HELLO, 1 MiB
  big->Write(header + std::string(10, 'x'));
  // A JOIN before authenticating: refused, whatever its size.
  auto early = std::make_shared<RawPeer>(h.io);
  early->Connect(h.server->port());
  early->Write(EncodeFrame(MessageType::kJoin, ToFields(Join(2, 2, -1))));
  REQUIRE(RunUntil(
      h.io, [&] { return big->closed && early->closed; }, milliseconds(2000)));
  RendezvousSucceedsBeside(h);
}

TEST_CASE("FramesAfterTheHandshakeNeedTheSessionMac") {
  // Without a MAC, with a MAC under another key, replayed, or altered: each closes that
  // connection without a JOIN taking effect, while real agents rendezvous beside it.
  Harness h;
  JoinRequest j = Join(2, 2, -1);
  std::vector<std::shared_ptr<RawPeer>> peers;
  auto add = [&] {
    peers.push_back(std::make_shared<RawPeer>(h.io));
    return Handshake(h, *peers.back());
  };
  add();
  peers.back()->Write(EncodeFrame(MessageType::kJoin, ToFields(j)));  // no MAC
  add();
  peers.back()->Write(MacedFrame(SessionKey("", "other", "nonces"), 0, MessageType::kJoin,
                                 ToFields(j)));  // another session's key
  std::string key = add();
  peers.back()->Write(MacedFrame(key, 1, MessageType::kJoin, ToFields(j)));  // wrong sequence
  key = add();
  std::string altered = MacedFrame(key, 0, MessageType::kJoin, ToFields(j));
  altered[kHeaderSize + 20] ^= 1;
  peers.back()->Write(altered);
  REQUIRE(RunUntil(
      h.io, [&] { return AllClosed(peers); }, milliseconds(3000)));
  // None of them counted as a node: two real agents still form a 2-node job.
  RendezvousSucceedsBeside(h);
  CHECK(h.LogContains("bad MAC"));
}

TEST_CASE("ARefusedJoinIsAnsweredWithTheReasonBeforeTheClose") {
  // An agent whose JOIN breaks a protocol limit learns why (an ERROR naming the field) instead
  // of seeing a bare close, which it could only report as a lost server.
  Harness h;
  JoinRequest j = Join(2, 2, -1);
  j.run_id = std::string(2000, 'x');
  auto peer = std::make_shared<RawPeer>(h.io);
  std::string key = Handshake(h, *peer);
  peer->Write(MacedFrame(key, 0, MessageType::kJoin, ToFields(j)));
  REQUIRE(RunUntil(
      h.io, [&] { return peer->closed; }, milliseconds(3000)));
  CHECK(peer->received.find("the rendezvous server refused this node's JOIN") != std::string::npos);
  CHECK(peer->received.find("field 'run_id' is 2000 bytes, more than 1024") != std::string::npos);
  RendezvousSucceedsBeside(h);
}

TEST_CASE("MessagesLargerThanOneMebibyteArriveIntact") {
  // An ASSIGN's node table grows with the job (host names up to 256 bytes); whatever one side
  // can encode the other accepts. 12000 nodes with long names: about 4 MiB.
  asio::io_context io;
  tcp::acceptor acceptor(io, {asio::ip::make_address("127.0.0.1"), 0});
  tcp::socket client_socket(io);
  client_socket.connect(acceptor.local_endpoint());
  auto server_side = Connection::Create(acceptor.accept(), Receiver::kServer);
  // An agent of a job of up to 12000 nodes accepts an ASSIGN sized for them.
  auto client_side = Connection::Create(std::move(client_socket), Receiver::kAgent, 12000);
  std::string key = SessionKey("token", std::string(kNonceSize, 'a'), std::string(kNonceSize, 'b'));
  server_side->StartAuthenticated(key, MacDirection::kToAgent);
  client_side->StartAuthenticated(key, MacDirection::kToServer);
  Assignment a;
  a.num_nodes = 12000;
  a.world_size = 12000;
  a.local_world_size = 1;
  a.master_addr = "10.0.0.1";
  a.master_port = 29500;
  a.run_id = "big";
  for (int r = 0; r < a.num_nodes; ++r) {
    NodeInfo n;
    n.node_rank = r;
    n.host = std::string(250, 'h') + std::to_string(r);
    n.address = "10.0." + std::to_string(r / 256) + "." + std::to_string(r % 256);
    n.local_world_size = 1;
    n.rank_offset = r;
    a.nodes.push_back(n);
  }
  Fields sent = ToFields(a);
  REQUIRE(EncodeFields(sent).size() > (2u << 20));
  std::optional<Fields> got;
  std::optional<Status> closed;
  client_side->SetReadTimeout(milliseconds(5000));
  client_side->Start({[&](MessageType type, Fields f) {
                        CHECK(type == MessageType::kAssign);
                        got = std::move(f);
                      },
                      [&](Status why) { closed = why; }});
  server_side->Start({[](MessageType, Fields) {}, [](Status) {}});
  REQUIRE(server_side->Send(MessageType::kAssign, sent).ok());
  REQUIRE(RunUntil(io, [&] { return got.has_value() || closed.has_value(); }));
  REQUIRE(got.has_value());
  CHECK(*got == sent);
  auto parsed = ParseAssignment(*got);
  REQUIRE(parsed.ok());
  CHECK(parsed->nodes.size() == 12000u);
  // Beyond the protocol's limit, Send refuses without sending or closing.
  Fields huge = {{"nodes", std::string(kMaxPayloadSize, 'x')}};
  CHECK(server_side->Send(MessageType::kAssign, huge).code() == Status::Code::kProtocolError);
  CHECK_FALSE(server_side->closed());
  client_side->Detach();
  server_side->Detach();
  io.restart();
  io.run_for(milliseconds(20));
}

size_t CountLinesStartingWith(const Harness& h, const std::string& prefix) {
  size_t n = 0;
  for (const auto& line : h.log) n += line.rfind(prefix, 0) == 0 ? 1 : 0;
  return n;
}

TEST_CASE("AFrameLargerThanItsTypeAllowsIsRefusedFromItsHeaderAndLogged") {
  // Without a token anyone authenticates. A JOIN announcing 64 MiB used to be read (and
  // buffered) up to the protocol's largest frame; no JOIN needs more than 4 KiB.
  Harness h;
  auto peer = std::make_shared<RawPeer>(h.io);
  Handshake(h, *peer);
  std::string header(kMagic, 4);
  header += std::string("\x00\x01\x00\x04\x04\x00\x00\x20", 8);  // v1, JOIN, 64 MiB + 32
  peer->Write(header + std::string(60000, 'x'));
  REQUIRE(RunUntil(
      h.io, [&] { return peer->closed; }, milliseconds(1000)));
  CHECK(h.LogContains("closed the connection from 127.0.0.1 before it joined"));
  CHECK(h.LogContains("a JOIN frame of 67108896 bytes (a JOIN carries at most 4128)"));
  // After a valid JOIN, a REPORT is bounded too (a 16 KiB stderr tail and a few fields).
  auto joined = std::make_shared<RawPeer>(h.io);
  std::string key = Handshake(h, *joined);
  joined->Write(MacedFrame(key, 0, MessageType::kJoin, ToFields(Join(2, 2, -1))));
  REQUIRE(RunUntil(h.io, [&] { return h.LogContains("first agent"); }));
  header = std::string(kMagic, 4) + std::string("\x00\x01\x00\x07\x00\x10\x00\x00", 8);  // 1 MiB
  joined->Write(header + std::string(60000, 'x'));
  REQUIRE(RunUntil(
      h.io, [&] { return joined->closed; }, milliseconds(1000)));
  CHECK(h.LogContains("a REPORT frame of 1048576 bytes"));
  CHECK(h.LogContains("(127.0.0.1)"));
  RendezvousSucceedsBeside(h);
}

TEST_CASE("StrangersThatAuthenticateButNeverJoinAreCappedAndClosedAtTheDeadline") {
  // Authenticated (no token) but never joining, kept alive with heartbeats: each holds a
  // handshake slot until the deadline, then is told "busy" and closed.
  ServerOptions options;
  options.max_handshakes = 4;
  options.handshake_timeout = milliseconds(400);
  Harness h(options);
  std::vector<std::shared_ptr<RawPeer>> peers;
  std::vector<std::string> keys;
  for (int i = 0; i < 4; ++i) {
    peers.push_back(std::make_shared<RawPeer>(h.io));
    keys.push_back(Handshake(h, *peers.back()));
  }
  auto start = Clock::now();
  uint64_t sequence = 0;
  auto next_beat = start;
  auto all_closed = [&] {
    if (Clock::now() >= next_beat) {  // a heartbeat from each every 100 ms
      for (size_t i = 0; i < peers.size(); ++i)
        if (!peers[i]->closed)
          peers[i]->Write(MacedFrame(keys[i], sequence, MessageType::kHeartbeat, {}));
      ++sequence;
      next_beat += milliseconds(100);
    }
    CHECK(h.server->handshake_count() <= 4);
    return AllClosed(peers);
  };
  REQUIRE(RunUntil(h.io, all_closed, milliseconds(3000)));
  CHECK(Clock::now() - start >= milliseconds(250));
  for (auto& p : peers)
    CHECK(p->received.find("the rendezvous server is busy") != std::string::npos);
  CHECK(h.LogContains("authenticated but sent no JOIN within 400 ms"));
  CHECK(h.server->handshake_count() == 0);
  RendezvousSucceedsBeside(h);
}

TEST_CASE("AgentsQueuedBehindSlowStrangersAreToldBusyRetryAndJoin") {
  // F6: strangers that dribble one byte every 100 ms fill every handshake slot and the queue.
  // An agent queued behind them used to hit its own handshake deadline and quit as if the
  // port belonged to something else; now the server answers "busy" (or makes room: slow
  // strangers lose their slots while others wait) and the agent retries until it joins.
  ServerOptions options;
  options.max_handshakes = 8;
  options.handshake_timeout = milliseconds(1000);
  options.busy_handshake_timeout = milliseconds(300);
  Harness h(options);
  h.client_handshake_timeout = milliseconds(800);  // the agent's own deadline fires first
  std::vector<std::shared_ptr<RawPeer>> strangers;
  for (int i = 0; i < 60; ++i) {
    strangers.push_back(std::make_shared<RawPeer>(h.io));
    strangers.back()->Connect(h.server->port());
  }
  const std::string header(kMagic, 4);
  size_t dribbled = 0;
  auto next_byte = Clock::now();
  auto dribble = [&] {
    if (Clock::now() < next_byte) return;
    for (auto& s : strangers)
      if (!s->closed) s->Write(std::string(1, header[dribbled % 4]));
    ++dribbled;
    next_byte += milliseconds(100);
  };
  RunUntil(
      h.io,
      [&] {
        dribble();
        return false;
      },
      milliseconds(200));
  REQUIRE(h.server->connection_count() == 60);
  JoinRequest j = Join(2, 2, -1);
  j.join_timeout_s = 20;
  Recorder& a = h.AddClient(j);  // from 127.0.0.1, like the strangers
  Recorder& b = h.AddClient(j);
  REQUIRE(RunUntil(
      h.io,
      [&] {
        dribble();
        return (!a.assignments.empty() || a.finished()) && (!b.assignments.empty() || b.finished());
      },
      milliseconds(15000)));
  for (Recorder* r : {&a, &b}) {
    if (r->failed) MESSAGE(r->failed->message());
    CHECK_FALSE(r->failed.has_value());
    CHECK(r->assignments.size() == 1);
  }
  CHECK(h.LogContains("while"));  // slow strangers made room for waiting connections
}

TEST_CASE("AFloodOfStrangersCostsAFewLogLinesAndOneCount") {
  ServerOptions options;
  options.stranger_log_window = milliseconds(600);
  Harness h(options);
  std::vector<std::shared_ptr<RawPeer>> peers;
  for (int i = 0; i < 40; ++i) {
    peers.push_back(std::make_shared<RawPeer>(h.io));
    peers.back()->Connect(h.server->port());
    peers.back()->Write(std::string(kHeaderSize, 'x'));  // bad magic
  }
  REQUIRE(RunUntil(h.io, [&] { return AllClosed(peers); }));
  CHECK(CountLinesStartingWith(h, "closed the connection from") == 5);
  REQUIRE(RunUntil(h.io, [&] { return h.LogContains("more connections closed or refused"); }));
  CHECK(h.LogContains("35 more connections closed or refused before joining in 0.6 s"));
  CHECK(CountLinesStartingWith(h, "closed the connection from") == 5);
}

TEST_CASE("AnUnresolvableHostIsRetriedUntilJoinTimeoutAndSaidAtOnce") {
  // A DNS blip at start, or a name that exists only once the server's machine is up, must not
  // fail the agent at once (torchrun retries too); a misspelt name is still visible at once.
  asio::io_context io;
  ClientOptions options;
  options.host = "no-such-host.invalid";
  options.port = 29500;
  options.join = Join(1, 1, -1);
  options.join.join_timeout_s = 1.0;
  std::vector<std::pair<Clock::time_point, std::string>> warnings;
  options.log = [&](const std::string& line) { warnings.emplace_back(Clock::now(), line); };
  std::optional<Status> failed;
  ClientEvents events;
  events.on_failed = [&](const Status& s, const JobFailure&) { failed = s; };
  auto start = Clock::now();
  auto client = RendezvousClient::Create(io, options, events);
  client->Start();
  REQUIRE(RunUntil(
      io, [&] { return failed.has_value(); }, milliseconds(10000)));
  CHECK(Clock::now() - start >= milliseconds(900));
  CHECK(failed->code() == Status::Code::kTimeout);
  CHECK(failed->message().find("no-such-host.invalid") != std::string::npos);
  REQUIRE(warnings.size() == 1u);
  CHECK(warnings[0].first - start < milliseconds(900));
  CHECK(warnings[0].second.find("retrying until join_timeout") != std::string::npos);
}

TEST_CASE("AServerOfAnotherReleaseIsNamedAsSuch") {
  // A server that speaks another protocol version: its CHALLENGE's header is refused, and the
  // agent says so instead of calling it "not a launch rendezvous server".
  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  tcp::socket server_side(io);
  std::string challenge =
      EncodeFrame(MessageType::kChallenge, {{"nonce", std::string(kNonceSize, 'n')}});
  challenge[5] = static_cast<char>(challenge[5] + 1);  // the version's low byte (big-endian)
  acceptor.async_accept(server_side, [&](const boost::system::error_code& ec) {
    if (!ec) asio::write(server_side, asio::buffer(challenge));
  });
  ClientOptions options;
  options.host = "127.0.0.1";
  options.port = acceptor.local_endpoint().port();
  options.join = Join(1, 1, -1);
  std::optional<Status> failed;
  ClientEvents events;
  events.on_failed = [&](const Status& s, const JobFailure&) { failed = s; };
  auto client = RendezvousClient::Create(io, options, events);
  client->Start();
  REQUIRE(RunUntil(io, [&] { return failed.has_value(); }));
  CHECK(failed->message().find("runs another release of launch (protocol version 2") !=
        std::string::npos);
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
  REQUIRE(RunUntil(h.io, [&] { return AllClosed(peers); }));
}

}  // namespace
}  // namespace launch::rendezvous
