// EtcdClient against a real single-member etcd on loopback (/usr/bin/etcd, Debian's
// etcd-server), one per test case (it answers ~0.1 s after starting), and against sockets that
// refuse or never answer.

#include "rendezvous/etcd_client.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <thread>

#include <doctest/doctest.h>
#include <boost/asio.hpp>

#include "base/files.h"
#include "base/test_skip.h"
#include "base/test_util.h"

extern char** environ;

namespace launch::rendezvous {
namespace {

using launch::testing::Contains;
using std::chrono::milliseconds;

constexpr char kEtcdBinary[] = "/usr/bin/etcd";
// Every key these tests write starts with it: the tests never touch anything else.
constexpr char kEtcdTestPrefix[] = "/etcd-client-test/";

StatusOr<EtcdClient> EtcdClientFor(std::vector<std::string> endpoints,
                                   milliseconds timeout = milliseconds(2000)) {
  EtcdOptions options;
  options.endpoints = std::move(endpoints);
  options.request_timeout = timeout;
  return EtcdClient::Create(std::move(options));
}

// A single-member etcd on 127.0.0.1 (free client and peer ports, a fresh data dir). The
// destructor kills it (SIGKILL: its data goes with the folder), reaps it and removes its folder,
// also when a REQUIRE failed. Started under `setpriv --pdeathsig KILL` where setpriv exists, so
// that a test binary that crashes does not leave it running either.
class EtcdTestServer {
 public:
  ~EtcdTestServer() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      while (::waitpid(pid_, nullptr, 0) < 0 && errno == EINTR) {
      }
    }
    std::error_code ignored;
    if (!dir_.empty()) std::filesystem::remove_all(dir_, ignored);
  }

  // Starts etcd and waits (at most 10 s) until it answers; false after recording a skip when
  // etcd is not installed. REQUIREs the rest.
  bool Start() {
    if (!FileExists(kEtcdBinary)) {
      launch::testing::SkipNeedsSetup(std::string(kEtcdBinary) + " not installed (etcd-server)");
      return false;
    }
    dir_ = launch::testing::MakeTempDir("etcd-client-test");
    // Both held open at once, so the kernel hands out two different ports.
    boost::asio::io_context io;
    using tcp = boost::asio::ip::tcp;
    tcp::acceptor a(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
    tcp::acceptor b(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
    client_port_ = a.local_endpoint().port();
    int peer_port = b.local_endpoint().port();
    a.close();
    b.close();
    std::string client_url = "http://127.0.0.1:" + std::to_string(client_port_);
    std::string peer_url = "http://127.0.0.1:" + std::to_string(peer_port);
    std::vector<std::string> args;
    if (FileExists("/usr/bin/setpriv")) args = {"/usr/bin/setpriv", "--pdeathsig", "KILL"};
    for (const char* arg : {kEtcdBinary, "--name", "test", "--data-dir"}) args.push_back(arg);
    args.push_back(dir_ + "/data");
    for (const char* flag : {"--listen-client-urls", "--advertise-client-urls"}) {
      args.push_back(flag);
      args.push_back(client_url);
    }
    for (const char* flag : {"--listen-peer-urls", "--initial-advertise-peer-urls"}) {
      args.push_back(flag);
      args.push_back(peer_url);
    }
    args.push_back("--initial-cluster");
    args.push_back("test=" + peer_url);
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);

    int log = ::open((dir_ + "/log").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    REQUIRE(log >= 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&actions, log, 1);
    posix_spawn_file_actions_adddup2(&actions, log, 2);
    int rc = ::posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(log);
    REQUIRE_MESSAGE(rc == 0, "posix_spawn ", argv[0], ": ", std::strerror(rc));

    auto probe = EtcdClientFor({endpoint()}, milliseconds(200));
    REQUIRE(probe.ok());
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    Status last;
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL("etcd exited while starting: ", ReadSmallFile(dir_ + "/log"));
      }
      auto got = probe->Get(std::string(kEtcdTestPrefix) + "probe");
      if (got.ok()) return true;
      last = got.status();
      std::this_thread::sleep_for(milliseconds(20));
    }
    FAIL("etcd did not answer within 10 s: ", last.ToString(), "\n", ReadSmallFile(dir_ + "/log"));
    return false;
  }

  std::string endpoint() const { return "127.0.0.1:" + std::to_string(client_port_); }

 private:
  std::string dir_;
  pid_t pid_ = -1;
  int client_port_ = 0;
};

// A loopback port nothing listens on: connections to it are refused.
int ClosedLoopbackPort() {
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor a(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  return a.local_endpoint().port();
}

TEST_CASE("EtcdPutGetPrefixAndDeleteRoundTripAnyBytes") {
  EtcdTestServer etcd;
  if (!etcd.Start()) return;
  auto client = EtcdClientFor({"http://" + etcd.endpoint()});
  REQUIRE(client.ok());
  CHECK(client->local_address().empty());
  const std::string p = std::string(kEtcdTestPrefix) + "rt/";
  // Lengths 0 to 4 mod 3 (base64 padding), a NUL, newlines and bytes >= 0x80.
  const std::string binary("line\none\n\0\x80\xff\xfe", 12);
  REQUIRE(client->Put(p + "a", binary).ok());
  REQUIRE(client->Put(p + "b\n\xc3\xa9", "").ok());
  REQUIRE(client->Put(p + "c", "xy").ok());
  REQUIRE(client->Put(std::string(kEtcdTestPrefix) + "rt0", "outside the prefix").ok());
  CHECK(client->local_address() == "127.0.0.1");

  auto a = client->Get(p + "a");
  REQUIRE(a.ok());
  REQUIRE(a->has_value());
  CHECK((*a)->key == p + "a");
  CHECK((*a)->value == binary);
  CHECK((*a)->lease == 0);
  CHECK((*a)->create_revision > 0);
  CHECK((*a)->mod_revision == (*a)->create_revision);
  auto empty = client->Get(p + "b\n\xc3\xa9");
  REQUIRE(empty.ok());
  REQUIRE(empty->has_value());
  CHECK((*empty)->value.empty());
  auto missing = client->Get(p + "nothing");
  REQUIRE(missing.ok());
  CHECK_FALSE(missing->has_value());

  auto all = client->GetPrefix(p);
  REQUIRE(all.ok());
  REQUIRE(all->size() == 3);  // in key order, without "rt0"
  CHECK((*all)[0].value == binary);
  CHECK((*all)[1].key == p + "b\n\xc3\xa9");
  CHECK((*all)[2].value == "xy");

  REQUIRE(client->DeletePrefix(p).ok());
  auto none = client->GetPrefix(p);
  REQUIRE(none.ok());
  CHECK(none->empty());
  auto outside = client->Get(std::string(kEtcdTestPrefix) + "rt0");
  REQUIRE(outside.ok());
  CHECK(outside->has_value());
}

TEST_CASE("EtcdCreateIfAbsentCreatesOnceAndReturnsTheFirstValue") {
  EtcdTestServer etcd;
  if (!etcd.Start()) return;
  auto client = EtcdClientFor({etcd.endpoint()});
  REQUIRE(client.ok());
  const std::string key = std::string(kEtcdTestPrefix) + "leader";
  auto first = client->CreateIfAbsent(key, "node-a\x80", 0);
  REQUIRE(first.ok());
  CHECK(first->first);
  CHECK(first->second.value == "node-a\x80");
  auto second = client->CreateIfAbsent(key, "node-b", 0);
  REQUIRE(second.ok());
  CHECK_FALSE(second->first);
  CHECK(second->second.key == key);
  CHECK(second->second.value == "node-a\x80");
  CHECK(second->second.create_revision == first->second.create_revision);
}

TEST_CASE("EtcdPutIfValueWritesOnlyWhileTheGuardHolds") {
  EtcdTestServer etcd;
  if (!etcd.Start()) return;
  auto client = EtcdClientFor({etcd.endpoint()});
  REQUIRE(client.ok());
  const std::string guard = std::string(kEtcdTestPrefix) + "guard";
  const std::string key = std::string(kEtcdTestPrefix) + "record";
  auto value_of = [&](const std::string& k) {
    auto got = client->Get(k);
    REQUIRE(got.ok());
    return got->has_value() ? (*got)->value : std::string("(none)");
  };
  // No guard key: it does not hold.
  auto none = client->PutIfValue(key, "r0", 0, guard, "me\x80");
  REQUIRE(none.ok());
  CHECK_FALSE(*none);
  CHECK(value_of(key) == "(none)");
  REQUIRE(client->Put(guard, "me\x80").ok());
  auto mine = client->PutIfValue(key, "r1", 0, guard, "me\x80");
  REQUIRE(mine.ok());
  CHECK(*mine);
  CHECK(value_of(key) == "r1");
  // Another holds the guard now: the old holder's write is refused and changes nothing.
  REQUIRE(client->Put(guard, "other").ok());
  auto stale = client->PutIfValue(key, "r2", 0, guard, "me\x80");
  REQUIRE(stale.ok());
  CHECK_FALSE(*stale);
  CHECK(value_of(key) == "r1");
  // A lease that is gone: NotFound, as Put says it.
  auto lease = client->Grant(5);
  REQUIRE(lease.ok());
  REQUIRE(client->Revoke(*lease).ok());
  auto lapsed = client->PutIfValue(key, "r3", *lease, guard, "other");
  CHECK((lapsed.status().code() == Status::Code::kNotFound));
  CHECK(value_of(key) == "r1");
}

TEST_CASE("EtcdRevokedLeaseTakesItsKeysAndKeepAliveSaysItIsGone") {
  EtcdTestServer etcd;
  if (!etcd.Start()) return;
  auto client = EtcdClientFor({etcd.endpoint()});
  REQUIRE(client.ok());
  const std::string key = std::string(kEtcdTestPrefix) + "alive";
  auto lease = client->Grant(2);
  REQUIRE(lease.ok());
  CHECK(*lease != 0);
  REQUIRE(client->Put(key, "x", *lease).ok());
  auto got = client->Get(key);
  REQUIRE(got.ok());
  REQUIRE(got->has_value());
  CHECK((*got)->lease == *lease);
  auto ttl = client->KeepAlive(*lease);
  REQUIRE(ttl.ok());
  CHECK(*ttl > 0);

  REQUIRE(client->Revoke(*lease).ok());
  got = client->Get(key);
  REQUIRE(got.ok());
  CHECK_FALSE(got->has_value());
  ttl = client->KeepAlive(*lease);
  REQUIRE(ttl.ok());
  CHECK(*ttl == 0);
  CHECK(client->Revoke(*lease).ok());  // already gone: fine
  // etcd's own error, with its text.
  Status put = client->Put(key, "y", *lease);
  CHECK(put.code() == Status::Code::kNotFound);
  CHECK(Contains(put.message(), "requested lease not found"));
  CHECK(Contains(put.message(), etcd.endpoint()));
  auto zero = client->Grant(0);
  CHECK(zero.status().code() == Status::Code::kInvalidArgument);
}

TEST_CASE("EtcdExpiredLeaseTakesItsKeys") {
  EtcdTestServer etcd;
  if (!etcd.Start()) return;
  auto client = EtcdClientFor({etcd.endpoint()});
  REQUIRE(client.ok());
  const std::string key = std::string(kEtcdTestPrefix) + "expiring";
  auto lease = client->Grant(1);  // etcd rounds it up to its minimum (2 s by default)
  REQUIRE(lease.ok());
  auto created = client->CreateIfAbsent(key, "x", *lease);
  REQUIRE(created.ok());
  CHECK(created->first);
  CHECK(created->second.lease == *lease);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  bool gone = false;
  while (!gone && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(100));
    auto got = client->Get(key);
    REQUIRE(got.ok());
    gone = !got->has_value();
  }
  CHECK(gone);
  auto ttl = client->KeepAlive(*lease);
  REQUIRE(ttl.ok());
  CHECK(*ttl == 0);
}

TEST_CASE("EtcdFailsOverFromARefusingEndpoint") {
  EtcdTestServer etcd;
  if (!etcd.Start()) return;
  std::string refusing = "127.0.0.1:" + std::to_string(ClosedLoopbackPort());
  auto client = EtcdClientFor({refusing, etcd.endpoint()});
  REQUIRE(client.ok());
  CHECK(client->Describe() == refusing + ", " + etcd.endpoint());
  const std::string key = std::string(kEtcdTestPrefix) + "failover";
  REQUIRE(client->Put(key, "v").ok());
  auto got = client->Get(key);  // straight to the endpoint that answered last
  REQUIRE(got.ok());
  REQUIRE(got->has_value());
  CHECK((*got)->value == "v");
  CHECK(client->local_address() == "127.0.0.1");
}

TEST_CASE("EtcdSilentEndpointIsAnErrorWithinTheTimeoutNamingEveryEndpoint") {
  // A listening socket nobody accepts on: the kernel completes the connection, nobody answers
  // (what a member of a cluster without quorum does).
  boost::asio::io_context io;
  boost::asio::ip::tcp::acceptor silent(io, {boost::asio::ip::make_address("127.0.0.1"), 0});
  std::string silent_endpoint = "127.0.0.1:" + std::to_string(silent.local_endpoint().port());
  std::string refusing = "127.0.0.1:" + std::to_string(ClosedLoopbackPort());
  auto client = EtcdClientFor({refusing, silent_endpoint}, milliseconds(300));
  REQUIRE(client.ok());
  auto start = std::chrono::steady_clock::now();
  auto got = client->Get(std::string(kEtcdTestPrefix) + "x");
  auto took = std::chrono::steady_clock::now() - start;
  REQUIRE_FALSE(got.ok());
  CHECK(got.status().code() == Status::Code::kPeerLost);
  const std::string& m = got.status().message();
  CHECK(Contains(m, refusing + ": connection refused"));
  CHECK(Contains(m, silent_endpoint + ": no answer within 300 ms"));
  CHECK(took < std::chrono::seconds(2));
  CHECK(client->local_address().empty());
}

TEST_CASE("EtcdCreateRejectsBadEndpoints") {
  for (const char* bad : {"host:notaport", "host", "host:0", "host:65536", "::1:2379", "[::1:2379",
                          ":2379", "https://host:2379"}) {
    auto client = EtcdClientFor({"127.0.0.1:2379", bad});
    REQUIRE_FALSE(client.ok());
    CHECK(client.status().code() == Status::Code::kInvalidConfig);
    CHECK_MESSAGE(Contains(client.status().message(), bad), client.status().message());
  }
  CHECK(EtcdClientFor({}).status().code() == Status::Code::kInvalidConfig);
  CHECK(EtcdClientFor({"a:1"}, milliseconds(0)).status().code() == Status::Code::kInvalidConfig);
  auto good = EtcdClientFor({"http://10.0.0.1:2379/", "[::1]:2379", "etcd-0.etcd:2379"});
  REQUIRE(good.ok());
  CHECK(good->Describe() == "10.0.0.1:2379, [::1]:2379, etcd-0.etcd:2379");
}

}  // namespace
}  // namespace launch::rendezvous
