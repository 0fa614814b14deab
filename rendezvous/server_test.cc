// The server end to end: real clients and a real server over loopback TCP, all on one
// io_context (no threads: the test drives the io_context). The round logic itself is tested
// with a fake clock in round_machine_test.cc; here only what needs real sockets.

#include "rendezvous/server.h"

#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include "base/strings.h"
#include "base/test_util.h"
#include "rendezvous/test_util.h"

namespace launch::rendezvous {
namespace {

using namespace testing;
using std::chrono::milliseconds;

using launch::testing::Contains;

TEST_CASE("TwoNodesGetRanksOffsetsAndMasterFromNodeZero") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 1, 3, "hostA"));
  Recorder& b = h.AddClient(Join(2, 2, -1, 2, "hostB"));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  const Assignment& x = a.assignments[0];
  const Assignment& y = b.assignments[0];
  CHECK(x.node_rank == 1);  // explicit rank honoured
  CHECK(y.node_rank == 0);  // the free rank assigned
  CHECK(x.num_nodes == 2);
  CHECK(x.world_size == 5);
  CHECK(y.rank_offset == 0);
  CHECK(y.local_world_size == 2);
  CHECK(x.rank_offset == 2);  // after node 0's two workers
  CHECK(x.local_world_size == 3);
  CHECK(x.master_addr == "127.0.0.1");
  CHECK(x.master_port == 30999);  // hostB (node 0) reserved it
  CHECK(y.master_port == 30999);
  CHECK(x.round == 0);
  CHECK(x.nodes.empty());  // no node table: each node gets its own row
}

TEST_CASE("WorkerFailureRestartsEveryNodeWithTheRootCauseThenJobCompletes") {
  Harness h;
  JoinRequest j = Join(2, 2, -1, 2);
  j.max_restarts = 1;
  Recorder& a = h.AddClient(j);
  Recorder& b = h.AddClient(j);
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  FailureReport r;
  r.round = 0;
  r.global_rank = a.assignments[0].rank_offset + 1;
  r.local_rank = 1;
  r.exit_code = 7;
  r.reason = "exited with code 7";
  r.stderr_tail = "Traceback\nValueError: boom";
  a.client->ReportFailure(r);
  REQUIRE(RunUntil(h.io, [&] { return a.assignments.size() == 2 && b.assignments.size() == 2; }));
  REQUIRE(b.restarts.size() == 1);
  CHECK(b.restarts[0].counts_as_restart);
  REQUIRE(b.restarts[0].report.has_value());
  CHECK(b.restarts[0].report->exit_code == 7);
  CHECK(b.restarts[0].report->stderr_tail == "Traceback\nValueError: boom");
  CHECK(b.restarts[0].report->node_rank == a.assignments[0].node_rank);
  CHECK(a.assignments[1].round == 1);
  CHECK(a.assignments[1].restart_count == 1);
  a.client->ReportSuccess(1);
  REQUIRE(
      RunUntil(h.io, [&] { return h.server->state() == RendezvousServer::JobState::kRunning; }));
  CHECK_FALSE(b.done);
  b.client->ReportSuccess(1);
  REQUIRE(RunUntil(h.io, [&] { return a.done && b.done; }));
  // Once everyone is gone the server forgets the job.
  REQUIRE(RunUntil(h.io, [&] { return h.server->state() == RendezvousServer::JobState::kIdle; }));
}

TEST_CASE("AStrayAgentIsRefusedAloneAndTheFormingJobCompletes") {
  Harness h;
  Recorder& a = h.AddClient(Join(2, 2, 0, 1, "alpha"));
  REQUIRE(RunUntil(h.io, [&] { return h.LogContains("first agent"); }));
  JoinRequest other = Join(2, 2, 1, 1, "beta");
  other.run_id = "other";
  Recorder& stray = h.AddClient(other);
  REQUIRE(RunUntil(h.io, [&] { return stray.finished(); }));
  REQUIRE(stray.failed.has_value());
  CHECK(stray.failed->code() == Status::Code::kInvalidConfig);  // exit 2
  CHECK(Contains(stray.failed->message(), "run_id mismatch"));
  CHECK_FALSE(a.finished());
  Recorder& b = h.AddClient(Join(2, 2, 1, 1, "gamma"));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
}

// A TCP peer that connects (from `local`, when given) and never speaks; notes what it gets.
struct Stranger : std::enable_shared_from_this<Stranger> {
  explicit Stranger(asio::io_context& io) : socket(io) {}
  void Connect(const std::string& to, int port, const std::string& local = "") {
    socket.open(asio::ip::tcp::v4());
    if (!local.empty()) socket.bind({asio::ip::make_address(local), 0});
    socket.connect({asio::ip::make_address(to), static_cast<unsigned short>(port)});
    Read();
  }
  void Read() {
    socket.async_read_some(asio::buffer(chunk), [self = shared_from_this()](
                                                    const boost::system::error_code& ec, size_t n) {
      self->received += n;
      if (ec) {
        self->closed = true;
        return;
      }
      self->Read();
    });
  }
  asio::ip::tcp::socket socket;
  char chunk[256];
  // Bytes of the CHALLENGE (once the server started its handshake) or of a busy ERROR.
  size_t received = 0;
  bool closed = false;
};

TEST_CASE("AFloodOfStrangersWaitsForHandshakeSlotsAndAgentsAreStillAdmitted") {
  ServerOptions options;
  options.max_handshakes = 8;
  options.handshake_timeout = milliseconds(300);
  Harness h(options);
  h.client_handshake_timeout = milliseconds(10000);
  std::vector<std::shared_ptr<Stranger>> strangers;
  for (int i = 0; i < 20; ++i) {
    strangers.push_back(std::make_shared<Stranger>(h.io));
    strangers.back()->Connect("127.0.0.1", h.server->port());
  }
  REQUIRE(RunUntil(h.io, [&] { return h.server->connection_count() == 20; }));
  CHECK(h.server->handshake_count() == 8);
  RunUntil(
      h.io, [] { return false; }, milliseconds(50));
  size_t challenged = 0;
  for (auto& s : strangers) challenged += s->received > 0 ? 1 : 0;
  CHECK(challenged == 8);  // the others cost a descriptor and nothing else
  Recorder& a = h.AddClient(Join(2, 2, -1));
  Recorder& b = h.AddClient(Join(2, 2, -1));
  REQUIRE(RunUntil(
      h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }, milliseconds(8000)));
  CHECK(h.server->handshake_count() <= 8);
}

// A non-loopback IPv4 address of this machine, or "".
std::string NonLoopbackAddress() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* i = list; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    auto* in = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    std::string text = asio::ip::address_v4(ntohl(in->sin_addr.s_addr)).to_string();
    if (!IsLoopbackHost(text)) found = text;
  }
  freeifaddrs(list);
  return found;
}

TEST_CASE("StrangersBeyondThePerSourceCapAreClosedAtOnce") {
  const std::string address = NonLoopbackAddress();
  if (address.empty()) {
    MESSAGE("no non-loopback IPv4 address here");
    return;
  }
  ServerOptions options;
  options.handshake_timeout = milliseconds(5000);
  Harness h(options, address);
  h.client_local_address = "127.0.0.2";  // loopback: counts only toward the total
  std::vector<std::shared_ptr<Stranger>> strangers;
  for (int i = 0; i < 12; ++i) {
    strangers.push_back(std::make_shared<Stranger>(h.io));
    strangers.back()->Connect(address, h.server->port(), address);
  }
  auto closed = [&] {
    size_t n = 0;
    for (auto& s : strangers) n += s->closed ? 1 : 0;
    return n;
  };
  REQUIRE(RunUntil(h.io, [&] { return closed() == 4; }));
  CHECK(h.server->handshake_count() == 8);
  // Agents from other addresses are admitted while the 8 hold their slots.
  Recorder& a = h.AddClient(Join(2, 2, -1));
  Recorder& b = h.AddClient(Join(2, 2, -1));
  REQUIRE(RunUntil(h.io, [&] { return !a.assignments.empty() && !b.assignments.empty(); }));
  CHECK(closed() == 4);
}

TEST_CASE("AgentsBeyondThePerSourceCapAreToldToRetryAndAreAdmitted") {
  // Many nodes behind one NAT address: two silent connections from it hold its handshake
  // slots, so the agents from it are refused as busy, retry, and are admitted once the
  // silent ones time out. Told nothing, they would fail at once ("not a launch server").
  const std::string address = NonLoopbackAddress();
  if (address.empty()) {
    MESSAGE("no non-loopback IPv4 address here");
    return;
  }
  ServerOptions options;
  options.handshake_timeout = milliseconds(400);
  options.max_handshakes_per_source = 2;
  Harness h(options, address);
  std::vector<std::shared_ptr<Stranger>> strangers;
  for (int i = 0; i < 2; ++i) {
    strangers.push_back(std::make_shared<Stranger>(h.io));
    strangers.back()->Connect(address, h.server->port(), address);
  }
  REQUIRE(RunUntil(h.io, [&] { return h.server->handshake_count() == 2; }));
  h.client_local_address = address;
  std::vector<Recorder*> agents;
  for (int i = 0; i < 3; ++i) agents.push_back(&h.AddClient(Join(3, 3, -1)));
  REQUIRE(RunUntil(
      h.io,
      [&] {
        for (Recorder* r : agents)
          if (r->assignments.empty() && !r->finished()) return false;
        return true;
      },
      milliseconds(8000)));
  for (Recorder* r : agents) {
    if (r->failed) MESSAGE(r->failed->message());
    CHECK_FALSE(r->failed.has_value());
    CHECK(r->assignments.size() == 1);
  }
  for (auto& s : strangers) CHECK(s->closed);
}

TEST_CASE("RunningOutOfDescriptorsDoesNotSpinTheAcceptLoop") {
  // A server in a child process with a descriptor limit a few above what it uses; the
  // parent opens more connections than it can accept and the child measures its own CPU
  // time while they wait (a spinning accept loop burns all of it).
  int to_parent[2], to_child[2];
  REQUIRE(pipe(to_parent) == 0);
  REQUIRE(pipe(to_child) == 0);
  pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    asio::io_context io;
    ServerOptions so;
    so.host = "127.0.0.1";
    so.port = 0;
    auto server = RendezvousServer::Create(io, so);
    if (!server->Listen().ok()) _exit(3);
    int port = server->port();
    const int next_fd = dup(0);
    close(next_fd);
    rlimit lim{};
    getrlimit(RLIMIT_NOFILE, &lim);
    lim.rlim_cur = static_cast<rlim_t>(next_fd + 3);
    setrlimit(RLIMIT_NOFILE, &lim);
    if (write(to_parent[1], &port, sizeof(port)) != sizeof(port)) _exit(4);
    char go = 0;
    if (read(to_child[0], &go, 1) != 1) _exit(5);
    rusage before{}, after{};
    getrusage(RUSAGE_SELF, &before);
    io.run_for(milliseconds(600));
    getrusage(RUSAGE_SELF, &after);
    auto ms = [](const rusage& u) {
      return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1000LL +
             (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1000;
    };
    long long cpu_ms = ms(after) - ms(before);
    if (write(to_parent[1], &cpu_ms, sizeof(cpu_ms)) != sizeof(cpu_ms)) _exit(6);
    _exit(0);
  }
  close(to_parent[1]);
  close(to_child[0]);
  auto read_within = [&](void* out, size_t size) {
    pollfd p{to_parent[0], POLLIN, 0};
    return poll(&p, 1, 20000) == 1 && read(to_parent[0], out, size) == static_cast<ssize_t>(size);
  };
  int port = 0;
  bool ok = read_within(&port, sizeof(port));
  asio::io_context io;
  std::vector<asio::ip::tcp::socket> sockets;
  for (int i = 0; ok && i < 12; ++i) {
    sockets.emplace_back(io);
    boost::system::error_code ec;
    sockets.back().connect({asio::ip::make_address("127.0.0.1"), static_cast<unsigned short>(port)},
                           ec);
  }
  long long cpu_ms = -1;
  if (ok) ok = write(to_child[1], "g", 1) == 1 && read_within(&cpu_ms, sizeof(cpu_ms));
  if (!ok) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  close(to_parent[0]);
  close(to_child[1]);
  REQUIRE(ok);
  CHECK(WIFEXITED(status));
  INFO("server CPU time during 600 ms out of descriptors: " << cpu_ms << " ms");
  CHECK(cpu_ms < 150);
}

TEST_CASE("FailAndStopSendsFailedToEveryAgentThenStops") {
  Harness h;
  Recorder& a = h.AddClient(Join(3, 3, -1));
  Recorder& b = h.AddClient(Join(3, 3, -1));
  REQUIRE(RunUntil(
      h.io, [&] { return h.server->connection_count() == 2 && h.LogContains("first agent"); }));
  REQUIRE(RunUntil(h.io, [&] {
    return h.log.size() >= 1 && h.server->state() == RendezvousServer::JobState::kWaiting;
  }));
  h.server->FailAndStop("the rendezvous host is leaving: SIGTERM");
  REQUIRE(RunUntil(h.io, [&] { return a.finished() && b.finished(); }));
  for (Recorder* r : {&a, &b}) {
    REQUIRE(r->failed.has_value());
    CHECK(Contains(r->failed->message(), "the rendezvous host is leaving: SIGTERM"));
  }
  REQUIRE(RunUntil(h.io, [&] { return h.server->connection_count() == 0; }));
  Recorder& late = h.AddClient(Join(1, 1, -1));  // nobody accepts any more
  RunUntil(
      h.io, [] { return false; }, milliseconds(100));
  CHECK(late.assignments.empty());
}

TEST_CASE("ClientRetriesUntilTheServerStartsLater") {
  asio::io_context probe;
  asio::ip::tcp::acceptor a(probe, {asio::ip::make_address("127.0.0.1"), 0});
  int port = a.local_endpoint().port();
  a.close();
  ServerOptions options;
  options.port = port;
  // The harness's server listens at once; start a client against a second, later server.
  Harness h;
  JoinRequest j = Join(1, 1, -1);
  Recorder& r = h.AddClient(j, "", true, port);
  RunUntil(
      h.io, [] { return false; }, milliseconds(300));
  CHECK_FALSE(r.finished());
  CHECK(r.assignments.empty());
  options.host = "127.0.0.1";
  auto late = RendezvousServer::Create(h.io, options);
  REQUIRE(late->Listen().ok());
  REQUIRE(RunUntil(h.io, [&] { return !r.assignments.empty(); }));
  r.client->Close();
  late->Stop();
}

TEST_CASE("UnreachableEndpointFailsAfterJoinTimeoutNamingTheAddress") {
  asio::io_context probe;
  asio::ip::tcp::acceptor a(probe, {asio::ip::make_address("127.0.0.1"), 0});
  int port = a.local_endpoint().port();
  a.close();
  Harness h;
  JoinRequest j = Join(1, 1, -1);
  j.join_timeout_s = 0.3;
  Recorder& r = h.AddClient(j, "", true, port);
  REQUIRE(RunUntil(h.io, [&] { return r.finished(); }));
  REQUIRE(r.failed.has_value());
  CHECK(r.failed->code() == Status::Code::kTimeout);
  CHECK(Contains(r.failed->message(), "127.0.0.1:" + std::to_string(port)));
}

TEST_CASE("PortInUseIsOneLineNamingTheAddress") {
  Harness h;
  ServerOptions options;
  options.host = "127.0.0.1";
  options.port = h.server->port();
  auto second = RendezvousServer::Create(h.io, options);
  Status s = second->Listen();
  CHECK(s.code() == Status::Code::kIoError);
  CHECK(s.message() ==
        "rendezvous port 127.0.0.1:" + std::to_string(h.server->port()) + " is already in use");
}

TEST_CASE("Ipv6LoopbackWorks") {
  asio::io_context io;
  ServerOptions so;
  so.host = "::1";
  so.port = 0;
  auto server = RendezvousServer::Create(io, so);
  Status listen = server->Listen();
  if (!listen.ok()) {
    MESSAGE("no IPv6 loopback here: " << listen.message());
    return;
  }
  ClientOptions co;
  co.host = "::1";
  co.port = server->port();
  co.join = Join(1, 1, -1);
  std::optional<Assignment> got;
  ClientEvents ev;
  ev.on_assigned = [&](const Assignment& a) { got = a; };
  auto client = RendezvousClient::Create(io, co, ev);
  client->Start();
  REQUIRE(RunUntil(io, [&] { return got.has_value(); }));
  CHECK(got->master_addr == "::1");
  CHECK(client->endpoint() == "[::1]:" + std::to_string(server->port()));
  client->Close();
  server->Stop();
}

}  // namespace
}  // namespace launch::rendezvous
