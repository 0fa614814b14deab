#include "trainer_runtime/comm/shm_allreduce.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>
#include <random>
#include <sstream>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "trainer_runtime/comm/shm_common.h"
#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {

namespace {

using shm::CpuRelax;
using shm::FutexWait;
using shm::FutexWakeAll;
using shm::kCacheLine;
using shm::kSpins;
using shm::RoundUp;
using shm::StoreGet;
using shm::StoreSet;

constexpr uint64_t kMagic = 0x6c61756e63687368ull;  // "launchsh"
constexpr uint32_t kVersion = 1;

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Ranks share memory only on one kernel (boot id; the hostname alone can repeat across
// machines or containers) and see each other's /proc entries only in one pid namespace.
std::string HostIdentity() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  char ns[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof(ns) - 1);
  if (n > 0) ns[n] = '\0';
  return std::string(host) + " boot " + ReadFirstLine("/proc/sys/kernel/random/boot_id") + " " + ns;
}

// A chunk descriptor: the operation in the top two bits (so a rank broadcasting while another
// reduces is an error), the chunk's byte offset (far below 2^54) and the dtype in the low byte.
constexpr int kKindShift = 62;
uint64_t Descriptor(int kind, size_t offset, c10::ScalarType dtype) {
  return (static_cast<uint64_t>(kind) << kKindShift) | (static_cast<uint64_t>(offset) << 8) |
         static_cast<uint8_t>(dtype);
}
const char* Verb(uint64_t descriptor) {
  static const char* const kVerbs[] = {"all-reduces", "broadcasts", "reduce-scatters",
                                       "all-gathers"};
  return kVerbs[descriptor >> kKindShift];
}

bool DenseCpu(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.layout() == c10::kStrided && t.is_contiguous();
}
bool Summable(c10::ScalarType d) {
  return d == c10::kFloat || d == c10::kDouble || d == c10::kBFloat16 || d == c10::kHalf;
}

// Sums n elements over `in` (one pointer per rank) in rank order into `acc`. `acc` is a small
// local buffer, so the loops vectorise without aliasing concerns even though one input (this
// rank's own tensor) is also an output of SumSlice.
template <typename T>
void SumInRankOrder(T* __restrict acc, const std::vector<const T*>& in, size_t base, size_t n) {
  const T* __restrict a = in[0] + base;
  const T* __restrict b = in[1] + base;
  for (size_t i = 0; i < n; ++i) acc[i] = a[i] + b[i];
  for (size_t r = 2; r < in.size(); ++r) {
    const T* __restrict c = in[r] + base;
    for (size_t i = 0; i < n; ++i) acc[i] = acc[i] + c[i];
  }
}

// bfloat16 and float16 as LibTorch (and Gloo, for float16) add them: in float, rounded to
// nearest even after each addition.
template <typename Half>
void SumHalvesInRankOrder(Half* __restrict acc, const std::vector<const Half*>& in, size_t base,
                          size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float sum = static_cast<float>(in[0][base + i]);
    for (size_t r = 1; r < in.size(); ++r)
      sum = static_cast<float>(Half(sum + static_cast<float>(in[r][base + i])));
    acc[i] = Half(sum);
  }
}
void SumInRankOrder(c10::BFloat16* __restrict acc, const std::vector<const c10::BFloat16*>& in,
                    size_t base, size_t n) {
  SumHalvesInRankOrder(acc, in, base, n);
}
void SumInRankOrder(c10::Half* __restrict acc, const std::vector<const c10::Half*>& in, size_t base,
                    size_t n) {
  SumHalvesInRankOrder(acc, in, base, n);
}

// Sums elements [lo, lo + n) over `inputs` in rank order and stores the result both in the
// shared result region and in this rank's tensor: one pass over the slice instead of a sum
// followed by a copy (the all-reduce is memory-bound). `shared` may be null (reduce-scatter).
template <typename T>
void SumSlice(const std::vector<const char*>& inputs, size_t lo, size_t n, char* shared,
              char* local) {
  constexpr size_t kBlock = 8192 / sizeof(T);  // fits in L1 with the inputs streaming by
  T acc[kBlock];
  std::vector<const T*> in;
  for (const char* p : inputs) in.push_back(reinterpret_cast<const T*>(p));
  T* out_shared = reinterpret_cast<T*>(shared);
  T* out_local = reinterpret_cast<T*>(local);
  for (size_t base = lo; base < lo + n; base += kBlock) {
    const size_t m = std::min(kBlock, lo + n - base);
    SumInRankOrder(acc, in, base, m);
    if (out_shared) std::memcpy(out_shared + base, acc, m * sizeof(T));
    std::memcpy(out_local + base, acc, m * sizeof(T));
  }
}

void SumSliceOf(c10::ScalarType dtype, const std::vector<const char*>& inputs, size_t lo, size_t n,
                char* shared, char* local) {
  switch (dtype) {
    case c10::kFloat:
      SumSlice<float>(inputs, lo, n, shared, local);
      break;
    case c10::kDouble:
      SumSlice<double>(inputs, lo, n, shared, local);
      break;
    case c10::kHalf:
      SumSlice<c10::Half>(inputs, lo, n, shared, local);
      break;
    default:
      SumSlice<c10::BFloat16>(inputs, lo, n, shared, local);
      break;
  }
}

}  // namespace

// The segment: Header, then one RankState per rank, then (page-aligned) W input slots and the
// result region, each chunk_bytes. All shared fields are lock-free atomics (address-free, so
// they work across processes); rank 0 constructs them on the zero-filled memfd.
struct ShmAllReduce::Header {
  uint64_t magic;
  uint64_t token;  // random, published with the fd: the right segment was opened
  uint32_t version;
  uint32_t world;
  uint64_t chunk_bytes;
  uint64_t size;
  // The futex word: bumped by every arrival and abort; waiters sleep on it.
  alignas(kCacheLine) std::atomic<uint32_t> wake_seq;
  std::atomic<uint32_t> waiters;    // ranks in (or about to enter) FUTEX_WAIT; 0: skip the wake
  std::atomic<int32_t> aborted_by;  // rank + 1 of the first rank that gave up; 0: none
};

struct alignas(kCacheLine) ShmAllReduce::RankState {
  std::atomic<uint64_t> phase;  // phases passed; written only by its rank
  // The current chunk's descriptor, checked by every rank once all arrived at phase A.
  std::atomic<uint64_t> total_bytes;
  std::atomic<uint64_t> descriptor;  // Descriptor(): operation, offset, dtype
  std::atomic<int32_t> pid;
};

size_t ShmAllReduce::DataOffset(int world) {
  return RoundUp(sizeof(Header) + world * sizeof(RankState), 4096);
}

ShmAllReduce::Header* ShmAllReduce::header() const { return static_cast<Header*>(base_); }
ShmAllReduce::RankState* ShmAllReduce::state(int r) const {
  return reinterpret_cast<RankState*>(static_cast<char*>(base_) + sizeof(Header)) + r;
}
char* ShmAllReduce::slot(int r) const {
  return static_cast<char*>(base_) + DataOffset(world_) + r * options_.chunk_bytes;
}
char* ShmAllReduce::result() const { return slot(world_); }

bool ShmAllReduce::Supports(const std::vector<at::Tensor>& tensors,
                            const c10d::AllreduceOptions& opts) {
  if (tensors.size() != 1 || opts.reduceOp != c10d::ReduceOp::SUM) return false;
  return DenseCpu(tensors[0]) && Summable(tensors[0].scalar_type());
}

bool ShmAllReduce::SupportsReduceScatter(const at::Tensor& input, const at::Tensor& output) const {
  return DenseCpu(input) && DenseCpu(output) && Summable(input.scalar_type()) &&
         output.scalar_type() == input.scalar_type() && input.numel() == world_ * output.numel();
}

bool ShmAllReduce::SupportsAllGather(const at::Tensor& input, const at::Tensor& output) const {
  return DenseCpu(input) && DenseCpu(output) && output.scalar_type() == input.scalar_type() &&
         output.numel() == world_ * input.numel();
}

StatusOr<ShmSetup> ShmAllReduce::Create(c10d::Store& store, int rank, int world_size, bool enabled,
                                        const ShmAllReduceOptions& given) {
  ShmSetup none;
  if (world_size < 2) {
    none.reason = "a single rank";
    return none;
  }
  ShmAllReduceOptions options = given;
  options.chunk_bytes =
      std::max(kCacheLine * world_size, options.chunk_bytes / kCacheLine * kCacheLine);
  const size_t size = DataOffset(world_size) + (world_size + 1) * options.chunk_bytes;
  const std::string me = std::to_string(rank);
  void* base = MAP_FAILED;
  int memfd = -1;
  auto release = [&] {
    if (base != MAP_FAILED) ::munmap(base, size);
    base = MAP_FAILED;
    if (memfd >= 0) ::close(memfd);
    memfd = -1;
  };
  try {
    // 1. Every rank says where it runs (or that it opted out); all decide alike.
    const std::string identity =
        options.host_identity.empty() ? HostIdentity() : options.host_identity;
    StoreSet(store, "host/" + me, enabled ? identity : "off");
    std::vector<std::string> hosts(world_size);
    for (int r = 0; r < world_size; ++r) hosts[r] = StoreGet(store, "host/" + std::to_string(r));
    none.hosts = hosts;
    for (int r = 0; r < world_size; ++r) {
      if (hosts[r] == "off") {
        none.reason = "LAUNCH_SHM_ALLREDUCE=0 on rank " + std::to_string(r);
        return none;
      }
      if (hosts[r] != hosts[0]) {
        none.reason = "rank " + std::to_string(r) + " is on another host or pid namespace (" +
                      hosts[r] + " vs rank 0's " + hosts[0] + ")";
        return none;
      }
    }

    // 2. Rank 0 creates the segment and publishes "pid fd size token"; the others open it.
    std::string mine = "ok";
    uint64_t token = 0;
    if (rank == 0) {
      std::string error;
      memfd = shm::CreateSegment("launch-shm-allreduce", size, &base, &error);
      if (error.empty()) {
        token = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
        auto* h = new (base) Header();
        h->magic = kMagic;
        h->token = token;
        h->version = kVersion;
        h->world = static_cast<uint32_t>(world_size);
        h->chunk_bytes = options.chunk_bytes;
        h->size = size;
        h->wake_seq.store(0);
        h->waiters.store(0);
        h->aborted_by.store(0);
        auto* states = reinterpret_cast<RankState*>(static_cast<char*>(base) + sizeof(Header));
        for (int r = 0; r < world_size; ++r) new (&states[r]) RankState();
        std::ostringstream seg;
        seg << ::getpid() << " " << memfd << " " << size << " " << token;
        StoreSet(store, "segment", seg.str());
      } else {
        release();
        mine = "rank 0 could not create the segment: " + error;
        StoreSet(store, "segment", "error");
      }
    } else {
      const std::string seg = StoreGet(store, "segment");
      long long pid = 0, fd = -1;
      unsigned long long seg_size = 0, seg_token = 0;
      std::istringstream in(seg);
      if (seg == "error") {
        mine = "rank 0 could not create the segment";
      } else if (!(in >> pid >> fd >> seg_size >> seg_token) || seg_size != size) {
        mine = "rank " + me + " got a malformed segment record '" + seg + "'";
      } else {
        std::string error;
        base = shm::OpenSegment(static_cast<int>(pid), static_cast<int>(fd), size, &error);
        const auto* h = static_cast<const Header*>(base);
        if (!base) {
          base = MAP_FAILED;
          mine = "rank " + me + " " + error;
        } else if (h->magic != kMagic || h->token != seg_token || h->version != kVersion ||
                   h->world != static_cast<uint32_t>(world_size)) {
          mine =
              "rank " + me + ": the segment of pid " + std::to_string(pid) + " is not this group's";
        }
        if (mine != "ok") release();
      }
    }
    if (mine == "ok") {
      auto* states = reinterpret_cast<RankState*>(static_cast<char*>(base) + sizeof(Header));
      states[rank].pid.store(static_cast<int32_t>(::getpid()));
    }

    // 3. Everyone reports; all use the segment only if all mapped it.
    StoreSet(store, "joined/" + me, mine);
    std::string failure;
    for (int r = 0; r < world_size; ++r) {
      const std::string joined = StoreGet(store, "joined/" + std::to_string(r));
      if (joined != "ok" && failure.empty()) failure = joined;
    }
    // Every rank opened /proc/<pid>/fd/<n> before it reported: rank 0's fd can go.
    if (memfd >= 0) ::close(memfd);
    memfd = -1;
    if (!failure.empty()) {
      release();
      none.reason = failure;
      return none;
    }
    std::vector<int> pids(world_size);
    auto* states = reinterpret_cast<RankState*>(static_cast<char*>(base) + sizeof(Header));
    for (int r = 0; r < world_size; ++r) pids[r] = states[r].pid.load();
    ShmSetup setup;
    setup.hosts = std::move(none.hosts);
    setup.shm.reset(new ShmAllReduce(rank, world_size, options, base, size, std::move(pids)));
    return setup;
  } catch (const std::exception& e) {
    release();
    return Status::Timeout("rank " + me +
                           ": shared-memory all-reduce setup through the store: " + e.what());
  }
}

ShmAllReduce::ShmAllReduce(int rank, int world, const ShmAllReduceOptions& options, void* base,
                           size_t size, std::vector<int> pids)
    : rank_(rank),
      world_(world),
      options_(options),
      base_(base),
      size_(size),
      pids_(std::move(pids)),
      pidfds_(world, -1) {
  for (int r = 0; r < world_; ++r)
    if (r != rank_) pidfds_[r] = shm::PidfdOpen(pids_[r]);  // -1: fall back to kill() and /proc
  worker_ = std::thread([this] { WorkerLoop(); });
}

ShmAllReduce::~ShmAllReduce() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  stopping_.store(true);
  cv_.NotifyAll();
  // Wake an operation sleeping on the futex so it sees stopping_ (the peers wake spuriously).
  header()->wake_seq.fetch_add(1);
  FutexWakeAll(&header()->wake_seq);
  if (worker_.joinable()) worker_.join();
  for (Op& op : queue_) {
    op.future->setError(
        compat::ErrorPtr("shared-memory all-reduce shut down before this operation ran"));
  }
  queue_.clear();
  for (int fd : pidfds_)
    if (fd >= 0) ::close(fd);
  ::munmap(base_, size_);
}

c10::intrusive_ptr<c10d::Work> ShmAllReduce::Enqueue(Op op, c10d::OpType type) {
  auto future = shm::TensorListFuture();
  c10::intrusive_ptr<c10d::Work> work = c10::make_intrusive<shm::FutureWork>(future, type);
  op.future = future;
  {
    MutexLock lock(&mu_);
    if (stop_) {
      future->setError(compat::ErrorPtr("shared-memory all-reduce used after shut down"));
      return work;
    }
    queue_.push_back(std::move(op));
  }
  cv_.NotifyAll();
  return work;
}

c10::intrusive_ptr<c10d::Work> ShmAllReduce::AllReduceAsync(const at::Tensor& tensor) {
  return Enqueue(Op{Kind::kAllReduce, tensor, tensor, {}}, c10d::OpType::ALLREDUCE);
}

Status ShmAllReduce::AllReduceNow(const at::Tensor& tensor) {
  return RunInline(Op{Kind::kAllReduce, tensor, tensor, {}});
}

namespace {
// The REQUIRES of ReduceScatter*/AllGather*, as an error: sizes the peers may not share must
// not reach the segment (a short tensor would be read or written out of bounds).
Status BadArguments(const char* what, const at::Tensor& input, const at::Tensor& output,
                    int world) {
  std::ostringstream os;
  os << "shared-memory " << what << ": unsupported tensors (input ";
  if (input.defined()) os << input.scalar_type() << " x" << input.numel();
  os << ", output ";
  if (output.defined()) os << output.scalar_type() << " x" << output.numel();
  os << ", " << world << " ranks; both dense, contiguous, on the CPU, one dtype)";
  return Status::InvalidArgument(os.str());
}

c10::intrusive_ptr<c10d::Work> FailedWork(const Status& status, c10d::OpType type) {
  auto future = shm::TensorListFuture();
  shm::Complete(*future, status, at::Tensor());
  return c10::make_intrusive<shm::FutureWork>(future, type);
}
}  // namespace

c10::intrusive_ptr<c10d::Work> ShmAllReduce::ReduceScatterAsync(const at::Tensor& input,
                                                                const at::Tensor& output) {
  if (!SupportsReduceScatter(input, output))
    return FailedWork(BadArguments("reduce-scatter", input, output, world_),
                      c10d::OpType::REDUCE_SCATTER);
  return Enqueue(Op{Kind::kReduceScatter, input, output, {}}, c10d::OpType::REDUCE_SCATTER);
}

Status ShmAllReduce::ReduceScatterNow(const at::Tensor& input, const at::Tensor& output) {
  if (!SupportsReduceScatter(input, output))
    return BadArguments("reduce-scatter", input, output, world_);
  return RunInline(Op{Kind::kReduceScatter, input, output, {}});
}

c10::intrusive_ptr<c10d::Work> ShmAllReduce::AllGatherAsync(const at::Tensor& input,
                                                            const at::Tensor& output) {
  if (!SupportsAllGather(input, output))
    return FailedWork(BadArguments("all-gather", input, output, world_), c10d::OpType::ALLGATHER);
  return Enqueue(Op{Kind::kAllGather, input, output, {}}, c10d::OpType::ALLGATHER);
}

Status ShmAllReduce::AllGatherNow(const at::Tensor& input, const at::Tensor& output) {
  if (!SupportsAllGather(input, output)) return BadArguments("all-gather", input, output, world_);
  return RunInline(Op{Kind::kAllGather, input, output, {}});
}

Status ShmAllReduce::RunInline(const Op& op) {
  {
    MutexLock lock(&mu_);
    while (!stop_ && (!queue_.empty() || busy_)) cv_.Wait();
    if (stop_) return Status::Interrupted("shared-memory all-reduce shut down");
    busy_ = true;
  }
  Status status = Execute(op);
  {
    MutexLock lock(&mu_);
    busy_ = false;
  }
  cv_.NotifyAll();
  return status;
}

void ShmAllReduce::WorkerLoop() {
  MutexLock lock(&mu_);
  while (true) {
    while (!stop_ && (queue_.empty() || busy_)) cv_.Wait();
    if (stop_) return;
    Op op = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.Unlock();
    const Status status = Execute(op);
    lock.Lock();
    busy_ = false;
    lock.Unlock();
    cv_.NotifyAll();
    // Completing runs the future's callbacks on this thread, outside mu_ and after busy_ is
    // cleared: a callback may issue the next operation, or wait for a lock held by a thread
    // that is in AllReduceNow (which may then run as soon as this operation's data is done).
    shm::Complete(*op.future, status, op.output);
    op = Op();
    lock.Lock();
  }
}

Status ShmAllReduce::Execute(const Op& op) {
  if (!failed_.ok()) return failed_;
  const c10::ScalarType dtype = op.input.scalar_type();
  const size_t esize = op.input.element_size();
  const size_t total = static_cast<size_t>(op.input.numel()) * esize;
  const char* in = static_cast<const char*>(op.input.data_ptr());
  char* out = static_cast<char*>(op.output.data_ptr());
  Status status;
  switch (op.kind) {
    case Kind::kAllReduce:
    case Kind::kBroadcast: {
      // At least one chunk, also for 0 bytes: its agreement is what catches a peer issuing
      // another size here, which would otherwise pair this rank's next operation with it.
      size_t offset = 0;
      do {
        const size_t bytes = std::min(options_.chunk_bytes, total - offset);
        status = op.kind == Kind::kBroadcast ? BroadcastChunk(out, total, offset, bytes, dtype)
                                             : ExecuteChunk(out, total, offset, bytes, dtype);
        offset += options_.chunk_bytes;
      } while (offset < total && status.ok());
      break;
    }
    case Kind::kReduceScatter: {
      // A slot holds W - 1 pieces (one per other rank's shard) of `per` elements, each
      // starting on a cache line. chunk_bytes >= 64 * W (Create) makes per >= 64 / esize.
      const size_t shard = static_cast<size_t>(op.output.numel());
      const size_t align = kCacheLine / esize;
      const size_t per = options_.chunk_bytes / ((world_ - 1) * esize) / align * align;
      for (size_t first = 0; first < shard && status.ok(); first += per)
        status =
            ReduceScatterChunk(in, out, shard, first, std::min(per, shard - first), per, dtype);
      break;
    }
    case Kind::kAllGather:
      for (size_t offset = 0; offset < total && status.ok(); offset += options_.chunk_bytes) {
        const size_t bytes = std::min(options_.chunk_bytes, total - offset);
        status = AllGatherChunk(in, out, total, offset, bytes, dtype);
      }
      break;
  }
  if (!status.ok()) {
    failed_ = status;
    Abort();  // the peers stop waiting for us
  }
  return status;
}

Status ShmAllReduce::WaitSlotFree() {
  // Already passed unless the last operation was a reduce-scatter or an all-gather: WaitAll
  // then returns at its first look. Once every rank passed that B, every rank has also checked
  // the descriptors of the A before it, so this rank's descriptor may change too.
  return WaitAll(slot_read_by_);
}

Status ShmAllReduce::ReduceScatterChunk(const char* in, char* out, size_t shard, size_t first,
                                        size_t n, size_t per, c10::ScalarType dtype) {
  const size_t esize = c10::elementSize(dtype);
  // Piece of rank d's shard in rank q's slot: d's index among the ranks other than q.
  auto piece = [&](int d, int q) { return static_cast<size_t>(d - (d > q ? 1 : 0)) * per * esize; };
  LAUNCH_RETURN_IF_ERROR(WaitSlotFree());
  for (int d = 0; d < world_; ++d) {
    if (d == rank_) continue;
    std::memcpy(slot(rank_) + piece(d, rank_), in + (d * shard + first) * esize, n * esize);
  }
  LAUNCH_RETURN_IF_ERROR(
      AgreeOnChunk(Kind::kReduceScatter, world_ * shard * esize, first * esize, dtype));
  std::vector<const char*> inputs;
  for (int q = 0; q < world_; ++q)
    inputs.push_back(q == rank_ ? in + (rank_ * shard + first) * esize : slot(q) + piece(rank_, q));
  SumSliceOf(dtype, inputs, 0, n, /*shared=*/nullptr, out + first * esize);
  slot_read_by_ = ++phase_;
  Arrive(slot_read_by_);
  return Status::Ok();
}

Status ShmAllReduce::AllGatherChunk(const char* in, char* out, size_t total_bytes, size_t offset,
                                    size_t bytes, c10::ScalarType dtype) {
  LAUNCH_RETURN_IF_ERROR(WaitSlotFree());
  std::memcpy(slot(rank_), in + offset, bytes);
  char* mine = out + rank_ * total_bytes + offset;
  if (mine != in + offset) std::memcpy(mine, in + offset, bytes);  // unless in place
  LAUNCH_RETURN_IF_ERROR(AgreeOnChunk(Kind::kAllGather, total_bytes, offset, dtype));
  for (int q = 0; q < world_; ++q)
    if (q != rank_) std::memcpy(out + q * total_bytes + offset, slot(q), bytes);
  slot_read_by_ = ++phase_;
  Arrive(slot_read_by_);
  return Status::Ok();
}

Status ShmAllReduce::ExecuteChunk(char* data, size_t total_bytes, size_t offset, size_t bytes,
                                  c10::ScalarType dtype) {
  const size_t esize = c10::elementSize(dtype);
  char* local = data + offset;
  // This rank's slice, in elements; slice boundaries on cache lines so no two ranks write
  // the same line of the result.
  const size_t n = bytes / esize;
  const size_t align = kCacheLine / esize;
  const size_t per = RoundUp((n + world_ - 1) / world_, align);
  const size_t lo = std::min(n, rank_ * per);
  const size_t hi = std::min(n, lo + per);
  // Only the peers read this rank's input slot, and only outside this rank's slice: this rank
  // sums its own slice reading its tensor directly.
  LAUNCH_RETURN_IF_ERROR(WaitSlotFree());
  std::memcpy(slot(rank_), local, lo * esize);
  std::memcpy(slot(rank_) + hi * esize, local + hi * esize, bytes - hi * esize);
  LAUNCH_RETURN_IF_ERROR(AgreeOnChunk(Kind::kAllReduce, total_bytes, offset, dtype));
  if (hi > lo) {
    std::vector<const char*> inputs;
    for (int r = 0; r < world_; ++r) inputs.push_back(r == rank_ ? local : slot(r));
    SumSliceOf(dtype, inputs, lo, hi - lo, result(), local);
  }
  const uint64_t reduced = ++phase_;
  Arrive(reduced);
  LAUNCH_RETURN_IF_ERROR(WaitAll(reduced));
  std::memcpy(data + offset, result(), lo * esize);
  std::memcpy(data + offset + hi * esize, result() + hi * esize, bytes - hi * esize);
  return Status::Ok();
}

Status ShmAllReduce::AgreeOnChunk(Kind kind, size_t total_bytes, size_t offset,
                                  c10::ScalarType dtype) {
  const uint64_t descriptor = Descriptor(static_cast<int>(kind), offset, dtype);
  // After a reduce-scatter or all-gather a slow peer may still be checking the descriptors
  // (a broadcast writes no slot, so nothing waited yet).
  LAUNCH_RETURN_IF_ERROR(WaitSlotFree());
  RankState* mine = state(rank_);
  mine->total_bytes.store(total_bytes, std::memory_order_relaxed);
  mine->descriptor.store(descriptor, std::memory_order_relaxed);
  const uint64_t arrived = ++phase_;
  Arrive(arrived);  // publishes the slot and the descriptor
  LAUNCH_RETURN_IF_ERROR(WaitAll(arrived));
  auto describe = [](int r, uint64_t d, uint64_t t) {
    return "rank " + std::to_string(r) + " " + Verb(d) + " " + std::to_string(t) + " bytes of " +
           c10::toString(static_cast<c10::ScalarType>(d & 0xff)) + " (chunk at " +
           std::to_string((d & ((uint64_t(1) << kKindShift) - 1)) >> 8) + ")";
  };
  for (int r = 0; r < world_; ++r) {
    const uint64_t t = state(r)->total_bytes.load(std::memory_order_relaxed);
    const uint64_t d = state(r)->descriptor.load(std::memory_order_relaxed);
    if (t != total_bytes || d != descriptor)
      return Status::ProtocolError(
          "shared-memory all-reduce: ranks issued different operations: " + describe(r, d, t) +
          ", " + describe(rank_, descriptor, total_bytes));
  }
  return Status::Ok();
}

Status ShmAllReduce::BroadcastChunk(char* data, size_t total_bytes, size_t offset, size_t bytes,
                                    c10::ScalarType dtype) {
  // Everyone arrived: the previous operation's result region has been read by all.
  LAUNCH_RETURN_IF_ERROR(AgreeOnChunk(Kind::kBroadcast, total_bytes, offset, dtype));
  if (rank_ == 0) std::memcpy(result(), data + offset, bytes);
  const uint64_t written = ++phase_;
  Arrive(written);
  LAUNCH_RETURN_IF_ERROR(WaitAll(written));
  if (rank_ != 0) std::memcpy(data + offset, result(), bytes);
  return Status::Ok();
}

bool ShmAllReduce::SupportsBroadcast(const at::Tensor& t) { return DenseCpu(t); }

c10::intrusive_ptr<c10d::Work> ShmAllReduce::BroadcastFromRank0(const at::Tensor& tensor) {
  auto future = shm::TensorListFuture();
  Status status;
  {
    MutexLock lock(&mu_);
    while (!stop_ && (!queue_.empty() || busy_)) cv_.Wait();
    if (stop_) status = Status::Interrupted("shared-memory all-reduce shut down");
    busy_ = status.ok();
  }
  if (status.ok()) {
    status = Execute(Op{Kind::kBroadcast, tensor, tensor, {}});
    {
      MutexLock lock(&mu_);
      busy_ = false;
    }
    cv_.NotifyAll();
  }
  shm::Complete(*future, status, tensor);
  return c10::make_intrusive<shm::FutureWork>(future, c10d::OpType::ALLREDUCE);
}

// Lost wake-ups cannot happen: a waiter increments `waiters`, then reads `wake_seq`, then checks
// the phases; an arriver stores its phase, increments `wake_seq`, then reads `waiters` (all
// sequentially consistent). Either the arriver sees the waiter and wakes it, or the waiter's
// check already sees the new phase, or FUTEX_WAIT finds `wake_seq` changed and returns at once.
void ShmAllReduce::Arrive(uint64_t phase) {
  Header* h = header();
  state(rank_)->phase.store(phase);
  h->wake_seq.fetch_add(1);
  if (h->waiters.load() > 0) FutexWakeAll(&h->wake_seq);
}

Status ShmAllReduce::WaitAll(uint64_t phase) {
  Header* h = header();
  auto lagging = [&]() -> int {
    for (int r = 0; r < world_; ++r)
      if (state(r)->phase.load(std::memory_order_acquire) < phase) return r;
    return -1;
  };
  for (int i = 0; i < kSpins; ++i) {
    if (lagging() < 0) return Status::Ok();
    CpuRelax();
  }
  using Clock = std::chrono::steady_clock;
  const Clock::time_point deadline = Clock::now() + options_.timeout;
  while (true) {
    h->waiters.fetch_add(1);
    const uint32_t seq = h->wake_seq.load();
    if (lagging() >= 0 && h->aborted_by.load() == 0 && !stopping_.load()) {
      const auto left = deadline - Clock::now();
      const auto slice = std::min<Clock::duration>(
          options_.liveness_interval, std::max<Clock::duration>(left, Clock::duration(0)));
      FutexWait(&h->wake_seq, seq, std::chrono::duration_cast<std::chrono::nanoseconds>(slice));
    }
    h->waiters.fetch_sub(1);
    const int late = lagging();
    if (late < 0) return Status::Ok();
    if (const int by = h->aborted_by.load(); by != 0)
      return Status::PeerLost("shared-memory all-reduce: rank " + std::to_string(by - 1) +
                              " gave up on it (see that rank's error)");
    if (stopping_.load())
      return Status::Interrupted("shared-memory all-reduce shut down during an operation");
    LAUNCH_RETURN_IF_ERROR(CheckPeersAlive(phase));
    if (Clock::now() >= deadline)
      return Status::Timeout("shared-memory all-reduce: rank " + std::to_string(late) + " (pid " +
                             std::to_string(pids_[late]) + ") did not reach the operation within " +
                             std::to_string(options_.timeout.count()) + " ms (rank " +
                             std::to_string(rank_) + " waited)");
  }
}

Status ShmAllReduce::CheckPeersAlive(uint64_t phase) {
  for (int r = 0; r < world_; ++r) {
    if (r == rank_ || state(r)->phase.load(std::memory_order_acquire) >= phase) continue;
    if (shm::PidExited(pids_[r], pidfds_[r]))
      return Status::PeerLost("shared-memory all-reduce: rank " + std::to_string(r) + " (pid " +
                              std::to_string(pids_[r]) + ") exited while rank " +
                              std::to_string(rank_) + " waited for it");
  }
  return Status::Ok();
}

void ShmAllReduce::Abort() {
  Header* h = header();
  int32_t expected = 0;
  h->aborted_by.compare_exchange_strong(expected, rank_ + 1);
  h->wake_seq.fetch_add(1);
  FutexWakeAll(&h->wake_seq);
}

}  // namespace launch::trainer
