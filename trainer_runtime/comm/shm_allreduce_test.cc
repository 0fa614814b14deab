// ShmAllReduce between real processes: this test binary is rank 0 and re-runs itself (posix_spawn
// of /proc/self/exe, test case ShmAllReducePeerProcess) as the other ranks, so the segment, the
// futexes and the liveness checks work across address spaces exactly as in training. The peers
// meet through a real TCPStore hosted here.

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "trainer_runtime/comm/hierarchical.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/shm_allreduce.h"
#include "trainer_runtime/comm/shm_p2p.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

extern char** environ;

namespace launch::trainer {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kPeerTest = "ShmAllReducePeerProcess";
const std::vector<c10::ScalarType> kDtypes = {c10::kFloat, c10::kDouble, c10::kBFloat16,
                                              c10::kHalf};
// Odd sizes: below a cache line, not a multiple of anything, across several 4 KiB chunks.
const std::vector<int64_t> kSizes = {0, 1, 3, 17, 1000, 4099, 100003};

int CountOpenFds() {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(dir))
    if (e->d_name[0] != '.') ++n;
  ::closedir(dir);
  return n - 1;  // the directory's own fd
}

// The descriptors the transports open: memfd segments and pidfds. Tests where a peer is killed
// count these rather than all fds: the store server hosted here closes its socket to the dead
// peer whenever its thread notices, which is not the transport's business.
int CountShmFds() {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  while (dirent* e = ::readdir(dir)) {
    char target[256] = {};
    const std::string path = std::string("/proc/self/fd/") + e->d_name;
    if (e->d_name[0] == '.' || ::readlink(path.c_str(), target, sizeof(target) - 1) <= 0) continue;
    const std::string t = target;
    if (t.rfind("/memfd:launch-shm", 0) == 0 || t == "anon_inode:[pidfd]") ++n;
  }
  ::closedir(dir);
  return n;
}

// Rank `rank`'s input for operation `op`: values spread over several magnitudes, so the order
// of summation shows in the low bits (and in bfloat16's rounding).
at::Tensor Input(int rank, int op, int64_t n, c10::ScalarType dtype) {
  auto gen = at::detail::createCPUGenerator(1000 * op + rank + 1);
  at::Tensor x = at::randn({n}, gen, at::TensorOptions().dtype(at::kDouble));
  at::Tensor scale =
      at::pow(10.0, at::randint(-3, 4, {n}, gen, at::TensorOptions().dtype(at::kDouble)));
  return (x * scale).to(dtype);
}

// What one process computes: ((t0 + t1) + t2) + ... in LibTorch.
at::Tensor Reference(int world, int op, int64_t n, c10::ScalarType dtype) {
  at::Tensor sum = Input(0, op, n, dtype);
  for (int r = 1; r < world; ++r) sum = sum + Input(r, op, n, dtype);
  return sum;
}

struct Env {
  int rank = 0;
  int world = 1;
  int port = 0;
  std::string scenario;
};

Env PeerEnv() {
  Env env;
  env.rank = std::atoi(std::getenv("LAUNCH_SHM_TEST_RANK"));
  env.world = std::atoi(std::getenv("LAUNCH_SHM_TEST_WORLD"));
  env.port = std::atoi(std::getenv("LAUNCH_SHM_TEST_PORT"));
  env.scenario = std::getenv("LAUNCH_SHM_TEST_SCENARIO");
  return env;
}

c10::intrusive_ptr<c10d::TCPStore> ConnectStore(int port, bool server, int world) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = server;
  opts.numWorkers = world;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(30);
  return compat::NewTcpStore("127.0.0.1", opts);
}

// Reduce-scatter shard sizes: one element, odd, and more elements than one 4 KiB chunk holds
// for every dtype and world size (a shard crosses several chunks).
const std::vector<int64_t> kShards = {1, 7, 3001};
// All-gather inputs: empty, one element, odd, and several 4 KiB chunks for every dtype.
const std::vector<int64_t> kGatherSizes = {0, 1, 7, 4099};
const std::vector<c10::ScalarType> kGatherDtypes = {c10::kFloat, c10::kBFloat16, c10::kLong};

// Rank `rank`'s all-gather input: Input() for floating types, 64-bit integers (all bits matter)
// for kLong.
at::Tensor GatherInput(int rank, int op, int64_t n, c10::ScalarType dtype) {
  if (dtype != c10::kLong) return Input(rank, op, n, dtype);
  auto gen = at::detail::createCPUGenerator(1000 * op + rank + 1);
  return at::randint(-(int64_t(1) << 62), int64_t(1) << 62, {n}, gen,
                     at::TensorOptions().dtype(at::kLong));
}

at::Tensor GatherReference(int world, int op, int64_t n, c10::ScalarType dtype) {
  std::vector<at::Tensor> parts;
  for (int r = 0; r < world; ++r) parts.push_back(GatherInput(r, op, n, dtype));
  return at::cat(parts);
}

bool ShortTimeout(const std::string& scenario) {
  return scenario == "stuck" || scenario == "p2p_stuck";
}

ShmAllReduceOptions TestOptions(const std::string& scenario) {
  ShmAllReduceOptions o;
  o.chunk_bytes = 4096;  // small: the odd sizes cross chunk boundaries
  o.timeout = ShortTimeout(scenario) ? milliseconds(300) : milliseconds(60000);
  return o;
}

// Send/recv over rings of 4 KiB: most messages are streamed and wrap around the ring.
std::unique_ptr<ShmPointToPoint> MakeP2P(const ShmAllReduce& shm,
                                         const c10::intrusive_ptr<c10d::Store>& store,
                                         const Env& env) {
  ShmPointToPointOptions o;
  o.ring_bytes = 4096;
  o.timeout = ShortTimeout(env.scenario) ? milliseconds(300) : milliseconds(60000);
  return std::make_unique<ShmPointToPoint>(store, env.rank, env.world, shm.pids(), o);
}

pid_t SpawnPeer(int rank, int world, int port, const std::string& scenario) {
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e)
    if (std::strncmp(*e, "LAUNCH_SHM_TEST_", 16) != 0) env_strings.push_back(*e);
  env_strings.push_back("LAUNCH_SHM_TEST_RANK=" + std::to_string(rank));
  env_strings.push_back("LAUNCH_SHM_TEST_WORLD=" + std::to_string(world));
  env_strings.push_back("LAUNCH_SHM_TEST_PORT=" + std::to_string(port));
  env_strings.push_back("LAUNCH_SHM_TEST_SCENARIO=" + scenario);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::string exe = "/proc/self/exe";
  std::string filter = std::string("--test-case=") + kPeerTest;
  std::string quiet = "--minimal";
  char* argv[] = {exe.data(), filter.data(), quiet.data(), nullptr};
  pid_t pid = -1;
  REQUIRE(::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()) == 0);
  return pid;
}

// The child's wait status, or kills it when it outlives `timeout` (a hang fails the test,
// bounded, instead of hanging it).
int WaitChild(pid_t pid, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      FAIL_CHECK("peer " << pid << " did not finish in time");
      return status;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  return status;
}

std::unique_ptr<ShmAllReduce> MustCreate(c10d::Store& store, const Env& env, bool enabled = true) {
  auto setup = ShmAllReduce::Create(store, env.rank, env.world, enabled, TestOptions(env.scenario));
  REQUIRE_MESSAGE(setup.ok(), setup.status().ToString());
  REQUIRE_MESSAGE(setup->shm != nullptr, setup->reason);
  return std::move(setup->shm);
}

// --- scenarios: run by rank 0 (this process) and by the peers alike ---------------------------

// Every dtype and odd size, all issued back to back before any is waited for (plus one run
// inline), each checked bit for bit against the one-process rank-order sum; completions must
// come in issue order.
void RunExact(ShmAllReduce& shm, const Env& env) {
  struct Pending {
    at::Tensor tensor;
    c10::intrusive_ptr<c10d::Work> work;
    int op;
  };
  std::vector<Pending> pending;
  std::mutex mu;
  std::vector<int> completed;
  int op = 0;
  for (c10::ScalarType dtype : kDtypes) {
    for (int64_t n : kSizes) {
      at::Tensor t = Input(env.rank, op, n, dtype);
      auto work = shm.AllReduceAsync(t);
      work->getFuture()->addCallback([&mu, &completed, op](c10::ivalue::Future&) {
        std::lock_guard<std::mutex> lock(mu);
        completed.push_back(op);
      });
      pending.push_back({t, work, op});
      ++op;
    }
  }
  at::Tensor inline_tensor = Input(env.rank, op, 777, c10::kFloat);
  REQUIRE(shm.AllReduceNow(inline_tensor).ok());
  CHECK(at::equal(inline_tensor, Reference(env.world, op, 777, c10::kFloat)));
  for (auto& p : pending) {
    REQUIRE(p.work->wait());
    CHECK(p.work->isSuccess());
    const at::Tensor want = Reference(env.world, p.op, p.tensor.numel(), p.tensor.scalar_type());
    CHECK_MESSAGE(at::equal(p.tensor, want), "op " << p.op << " " << p.tensor.scalar_type() << " x"
                                                   << p.tensor.numel() << " on rank " << env.rank);
    CHECK(p.work->getFuture()->value().toTensorVector()[0].data_ptr() == p.tensor.data_ptr());
  }
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(completed.size() == pending.size());
  for (size_t i = 0; i < completed.size(); ++i) CHECK(completed[i] == static_cast<int>(i));
}

// The peer joins one operation, says so, then stalls (killed by rank 0, or just never coming).
void RunStall(ShmAllReduce& shm, c10d::Store& store) {
  at::Tensor t = at::ones({1000});
  REQUIRE(shm.AllReduceAsync(t)->wait());
  store.set("stalled", std::vector<uint8_t>{1});
  ::pause();
}

// Broadcasts (any dtype, several chunks) between all-reduces still in flight: every rank ends
// with rank 0's bytes, and the all-reduces around them stay exact.
void RunBroadcast(ShmAllReduce& shm, const Env& env) {
  at::Tensor before = Input(env.rank, 0, 5000, c10::kFloat);
  auto work = shm.AllReduceAsync(before);
  at::Tensor ints = at::arange(100003, at::kLong) * (env.rank + 1);
  REQUIRE(shm.BroadcastFromRank0(ints)->wait());
  CHECK(at::equal(ints, at::arange(100003, at::kLong)));
  at::Tensor floats = at::full({3000}, static_cast<float>(env.rank) + 0.5f);
  REQUIRE(shm.BroadcastFromRank0(floats)->wait());
  CHECK(at::equal(floats, at::full({3000}, 0.5f)));
  at::Tensor after = Input(env.rank, 1, 3000, c10::kDouble);
  REQUIRE(shm.AllReduceNow(after).ok());
  REQUIRE(work->wait());
  CHECK(at::equal(before, Reference(env.world, 0, 5000, c10::kFloat)));
  CHECK(at::equal(after, Reference(env.world, 1, 3000, c10::kDouble)));
  // A broadcast where the peers all-reduce is an error, not silent corruption.
  at::Tensor odd = at::ones({64});
  if (env.rank == 0) {
    CHECK_THROWS_WITH_AS(shm.BroadcastFromRank0(odd)->wait(),
                         doctest::Contains("ranks issued different operations"), c10::Error);
  } else {
    CHECK_FALSE(shm.AllReduceNow(odd).ok());
  }
}

void RunMismatch(ShmAllReduce& shm, const Env& env) {
  at::Tensor t = at::ones({env.rank == 0 ? 100 : 50});
  auto work = shm.AllReduceAsync(t);
  CHECK_THROWS_WITH_AS(work->wait(), doctest::Contains("ranks issued different operations"),
                       c10::Error);
}

// Empty all-reduces and broadcasts take part in the agreement: issued by every rank they
// complete and the operations after them stay exact; one rank's 0 elements against another's 64
// fail on both ranks, as any other mismatch does.
void RunZeroBytes(ShmAllReduce& shm, const Env& env) {
  at::Tensor empty = at::empty({0});
  REQUIRE(shm.AllReduceAsync(empty)->wait());
  REQUIRE(shm.BroadcastFromRank0(at::empty({0}, at::kLong))->wait());
  at::Tensor after = Input(env.rank, 0, 300, c10::kFloat);
  REQUIRE(shm.AllReduceNow(after).ok());
  CHECK(at::equal(after, Reference(env.world, 0, 300, c10::kFloat)));
  at::Tensor uneven = at::ones({env.rank == 0 ? 0 : 64});
  CHECK_THROWS_WITH_AS(shm.AllReduceAsync(uneven)->wait(),
                       doctest::Contains("ranks issued different operations"), c10::Error);
}

// Ranks in a ring: each sends every dtype and odd size to the next rank before it receives
// anything from the previous one (messages far bigger than the 4 KiB ring: the sends must not
// wait for the receiver), from a non-contiguous source and into a non-contiguous target too.
// Rank 0 first waits for a message rank 1 sends only after a pause (the receiver opens a
// channel the sender has not created yet).
void RunP2P(ShmPointToPoint& p2p, const Env& env) {
  const int next = (env.rank + 1) % env.world;
  const int prev = (env.rank + env.world - 1) % env.world;
  if (env.rank == 1) {
    std::this_thread::sleep_for(milliseconds(200));
    REQUIRE(p2p.Send(at::full({3}, 7.0, at::kDouble), 0, 9)->wait());
  }
  if (env.rank == 0) {
    at::Tensor hello = at::zeros({3}, at::kDouble);
    REQUIRE(p2p.Recv(hello, 1, 9)->wait());
    CHECK(at::equal(hello, at::full({3}, 7.0)));
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  std::vector<at::Tensor> sent;
  int op = 0;
  for (c10::ScalarType dtype : kDtypes) {
    for (int64_t n : kSizes) {
      sent.push_back(Input(env.rank, op, n, dtype));
      sends.push_back(p2p.Send(sent.back(), next, op));
      ++op;
    }
  }
  at::Tensor wide = Input(env.rank, op, 2 * 3001, c10::kFloat).view({3001, 2});
  sends.push_back(p2p.Send(wide.t(), next, op));  // non-contiguous source
  struct Posted {
    at::Tensor tensor;
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor want;
  };
  std::vector<Posted> posted;
  op = 0;
  for (c10::ScalarType dtype : kDtypes) {
    for (int64_t n : kSizes) {
      at::Tensor t = at::empty({n}, at::TensorOptions().dtype(dtype));
      posted.push_back({t, p2p.Recv(t, prev, op), Input(prev, op, n, dtype)});
      ++op;
    }
  }
  at::Tensor target = at::empty({3001, 2}).t();  // non-contiguous target
  posted.push_back({target, p2p.Recv(target, prev, op),
                    Input(prev, op, 2 * 3001, c10::kFloat).view({3001, 2}).t()});
  // Waiting for the last receive completes every earlier one from that rank, in order.
  REQUIRE(posted.back().work->wait());
  for (auto& p : posted) {
    CHECK(p.work->isCompleted());
    CHECK_MESSAGE(at::equal(p.tensor, p.want),
                  p.tensor.scalar_type() << " x" << p.tensor.numel() << " on rank " << env.rank);
  }
  for (auto& w : sends) REQUIRE(w->wait());
  // A message already complete in the ring is received by isCompleted() without wait().
  REQUIRE(p2p.Send(at::full({4}, 1.0f * env.rank), next, 1000)->wait());
  at::Tensor small = at::zeros({4});
  auto work = p2p.Recv(small, prev, 1000);
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (!work->isCompleted() && Clock::now() < deadline)
    std::this_thread::sleep_for(milliseconds(1));
  CHECK(at::equal(small, at::full({4}, 1.0f * prev)));
}

// Rank 1 sends one message with the expected tag, then one with another: the receive fails,
// naming both, and the channel stays failed.
void RunP2PMismatch(ShmPointToPoint& p2p, const Env& env) {
  if (env.rank == 1) {
    REQUIRE(p2p.Send(at::ones({8}), 0, 1)->wait());
    REQUIRE(p2p.Send(at::ones({8}), 0, 2)->wait());
    return;
  }
  at::Tensor t = at::zeros({8});
  REQUIRE(p2p.Recv(t, 1, 1)->wait());
  CHECK_THROWS_WITH_AS(p2p.Recv(t, 1, 1)->wait(), doctest::Contains("whose next message is tag 2"),
                       c10::Error);
  CHECK_THROWS_WITH_AS(p2p.Recv(t, 1, 2)->wait(), doctest::Contains("tag 2"), c10::Error);
}

// The peer sends one message (or none, for "p2p_silent"), says so, then stalls.
void RunP2PStall(ShmPointToPoint& p2p, c10d::Store& store, const Env& env) {
  if (env.scenario != "p2p_silent") REQUIRE(p2p.Send(at::ones({1000}), 0, 0)->wait());
  store.set("stalled", std::vector<uint8_t>{1});
  ::pause();
}

// Reduce-scatters of every dtype and shard size, each beside an all-reduce of the same data,
// and all-gathers of odd sizes and an integer dtype, all issued back to back (plus some run
// inline, in place): a reduce-scatter equals the all-reduce's shard bit for bit (and the
// one-process rank-order sum), leaves its input alone, and every operation completes in
// issue order.
void RunCollectives(ShmAllReduce& shm, const Env& env) {
  const int w = env.world;
  struct Pending {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor got;
    at::Tensor want;
    std::string what;
  };
  std::vector<Pending> pending;
  std::mutex mu;
  std::vector<size_t> completed;
  auto issue = [&](c10::intrusive_ptr<c10d::Work> work, at::Tensor got, at::Tensor want,
                   std::string what) {
    const size_t index = pending.size();
    work->getFuture()->addCallback([&mu, &completed, index](c10::ivalue::Future&) {
      std::lock_guard<std::mutex> lock(mu);
      completed.push_back(index);
    });
    pending.push_back({work, got, want, what});
  };
  struct Scattered {
    at::Tensor input, output, reduced;
    int op;
  };
  std::vector<Scattered> scattered;
  int op = 0;
  for (c10::ScalarType dtype : kDtypes) {
    for (int64_t s : kShards) {
      at::Tensor input = Input(env.rank, op, w * s, dtype);
      at::Tensor reduced = input.clone();
      at::Tensor output = at::full({s}, -1.0, at::TensorOptions().dtype(dtype));
      const at::Tensor want = Reference(w, op, w * s, dtype).narrow(0, env.rank * s, s);
      std::ostringstream what;
      what << dtype << " shard " << s << " on rank " << env.rank;
      issue(shm.AllReduceAsync(reduced), reduced, Reference(w, op, w * s, dtype),
            "all-reduce " + what.str());
      issue(shm.ReduceScatterAsync(input, output), output, want, "reduce-scatter " + what.str());
      scattered.push_back({input, output, reduced, op});
      ++op;
    }
  }
  for (c10::ScalarType dtype : kGatherDtypes) {
    for (int64_t n : kGatherSizes) {
      at::Tensor output = at::zeros({w * n}, at::TensorOptions().dtype(dtype));
      std::ostringstream what;
      what << "all-gather " << dtype << " x" << n << " on rank " << env.rank;
      issue(shm.AllGatherAsync(GatherInput(env.rank, op, n, dtype), output), output,
            GatherReference(w, op, n, dtype), what.str());
      ++op;
    }
  }
  // Inline, in place: the output is the input's own shard, the input the output's own part.
  at::Tensor whole = Input(env.rank, op, w * 1001, c10::kDouble);
  REQUIRE(shm.ReduceScatterNow(whole, whole.narrow(0, env.rank * 1001, 1001)).ok());
  CHECK(at::equal(whole.narrow(0, env.rank * 1001, 1001),
                  Reference(w, op, w * 1001, c10::kDouble).narrow(0, env.rank * 1001, 1001)));
  ++op;
  at::Tensor gathered = at::zeros({w * 2001}, at::kBFloat16);
  at::Tensor mine = gathered.narrow(0, env.rank * 2001, 2001);
  mine.copy_(GatherInput(env.rank, op, 2001, c10::kBFloat16));
  REQUIRE(shm.AllGatherNow(mine, gathered).ok());
  CHECK(at::equal(gathered, GatherReference(w, op, 2001, c10::kBFloat16)));
  ++op;
  at::Tensor in_place = Input(env.rank, op, w * 777, c10::kFloat);
  REQUIRE(shm.ReduceScatterAsync(in_place, in_place.narrow(0, env.rank * 777, 777))->wait());
  CHECK(at::equal(in_place.narrow(0, env.rank * 777, 777),
                  Reference(w, op, w * 777, c10::kFloat).narrow(0, env.rank * 777, 777)));

  for (auto& p : pending) {
    INFO(p.what);
    REQUIRE(p.work->wait());
    CHECK(at::equal(p.got, p.want));
    CHECK(p.work->result()[0].data_ptr() == p.got.data_ptr());
  }
  for (const Scattered& s : scattered) {
    const int64_t n = s.output.numel();
    INFO(s.output.scalar_type() << " shard " << n << " on rank " << env.rank);
    CHECK(at::equal(s.output, s.reduced.narrow(0, env.rank * n, n)));
    CHECK(at::equal(s.input, Input(env.rank, s.op, w * n, s.output.scalar_type())));  // unchanged
  }
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(completed.size() == pending.size());
  for (size_t i = 0; i < completed.size(); ++i) CHECK(completed[i] == i);
  // Arguments the REQUIRES rule out fail at once, issue nothing and leave the transport usable.
  CHECK_THROWS_WITH_AS(shm.ReduceScatterAsync(at::ones({w * 4 + 1}), at::empty({4}))->wait(),
                       doctest::Contains("unsupported tensors"), c10::Error);
  CHECK(shm.AllGatherNow(at::ones({4}), at::empty({w * 4}, at::kDouble)).code() ==
        Status::Code::kInvalidArgument);
  CHECK_FALSE(shm.SupportsReduceScatter(at::ones({w * 4}, at::kLong), at::empty({4}, at::kLong)));
  CHECK_FALSE(shm.SupportsReduceScatter(at::ones({w * 4, 2}).t(), at::empty({8})));
  CHECK(shm.SupportsAllGather(at::ones({4}, at::kLong), at::empty({w * 4}, at::kLong)));
  // A broadcast right behind a reduce-scatter (which does not wait for the peers at its end).
  at::Tensor last = at::ones({w * 5});
  at::Tensor shard = at::empty({5});
  auto scatter = shm.ReduceScatterAsync(last, shard);
  at::Tensor ints = at::arange(10, at::kLong) * (env.rank + 1);
  REQUIRE(shm.BroadcastFromRank0(ints)->wait());
  CHECK(at::equal(ints, at::arange(10, at::kLong)));
  REQUIRE(scatter->wait());
  CHECK(at::equal(shard, at::full({5}, static_cast<float>(w))));
}

// A reduce-scatter where the other rank all-gathers: both fail naming both operations.
void RunCollectiveMismatch(ShmAllReduce& shm, const Env& env) {
  Status status = env.rank == 0 ? shm.ReduceScatterNow(at::ones({128}), at::empty({64}))
                                : shm.AllGatherNow(at::ones({64}), at::empty({128}));
  CHECK(status.code() == Status::Code::kProtocolError);
  CHECK_MESSAGE(status.ToString().find("reduce-scatters") != std::string::npos, status.ToString());
  CHECK_MESSAGE(status.ToString().find("all-gathers") != std::string::npos, status.ToString());
}

// Rank 1 joins one reduce-scatter, says so and stalls until rank 0 kills it; rank 2 (with three
// ranks) issues the next reduce-scatter like rank 0 and reports how it failed.
void RunCollectiveKill(ShmAllReduce& shm, c10d::Store& store, const Env& env) {
  at::Tensor out = at::empty({1000});
  REQUIRE(shm.ReduceScatterAsync(at::ones({env.world * 1000}), out)->wait());
  if (env.rank == 1) {
    store.set("stalled", std::vector<uint8_t>{1});
    ::pause();
  }
  store.wait({"stalled"});
  std::string error = "no error";
  try {
    shm.ReduceScatterAsync(at::ones({env.world * 100000}), at::empty({100000}))->wait();
  } catch (const c10::Error& e) {
    error = e.what();
  }
  store.set("rank2", std::vector<uint8_t>(error.begin(), error.end()));
}

// ZeRO's flat collectives through CountingProcessGroup, once over shared memory and once over
// Gloo (a group without the shared-memory transport) on the same data: the same results, and
// the counts, bytes and launch times of what was issued.
void RunFlatCollectives(std::unique_ptr<ShmAllReduce> shm,
                        const c10::intrusive_ptr<c10d::Store>& store, const Env& env) {
  const int w = env.world;
  compat::GroupOptions options;
  options.timeout = std::chrono::seconds(60);
  options.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  options.gloo_threads = 1;
  auto gloo = compat::NewProcessGroup(c10::make_intrusive<c10d::PrefixStore>("gloo", store),
                                      env.rank, w, options);
  auto via_shm = c10::make_intrusive<CountingProcessGroup>(gloo, std::move(shm));
  auto via_gloo = c10::make_intrusive<CountingProcessGroup>(gloo);
  REQUIRE(via_shm->shm() != nullptr);
  REQUIRE(via_gloo->shm() == nullptr);
  int op = 0;
  int64_t rs_bytes = 0;
  int scatters = 0;
  for (c10::ScalarType dtype : kDtypes) {
    for (int64_t s : kShards) {
      INFO(dtype << " shard " << s << " on rank " << env.rank);
      const at::Tensor input = Input(env.rank, op, w * s, dtype);
      at::Tensor a = input.clone(), b = input.clone(), c = input.clone();
      at::Tensor out_shm = at::empty({s}, dtype), out_gloo = at::empty({s}, dtype);
      auto w1 = via_shm->ReduceScatterFlat(a, out_shm);
      auto w2 = via_gloo->ReduceScatterFlat(b, out_gloo);
      // Gloo cannot add bfloat16 (the reduce-scatter sums it in float).
      const bool gloo_adds = dtype != c10::kBFloat16;
      std::vector<at::Tensor> all = {c};
      if (gloo_adds) REQUIRE(via_gloo->allreduce(all, c10d::AllreduceOptions())->wait());
      REQUIRE(w1->wait());
      REQUIRE(w2->wait());
      CHECK(w2->result()[0].data_ptr() == out_gloo.data_ptr());
      CHECK(at::equal(out_shm, Reference(w, op, w * s, dtype).narrow(0, env.rank * s, s)));
      if (gloo_adds) CHECK(at::equal(out_gloo, c.narrow(0, env.rank * s, s)));  // sliced
      if (w == 2) {
        CHECK(at::equal(out_gloo, out_shm));  // a + b == b + a: one addition, no order
      } else {
        // Gloo's ring adds in another order: equal up to rounding.
        const double scale = input.abs().max().to(at::kDouble).item<double>() * w;
        CHECK(at::allclose(out_gloo.to(at::kDouble), out_shm.to(at::kDouble), 0, scale * 1e-2));
      }
      rs_bytes += 2 * input.numel() * input.element_size();
      scatters += 2;
      ++op;
    }
  }
  int64_t ag_bytes = 0;
  int gathers = 0;
  for (c10::ScalarType dtype : kGatherDtypes) {
    for (int64_t n : kGatherSizes) {
      INFO(dtype << " x" << n << " on rank " << env.rank);
      const at::Tensor input = GatherInput(env.rank, op, n, dtype);
      at::Tensor out_shm = at::zeros({w * n}, dtype), out_gloo = at::zeros({w * n}, dtype);
      auto w1 = via_shm->AllGatherFlat(input, out_shm);
      auto w2 = via_gloo->AllGatherFlat(input, out_gloo);
      REQUIRE(w2->wait());
      REQUIRE(w1->wait());
      CHECK(w2->result()[0].data_ptr() == out_gloo.data_ptr());
      const at::Tensor want = GatherReference(w, op, n, dtype);
      CHECK(at::equal(out_shm, want));
      CHECK(at::equal(out_gloo, want));
      ag_bytes += 2 * want.numel() * want.element_size();
      gathers += 2;
      ++op;
    }
  }
  // The standard c10d entry points route to the flat ones (and count).
  for (auto* pg : {via_shm.get(), via_gloo.get()}) {
    c10d::ProcessGroup& base = *pg;
    at::Tensor in = at::full({w * 3}, 1.0 + env.rank, at::kDouble);
    at::Tensor out = at::empty({3}, at::kDouble);
    REQUIRE(base._reduce_scatter_base(out, in)->wait());
    CHECK(at::equal(out, at::full({3}, w * (w + 1) / 2.0, at::kDouble)));
    at::Tensor one = at::full({2}, static_cast<int64_t>(env.rank), at::kLong);
    at::Tensor all = at::empty({w * 2}, at::kLong);
    REQUIRE(base._allgather_base(all, one)->wait());
    CHECK(at::equal(all, at::arange(w, at::kLong).repeat_interleave(2)));
    rs_bytes += in.numel() * 8;
    ag_bytes += all.numel() * 8;
  }
  scatters += 2;
  gathers += 2;
  CHECK(via_shm->reduce_scatter_count() + via_gloo->reduce_scatter_count() == scatters);
  CHECK(via_shm->reduce_scatter_count() == scatters / 2);
  CHECK(via_shm->reduce_scatter_bytes() + via_gloo->reduce_scatter_bytes() == rs_bytes);
  CHECK(via_shm->allgather_count() + via_gloo->allgather_count() == gathers);
  CHECK(via_shm->allgather_bytes() + via_gloo->allgather_bytes() == ag_bytes);
  // Launch times: reduce-scatters with the all-reduces, all-gathers on their own.
  CHECK(via_shm->TakeLaunchTimes().size() == static_cast<size_t>(scatters / 2));
  CHECK(via_gloo->TakeLaunchTimes().size() ==
        static_cast<size_t>(scatters / 2 + (kDtypes.size() - 1) * kShards.size()));
  CHECK(via_shm->TakeAllgatherLaunchTimes().size() == static_cast<size_t>(gathers / 2));
  CHECK(via_shm->allreduce_count() == 0);
  // Wrong sizes are the caller's bug: thrown at the call, nothing issued.
  CHECK_THROWS_AS(via_gloo->ReduceScatterFlat(at::ones({w * 4 + 1}), at::empty({4})), c10::Error);
  CHECK_THROWS_AS(via_shm->AllGatherFlat(at::ones({4}), at::empty({w * 4}, at::kDouble)),
                  c10::Error);
  REQUIRE(via_gloo->barrier(c10d::BarrierOptions())->wait());
}

// A Gloo group wrapped without shared memory, as across hosts.
c10::intrusive_ptr<CountingProcessGroup> GlooOnly(const c10::intrusive_ptr<c10d::Store>& store,
                                                  const Env& env) {
  compat::GroupOptions options;
  options.timeout = std::chrono::seconds(60);
  options.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  options.gloo_threads = 1;
  return c10::make_intrusive<CountingProcessGroup>(compat::NewProcessGroup(
      c10::make_intrusive<c10d::PrefixStore>("gloo_only", store), env.rank, env.world, options));
}

// --- hierarchical.h: ranks posing as several hosts (ShmAllReduceOptions::host_identity) ---------

// "hier": hosts A A A B B (two levels, an exact order); "hier_mixed": A B A C (a host of one
// rank, three leaders, hosts' ranks not contiguous).
std::vector<std::string> PosedHosts(const std::string& scenario) {
  if (scenario == "hier") return {"A", "A", "A", "B", "B"};
  return {"A", "B", "A", "C"};
}

// The group as CreateGroupOver builds it across hosts, with the identities posed.
c10::intrusive_ptr<CountingProcessGroup> HierarchicalGroup(
    const c10::intrusive_ptr<c10d::Store>& store, const Env& env) {
  ShmAllReduceOptions options = TestOptions(env.scenario);
  options.host_identity = PosedHosts(env.scenario)[env.rank];
  auto shm = ShmAllReduce::Create(*store, env.rank, env.world, true, options);
  REQUIRE_MESSAGE(shm.ok(), shm.status().ToString());
  REQUIRE(shm->shm == nullptr);  // they span hosts
  REQUIRE(shm->hosts == PosedHosts(env.scenario));
  LeaderGroupFactory leaders = [](const c10::intrusive_ptr<c10d::Store>& s, int r, int n) {
    compat::GroupOptions o;
    o.timeout = std::chrono::seconds(60);
    o.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    o.gloo_threads = 1;
    return compat::NewProcessGroup(s, r, n, o);
  };
  auto setup = HierarchicalAllReduce::Create(c10::make_intrusive<c10d::PrefixStore>("hier", store),
                                             env.rank, shm->hosts, leaders, options);
  REQUIRE_MESSAGE(setup.ok(), setup.status().ToString());
  REQUIRE_MESSAGE(setup->hierarchical != nullptr, setup->reason);
  compat::GroupOptions o;
  o.timeout = std::chrono::seconds(60);
  o.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  o.gloo_threads = 1;
  auto gloo = compat::NewProcessGroup(c10::make_intrusive<c10d::PrefixStore>("world", store),
                                      env.rank, env.world, o);
  return c10::make_intrusive<CountingProcessGroup>(gloo, nullptr, nullptr,
                                                   std::move(setup->hierarchical));
}

// The two-level sum of Input(r, op): each host's ranks in order, then the host sums in host
// order (exact for two hosts: a + b == b + a).
at::Tensor HierarchicalReference(const std::vector<std::string>& hosts, int op, int64_t n,
                                 c10::ScalarType dtype) {
  std::vector<std::string> order;
  std::vector<at::Tensor> sums;
  for (size_t r = 0; r < hosts.size(); ++r) {
    size_t h = std::find(order.begin(), order.end(), hosts[r]) - order.begin();
    const at::Tensor x = Input(static_cast<int>(r), op, n, dtype);
    if (h == order.size()) {
      order.push_back(hosts[r]);
      sums.push_back(x);
    } else {
      sums[h] = sums[h] + x;
    }
  }
  at::Tensor total = sums[0].to(at::kDouble);
  for (size_t h = 1; h < sums.size(); ++h) total = total + sums[h].to(at::kDouble);
  if (sums.size() == 2) return sums[0].to(dtype) + sums[1];
  return total.to(dtype);
}

// Every rank's copy of `t` (through the group's Gloo all-gather) equals rank 0's, bit for bit.
void CheckSameOnEveryRank(CountingProcessGroup& pg, const at::Tensor& t) {
  const at::Tensor all = at::empty({pg.getSize() * t.numel()}, t.options());
  REQUIRE(pg.AllGatherFlat(t.view({-1}), all)->wait());
  for (int r = 1; r < pg.getSize(); ++r)
    CHECK(at::equal(all.narrow(0, r * t.numel(), t.numel()), all.narrow(0, 0, t.numel())));
}

void RunHierarchical(const c10::intrusive_ptr<c10d::Store>& store, const Env& env) {
  const std::vector<std::string> hosts = PosedHosts(env.scenario);
  auto pg = HierarchicalGroup(store, env);
  HierarchicalAllReduce& hier = *pg->hierarchical();
  const int hosts_count = env.scenario == "hier" ? 2 : 3;
  CHECK(pg->allreduce_transport() == "hierarchical: shared memory within " +
                                         std::to_string(hosts_count) + " hosts + Gloo across");
  CHECK(hier.leader() ==
        (std::find(hosts.begin(), hosts.end(), hosts[env.rank]) - hosts.begin() == env.rank));
  // All-reduces of every dtype and odd size, issued back to back, then checked.
  int op = 0;
  int64_t leader_bytes = 0, ops = 0;
  std::vector<std::pair<at::Tensor, at::Tensor>> pending;  // (result, reference)
  std::vector<at::Tensor> magnitudes;                      // sum over ranks of |input|, per element
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (c10::ScalarType dtype : kDtypes) {
    for (int64_t n : kSizes) {
      std::vector<at::Tensor> t = {Input(env.rank, op, n, dtype)};
      works.push_back(pg->allreduce(t, c10d::AllreduceOptions()));
      pending.push_back({t[0], HierarchicalReference(hosts, op, n, dtype)});
      at::Tensor magnitude = at::zeros({n}, at::kDouble);
      for (int r = 0; r < env.world; ++r) magnitude += Input(r, op, n, dtype).to(at::kDouble).abs();
      magnitudes.push_back(magnitude);
      if (n > 0) leader_bytes += n * t[0].element_size(), ++ops;
      ++op;
    }
  }
  for (size_t i = 0; i < works.size(); ++i) {
    REQUIRE(works[i]->wait());
    INFO(pending[i].first.scalar_type() << " x" << pending[i].first.numel());
    if (hosts_count == 2) {
      CHECK(at::equal(pending[i].first, pending[i].second));
    } else if (pending[i].first.scalar_type() == at::kHalf) {
      // float16 crosses hosts as float16, summed by Gloo's ring in its own order with a rounding
      // after each addition (the reference rounds once): within a few roundings (2^-11) of the
      // magnitudes summed.
      const at::Tensor error =
          (pending[i].first.to(at::kDouble) - pending[i].second.to(at::kDouble)).abs();
      CHECK(at::le(error, magnitudes[i] * (4.0 / 2048)).all().item<bool>());
    } else {
      CHECK(at::allclose(pending[i].first.to(at::kDouble), pending[i].second.to(at::kDouble), 1e-2,
                         1e-2));
    }
    CheckSameOnEveryRank(*pg, pending[i].first);
  }
  CHECK(pg->allreduce_count() == static_cast<int64_t>(works.size()));
  // A broadcast from rank 0 of any dtype, and ZeRO's reduce-scatter (an all-reduce's bits).
  at::Tensor longs = at::full({1001}, static_cast<int64_t>(env.rank * 7 + 1), at::kLong);
  std::vector<at::Tensor> b = {longs};
  c10d::BroadcastOptions bo;
  REQUIRE(pg->broadcast(b, bo)->wait());
  CHECK(at::equal(longs, at::full({1001}, int64_t{1}, at::kLong)));
  leader_bytes += 1001 * 8, ++ops;
  const int64_t shard = 333;
  at::Tensor in = Input(env.rank, 99, shard * env.world, c10::kFloat);
  at::Tensor out = at::empty({shard}, at::kFloat);
  REQUIRE(pg->ReduceScatterFlat(in, out)->wait());
  const at::Tensor want = HierarchicalReference(hosts, 99, shard * env.world, c10::kFloat);
  if (hosts_count == 2) CHECK(at::equal(out, want.narrow(0, env.rank * shard, shard)));
  CHECK(pg->reduce_scatter_count() == 1);
  leader_bytes += shard * env.world * 4, ++ops;
  // Only leaders cross hosts, with every byte of every operation.
  CHECK(pg->cross_host_count() == (hier.leader() ? ops : 0));
  CHECK(pg->cross_host_bytes() == (hier.leader() ? leader_bytes : 0));
  REQUIRE(pg->barrier(c10d::BarrierOptions())->wait());
}

void RunPeer(const Env& env) {
  auto tcp = ConnectStore(env.port, /*server=*/false, env.world);
  auto store = c10::make_intrusive<c10d::PrefixStore>(env.scenario, tcp);
  if (env.scenario.rfind("hier", 0) == 0) return RunHierarchical(store, env);
  if (env.scenario == "disabled") {
    auto setup = ShmAllReduce::Create(*store, env.rank, env.world, /*enabled=*/false);
    REQUIRE(setup.ok());
    CHECK(setup->shm == nullptr);
    return;
  }
  if (env.scenario == "gloo_kill") {
    auto pg = GlooOnly(store, env);
    at::Tensor out = at::empty({100});
    REQUIRE(pg->ReduceScatterFlat(at::ones({200}), out)->wait());
    store->set("stalled", std::vector<uint8_t>{1});
    ::pause();
  }
  auto shm = MustCreate(*store, env);
  if (env.scenario.rfind("flat", 0) == 0) return RunFlatCollectives(std::move(shm), store, env);
  if (env.scenario.rfind("collectives", 0) == 0) RunCollectives(*shm, env);
  if (env.scenario == "collective_mismatch") RunCollectiveMismatch(*shm, env);
  if (env.scenario == "collective_kill") RunCollectiveKill(*shm, *store, env);
  if (env.scenario.rfind("p2p", 0) == 0) {
    auto p2p = MakeP2P(*shm, store, env);
    if (env.scenario == "p2p") RunP2P(*p2p, env);
    if (env.scenario == "p2p_mismatch") RunP2PMismatch(*p2p, env);
    if (env.scenario == "p2p_kill" || env.scenario == "p2p_silent" || env.scenario == "p2p_stuck")
      RunP2PStall(*p2p, *store, env);
    return;
  }
  if (env.scenario == "exact") RunExact(*shm, env);
  if (env.scenario == "kill" || env.scenario == "stuck") RunStall(*shm, *store);
  if (env.scenario == "mismatch") RunMismatch(*shm, env);
  if (env.scenario == "zero_bytes") RunZeroBytes(*shm, env);
  if (env.scenario == "broadcast") RunBroadcast(*shm, env);
}

// Rank 0's side: hosts the store, spawns ranks 1..world-1, runs `body`, reaps the peers.
struct Group {
  Env env;
  c10::intrusive_ptr<c10d::TCPStore> tcp;
  c10::intrusive_ptr<c10d::PrefixStore> store;
  std::vector<pid_t> peers;

  Group(const std::string& scenario, int world) {
    tcp = ConnectStore(0, /*server=*/true, world);
    env = Env{0, world, tcp->getPort(), scenario};
    store = c10::make_intrusive<c10d::PrefixStore>(scenario, tcp);
    for (int r = 1; r < world; ++r) peers.push_back(SpawnPeer(r, world, env.port, scenario));
  }
  // REQUIRES: the peers exit by themselves.
  void ExpectPeersSucceed() {
    for (pid_t p : peers) {
      const int status = WaitChild(p, milliseconds(60000));
      CHECK_MESSAGE((WIFEXITED(status) && WEXITSTATUS(status) == 0),
                    "peer " << p << " failed (status " << status << ")");
    }
    peers.clear();
  }
  ~Group() {
    for (pid_t p : peers) {
      ::kill(p, SIGKILL);
      ::waitpid(p, nullptr, 0);
    }
  }
};

TEST_CASE("ShmAllReducePeerProcess") {
  // Only meaningful when spawned by the tests below; a plain run of the suite skips it.
  if (!std::getenv("LAUNCH_SHM_TEST_SCENARIO")) return;
  RunPeer(PeerEnv());
}

TEST_CASE("ShmAllReduceIsBitIdenticalToRankOrderSumForEveryDtypeAndOddSizes") {
  // Three ranks: with two, a + b == b + a would hide a wrong order.
  const int fds_before = CountOpenFds();
  {
    Group g("exact", 3);
    auto shm = MustCreate(*g.store, g.env);
    CHECK(shm->world_size() == 3);
    RunExact(*shm, g.env);
    g.ExpectPeersSucceed();
  }
  // The segment's fd was closed after setup; pidfds went with the transport; the store's
  // sockets with the store.
  CHECK(CountOpenFds() == fds_before);
}

TEST_CASE("ShmBroadcastFromRank0CopiesAnyDtypeInOrderWithAllReduces") {
  Group g("broadcast", 3);
  auto shm = MustCreate(*g.store, g.env);
  RunBroadcast(*shm, g.env);
  g.ExpectPeersSucceed();
}

TEST_CASE("ShmAllReduceFailsFastWhenAPeerIsKilledMidOperation") {
  Group g("kill", 2);
  const int fds_before_shm = CountShmFds();
  {
    auto shm = MustCreate(*g.store, g.env);
    at::Tensor first = at::ones({1000});
    REQUIRE(shm->AllReduceAsync(first)->wait());
    CHECK(first[0].item<float>() == 2.0f);
    CHECK(CountShmFds() > fds_before_shm);  // the peer's pidfd
    g.store->wait({"stalled"});
    // Rank 0 is inside the operation, asleep on the futex, when the peer dies.
    at::Tensor t = at::ones({100000});
    auto work = shm->AllReduceAsync(t);
    std::this_thread::sleep_for(milliseconds(100));
    CHECK_FALSE(work->isCompleted());
    const auto killed = Clock::now();
    ::kill(g.peers[0], SIGKILL);
    // Not reaped yet: a zombie must count as dead (kill(pid, 0) would still succeed).
    CHECK_THROWS_WITH_AS(work->wait(), doctest::Contains("exited while rank 0 waited"), c10::Error);
    const auto took = Clock::now() - killed;
    CHECK(took < std::chrono::seconds(2));  // the timeout is 60 s
    // The transport stays failed: later operations fail at once with the first error.
    at::Tensor later = at::ones({10});
    CHECK_THROWS_WITH_AS(shm->AllReduceAsync(later)->wait(), doctest::Contains("exited"),
                         c10::Error);
    const Status now = shm->AllReduceNow(later);
    CHECK(now.code() == Status::Code::kPeerLost);
  }
  CHECK(CountShmFds() == fds_before_shm);
}

TEST_CASE("ShmAllReduceTimesOutWhenAPeerNeverArrives") {
  Group g("stuck", 2);
  auto shm = MustCreate(*g.store, g.env);  // timeout 300 ms
  at::Tensor first = at::ones({1000});
  REQUIRE(shm->AllReduceAsync(first)->wait());
  g.store->wait({"stalled"});
  at::Tensor t = at::ones({1000});
  const auto start = Clock::now();
  CHECK_THROWS_WITH_AS(shm->AllReduceAsync(t)->wait(), doctest::Contains("did not reach"),
                       c10::Error);
  const auto took = Clock::now() - start;
  CHECK(took >= milliseconds(300));
  CHECK(took < std::chrono::seconds(5));
}

TEST_CASE("ShmAllReduceRejectsRanksIssuingDifferentOperations") {
  Group g("mismatch", 2);
  auto shm = MustCreate(*g.store, g.env);
  RunMismatch(*shm, g.env);
  g.ExpectPeersSucceed();
}

TEST_CASE("ShmAllReduceOfZeroBytesAgreesWithItsPeers") {
  Group g("zero_bytes", 2);
  auto shm = MustCreate(*g.store, g.env);
  RunZeroBytes(*shm, g.env);
  g.ExpectPeersSucceed();
}

TEST_CASE("ShmAllReduceIsOffForAllRanksWhenOneRankDisablesIt") {
  Group g("disabled", 2);
  auto setup = ShmAllReduce::Create(*g.store, 0, 2, /*enabled=*/true);
  REQUIRE(setup.ok());
  CHECK(setup->shm == nullptr);
  CHECK(setup->reason.find("LAUNCH_SHM_ALLREDUCE=0 on rank 1") != std::string::npos);
  g.ExpectPeersSucceed();
}

TEST_CASE("ShmAllReduceSupportsOnlyDenseContiguousSumOfFloatingTypes") {
  c10d::AllreduceOptions sum;
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  auto ok = [&](at::Tensor t, const c10d::AllreduceOptions& o) {
    return ShmAllReduce::Supports({t}, o);
  };
  CHECK(ok(at::ones({4}), sum));
  CHECK(ok(at::ones({4}, at::kDouble), sum));
  CHECK(ok(at::ones({4}, at::kBFloat16), sum));
  CHECK(ok(at::ones({4}, at::kHalf), sum));
  CHECK_FALSE(ok(at::ones({4}, at::kLong), sum));
  CHECK_FALSE(ok(at::ones({4}), max));
  CHECK_FALSE(ok(at::ones({4, 4}).t(), sum));  // not contiguous
  CHECK_FALSE(ShmAllReduce::Supports({at::ones({4}), at::ones({4})}, sum));
}

TEST_CASE("ShmSendRecvDeliversEveryMessageExactlyInOrderThroughSmallRings") {
  const int fds_before = CountOpenFds();
  {
    Group g("p2p", 3);
    auto shm = MustCreate(*g.store, g.env);
    auto p2p = MakeP2P(*shm, g.store, g.env);
    RunP2P(*p2p, g.env);
    g.ExpectPeersSucceed();
  }
  // Segments unmapped, memfds and pidfds closed, threads joined.
  CHECK(CountOpenFds() == fds_before);
}

TEST_CASE("ShmRecvRejectsAMessageOtherThanThePostedOne") {
  Group g("p2p_mismatch", 2);
  auto shm = MustCreate(*g.store, g.env);
  auto p2p = MakeP2P(*shm, g.store, g.env);
  RunP2PMismatch(*p2p, g.env);
  g.ExpectPeersSucceed();
}

TEST_CASE("ShmRecvFailsFastWhenTheSenderIsKilled") {
  for (const char* scenario : {"p2p_kill", "p2p_silent"}) {
    CAPTURE(scenario);
    Group g(scenario, 2);
    const int fds_before = CountShmFds();
    {
      auto shm = MustCreate(*g.store, g.env);
      auto p2p = MakeP2P(*shm, g.store, g.env);
      at::Tensor t = at::zeros({1000});
      if (std::string(scenario) == "p2p_kill") {
        REQUIRE(p2p->Recv(t, 1, 0)->wait());
        CHECK(t[999].item<float>() == 1.0f);
      }
      g.store->wait({"stalled"});
      auto work = p2p->Recv(t, 1, 0);
      std::thread killer([&] {
        std::this_thread::sleep_for(milliseconds(100));
        ::kill(g.peers[0], SIGKILL);  // not reaped: a zombie must count as gone
      });
      const auto start = Clock::now();
      CHECK_THROWS_WITH_AS(work->wait(),
                           doctest::Contains(std::string(scenario) == "p2p_kill"
                                                 ? "exited while rank 0 waited"
                                                 : "exited before it sent to rank 0"),
                           c10::Error);
      killer.join();
      CHECK(Clock::now() - start < std::chrono::seconds(3));  // the timeout is 60 s
      // The channel stays failed.
      CHECK_THROWS_AS(p2p->Recv(t, 1, 0)->wait(), c10::Error);
      CHECK(CountShmFds() > fds_before);  // pidfds of the peer: the count below means something
    }
    CHECK(CountShmFds() == fds_before);
  }
}

TEST_CASE("ShmRecvTimesOutWhenTheSenderSendsNothing") {
  Group g("p2p_stuck", 2);
  auto shm = MustCreate(*g.store, g.env);
  auto p2p = MakeP2P(*shm, g.store, g.env);  // timeout 300 ms
  at::Tensor t = at::zeros({1000});
  REQUIRE(p2p->Recv(t, 1, 0)->wait());
  g.store->wait({"stalled"});
  const auto start = Clock::now();
  CHECK_THROWS_WITH_AS(p2p->Recv(t, 1, 0)->wait(), doctest::Contains("waited 300 ms"), c10::Error);
  const auto took = Clock::now() - start;
  CHECK(took >= milliseconds(300));
  CHECK(took < std::chrono::seconds(5));
}

TEST_CASE("ShmReduceScatterAndAllGatherAreExactInOrderWithAllReducesForTwoAndThreeRanks") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    Group g("collectives" + std::to_string(world), world);
    auto shm = MustCreate(*g.store, g.env);
    RunCollectives(*shm, g.env);
    g.ExpectPeersSucceed();
  }
}

TEST_CASE("ShmReduceScatterRejectsARankThatAllGathers") {
  Group g("collective_mismatch", 2);
  auto shm = MustCreate(*g.store, g.env);
  RunCollectiveMismatch(*shm, g.env);
  g.ExpectPeersSucceed();
}

TEST_CASE("ShmReduceScatterFailsFastOnEveryRankWhenAPeerIsKilledMidOperation") {
  Group g("collective_kill", 3);
  auto shm = MustCreate(*g.store, g.env);
  at::Tensor out = at::empty({1000});
  REQUIRE(shm->ReduceScatterAsync(at::ones({3000}), out)->wait());
  CHECK(at::equal(out, at::full({1000}, 3.0f)));
  g.store->wait({"stalled"});
  // Rank 0 (and rank 2) are inside the operation, asleep on the futex, when rank 1 dies.
  at::Tensor input = at::ones({300000});
  at::Tensor shard = at::empty({100000});
  auto work = shm->ReduceScatterAsync(input, shard);
  std::this_thread::sleep_for(milliseconds(100));
  CHECK_FALSE(work->isCompleted());
  const auto killed = Clock::now();
  ::kill(g.peers[0], SIGKILL);
  // Each survivor sees the death itself ("exited") or the other survivor's abort ("gave up").
  std::string error;
  try {
    work->wait();
  } catch (const c10::Error& e) {
    error = e.what();
  }
  CHECK(Clock::now() - killed < std::chrono::seconds(2));  // the timeout is 60 s
  CHECK_MESSAGE((error.find("PeerLost") != std::string::npos &&
                 (error.find("rank 1 (pid") != std::string::npos ||
                  error.find("gave up") != std::string::npos)),
                error);
  const std::vector<uint8_t> rank2 = g.store->get("rank2");
  const std::string rank2_error(rank2.begin(), rank2.end());
  CHECK_MESSAGE(rank2_error.find("PeerLost") != std::string::npos, rank2_error);
  const int status = WaitChild(g.peers[1], milliseconds(60000));
  CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  g.peers.pop_back();
  // The transport stays failed: the next all-gather fails at once with the first error.
  CHECK(shm->AllGatherNow(at::ones({4}), at::empty({12})).code() == Status::Code::kPeerLost);
  CHECK_THROWS_WITH_AS(shm->AllGatherAsync(at::ones({4}), at::empty({12}))->wait(),
                       doctest::Contains("PeerLost"), c10::Error);
}

TEST_CASE("FlatReduceScatterAndAllGatherGiveTheSameResultsOverSharedMemoryAndGloo") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    Group g("flat" + std::to_string(world), world);
    RunFlatCollectives(MustCreate(*g.store, g.env), g.store, g.env);
    g.ExpectPeersSucceed();
  }
}

TEST_CASE("FlatReduceScatterOverGlooRethrowsWhenAPeerIsKilled") {
  Group g("gloo_kill", 2);
  auto pg = GlooOnly(g.store, g.env);
  at::Tensor out = at::empty({100});
  REQUIRE(pg->ReduceScatterFlat(at::ones({200}), out)->wait());
  CHECK(at::equal(out, at::full({100}, 2.0f)));
  g.store->wait({"stalled"});
  auto work = pg->ReduceScatterFlat(at::ones({200}), out);
  std::this_thread::sleep_for(milliseconds(100));
  CHECK_FALSE(work->isCompleted());
  const auto killed = Clock::now();
  ::kill(g.peers[0], SIGKILL);
  // Gloo's error reaches the chained future instead of the copy running: wait() rethrows.
  CHECK_THROWS_WITH_AS(work->wait(), doctest::Contains("gloo/transport"), c10::Error);
  CHECK_FALSE(work->isSuccess());
  CHECK(Clock::now() - killed < std::chrono::seconds(10));  // the timeout is 60 s
  CHECK(pg->reduce_scatter_count() == 2);
}

TEST_CASE("HierarchicalAllReduceSumsPerHostThenAcrossLeadersBitIdenticalOnEveryRank") {
  // Five ranks posing as hosts A A A B B: each host's three or two ranks sum in shared memory,
  // the two leaders through Gloo; then A B A C: a host of one rank, three leaders.
  for (const char* scenario : {"hier", "hier_mixed"}) {
    CAPTURE(scenario);
    const int fds_before = CountShmFds();
    {
      Group g(scenario, static_cast<int>(PosedHosts(scenario).size()));
      RunHierarchical(g.store, g.env);
      g.ExpectPeersSucceed();
    }
    CHECK(CountShmFds() == fds_before);
  }
}

TEST_CASE("HierarchicalAllReduceIsOffOnOneHostOrOneRankPerHostOrWhenARankDisablesShm") {
  auto none = [](std::vector<std::string> hosts) {
    auto setup = HierarchicalAllReduce::Create(c10::intrusive_ptr<c10d::Store>(), 0, hosts,
                                               LeaderGroupFactory(), {});
    REQUIRE(setup.ok());
    CHECK(setup->hierarchical == nullptr);
    return setup->reason;
  };
  CHECK(none({"A", "A", "A"}) == "every rank on one host");
  CHECK(none({"A", "B", "C"}) == "one rank per host");
  CHECK(none({"A", "A", "B", "off"}) == "LAUNCH_SHM_ALLREDUCE=0 on rank 3");
}

}  // namespace
}  // namespace launch::trainer
