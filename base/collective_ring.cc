#include "base/collective_ring.h"

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace launch {

namespace {

constexpr uint64_t kMagic = 0x474e495248434e4cull;  // the bytes "LNCHRING", little-endian
constexpr uint32_t kVersion = 1;

}  // namespace

// Shared with other processes: only fixed-width atomics (lock-free, address-free).
struct CollectiveRing::Layout {
  struct Group {
    std::atomic<uint64_t> last_seq;
    char name[kRingGroupName];
  };
  struct Slot {
    std::atomic<uint64_t> stamp;  // 0 while written, index + 1 once complete
    std::atomic<uint32_t> op;
    std::atomic<int32_t> group;
    std::atomic<uint64_t> seq;
    std::atomic<int64_t> bytes;
    std::atomic<uint64_t> enqueued_ns;
    std::atomic<uint64_t> done_ns;
    std::atomic<uint32_t> state;
  };
  std::atomic<uint64_t> magic;  // written last at creation
  std::atomic<uint32_t> version;
  std::atomic<uint32_t> capacity;
  std::atomic<int32_t> pid;
  std::atomic<int32_t> rank;
  std::atomic<uint64_t> issued;
  std::atomic<uint64_t> completed;
  std::atomic<uint64_t> last_done_ns;
  std::atomic<uint64_t> created_ns;
  std::atomic<uint32_t> group_count;
  Group groups[kRingGroups];
  Slot slots[kRingCapacity];
};

static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "the ring needs lock-free 64-bit atomics");

// Group names are written once, under a mutex, before group_count counts them.
struct CollectiveRing::GroupTable {
  std::mutex mu;
};

std::string CollectiveOpName(uint32_t op) {
  switch (static_cast<CollectiveOp>(op)) {
    case CollectiveOp::kAllReduce:
      return "all-reduce";
    case CollectiveOp::kBroadcast:
      return "broadcast";
    case CollectiveOp::kAllGather:
      return "all-gather";
    case CollectiveOp::kReduceScatter:
      return "reduce-scatter";
    case CollectiveOp::kBarrier:
      return "barrier";
    case CollectiveOp::kReduce:
      return "reduce";
    case CollectiveOp::kGather:
      return "gather";
    case CollectiveOp::kScatter:
      return "scatter";
    case CollectiveOp::kAllToAll:
      return "all-to-all";
  }
  return "op " + std::to_string(op);
}

std::string CollectiveStateName(uint32_t state) {
  switch (static_cast<CollectiveState>(state)) {
    case CollectiveState::kEnqueued:
      return "enqueued";
    case CollectiveState::kStarted:
      return "started";
    case CollectiveState::kDone:
      return "done";
    case CollectiveState::kFailed:
      return "failed";
  }
  return "state " + std::to_string(state);
}

uint64_t MonotonicNanos() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

CollectiveRing::CollectiveRing(std::string path, Layout* layout)
    : path_(std::move(path)), layout_(layout), groups_(std::make_unique<GroupTable>()) {}

CollectiveRing::~CollectiveRing() { ::munmap(layout_, sizeof(Layout)); }

StatusOr<std::unique_ptr<CollectiveRing>> CollectiveRing::Create(const std::string& path,
                                                                 int rank) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return Status::IoError("collective ring " + path + ": " + std::strerror(errno));
  if (::ftruncate(fd, sizeof(Layout)) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IoError("collective ring " + path + ": ftruncate: " + std::strerror(err));
  }
  void* p = ::mmap(nullptr, sizeof(Layout), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    return Status::IoError("collective ring " + path + ": mmap: " + std::strerror(err));
  // A fresh file is zero: every atomic starts at 0, which is a valid object representation.
  auto* layout = static_cast<Layout*>(p);
  layout->version.store(kVersion, std::memory_order_relaxed);
  layout->capacity.store(kRingCapacity, std::memory_order_relaxed);
  layout->pid.store(::getpid(), std::memory_order_relaxed);
  layout->rank.store(rank, std::memory_order_relaxed);
  layout->created_ns.store(MonotonicNanos(), std::memory_order_relaxed);
  layout->magic.store(kMagic, std::memory_order_release);
  return std::unique_ptr<CollectiveRing>(new CollectiveRing(path, layout));
}

CollectiveRing* CollectiveRing::ForProcess(int rank) {
  static CollectiveRing* const ring = [rank]() -> CollectiveRing* {
    const char* path = std::getenv(kCollectiveRingEnv);
    if (path == nullptr || *path == '\0') return nullptr;
    StatusOr<std::unique_ptr<CollectiveRing>> made = Create(path, rank);
    if (!made.ok()) {
      std::fprintf(stderr, "warning: no collective ring (hang reports will lack this rank): %s\n",
                   made.status().message().c_str());
      return nullptr;
    }
    InstallStackDump(StackPathFor(path));
    return made->release();  // lives as long as the process: completions may come from any thread
  }();
  return ring;
}

int CollectiveRing::Group(std::string_view name) {
  std::lock_guard<std::mutex> lock(groups_->mu);
  const uint32_t n = layout_->group_count.load(std::memory_order_relaxed);
  for (uint32_t i = 0; i < n; ++i)
    if (name == layout_->groups[i].name) return static_cast<int>(i);
  if (n == kRingGroups) return -1;
  const size_t len = std::min<size_t>(name.size(), kRingGroupName - 1);
  std::memcpy(layout_->groups[n].name, name.data(), len);
  layout_->groups[n].name[len] = '\0';
  layout_->group_count.store(n + 1, std::memory_order_release);
  return static_cast<int>(n);
}

uint64_t CollectiveRing::Begin(int group, CollectiveOp op, int64_t bytes, CollectiveState state) {
  if (group < 0 || group >= static_cast<int>(kRingGroups)) return 0;
  const uint64_t seq = layout_->groups[group].last_seq.fetch_add(1, std::memory_order_relaxed) + 1;
  const uint64_t index = layout_->issued.fetch_add(1, std::memory_order_relaxed);
  Layout::Slot& s = layout_->slots[index % kRingCapacity];
  s.stamp.store(0, std::memory_order_relaxed);
  // The fields below must not become visible before the 0 above (a reader would take a mix of
  // two operations for one).
  std::atomic_thread_fence(std::memory_order_release);
  s.op.store(static_cast<uint32_t>(op), std::memory_order_relaxed);
  s.group.store(group, std::memory_order_relaxed);
  s.seq.store(seq, std::memory_order_relaxed);
  s.bytes.store(bytes, std::memory_order_relaxed);
  s.enqueued_ns.store(MonotonicNanos(), std::memory_order_relaxed);
  s.done_ns.store(0, std::memory_order_relaxed);
  s.state.store(static_cast<uint32_t>(state), std::memory_order_relaxed);
  s.stamp.store(index + 1, std::memory_order_release);
  return index + 1;
}

void CollectiveRing::Done(uint64_t token, bool ok) {
  if (token == 0) return;
  const uint64_t now = MonotonicNanos();
  Layout::Slot& s = layout_->slots[(token - 1) % kRingCapacity];
  // Reused by an operation kRingCapacity later: that one's record is not ours to change.
  if (s.stamp.load(std::memory_order_acquire) == token) {
    s.done_ns.store(now, std::memory_order_relaxed);
    s.state.store(static_cast<uint32_t>(ok ? CollectiveState::kDone : CollectiveState::kFailed),
                  std::memory_order_release);
  }
  layout_->completed.fetch_add(1, std::memory_order_relaxed);
  layout_->last_done_ns.store(now, std::memory_order_release);
}

StatusOr<RingSnapshot> ReadCollectiveRing(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno == ENOENT) return Status::NotFound("no collective ring " + path);
    return Status::IoError("collective ring " + path + ": " + std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(CollectiveRing::Layout))) {
    ::close(fd);
    // Created, not yet sized: as good as absent.
    return Status::NotFound("collective ring " + path + " is not ready");
  }
  void* p = ::mmap(nullptr, sizeof(CollectiveRing::Layout), PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    return Status::IoError("collective ring " + path + ": mmap: " + std::strerror(err));
  const auto* l = static_cast<const CollectiveRing::Layout*>(p);
  RingSnapshot snap;
  Status status = Status::Ok();
  if (l->magic.load(std::memory_order_acquire) != kMagic) {
    status = Status::NotFound("collective ring " + path + " is not ready");
  } else if (l->version.load(std::memory_order_relaxed) != kVersion ||
             l->capacity.load(std::memory_order_relaxed) != kRingCapacity) {
    status = Status::InvalidArgument("collective ring " + path + ": version " +
                                     std::to_string(l->version.load()) + ", expected " +
                                     std::to_string(kVersion));
  } else {
    snap.pid = l->pid.load(std::memory_order_relaxed);
    snap.rank = l->rank.load(std::memory_order_relaxed);
    snap.created_ns = l->created_ns.load(std::memory_order_relaxed);
    snap.last_done_ns = l->last_done_ns.load(std::memory_order_acquire);
    snap.completed = l->completed.load(std::memory_order_relaxed);
    snap.issued = l->issued.load(std::memory_order_acquire);
    const uint32_t groups = std::min(l->group_count.load(std::memory_order_acquire), kRingGroups);
    for (uint32_t g = 0; g < groups; ++g) {
      const char* name = l->groups[g].name;
      snap.groups.emplace_back(name, strnlen(name, kRingGroupName));
      snap.last_seq.push_back(l->groups[g].last_seq.load(std::memory_order_relaxed));
    }
    const uint64_t first = snap.issued > kRingCapacity ? snap.issued - kRingCapacity : 0;
    for (uint64_t i = first; i < snap.issued; ++i) {
      const auto& s = l->slots[i % kRingCapacity];
      for (int attempt = 0; attempt < 8; ++attempt) {
        const uint64_t before = s.stamp.load(std::memory_order_acquire);
        if (before != i + 1) break;  // being written, or already reused: left out
        RingEntry e;
        e.index = i;
        e.op = s.op.load(std::memory_order_relaxed);
        e.group = s.group.load(std::memory_order_relaxed);
        e.seq = s.seq.load(std::memory_order_relaxed);
        e.bytes = s.bytes.load(std::memory_order_relaxed);
        e.enqueued_ns = s.enqueued_ns.load(std::memory_order_relaxed);
        e.state = s.state.load(std::memory_order_acquire);
        e.done_ns = s.done_ns.load(std::memory_order_relaxed);
        std::atomic_thread_fence(std::memory_order_acquire);
        if (s.stamp.load(std::memory_order_relaxed) != before) continue;
        snap.entries.push_back(e);
        break;
      }
    }
  }
  ::munmap(p, sizeof(CollectiveRing::Layout));
  if (!status.ok()) return status;
  return snap;
}

// --- Stack dumps -----------------------------------------------------------------------------

namespace {

// The handler's only state: where to write. Set once, before the handler is installed.
char g_stack_path[4096];

void WriteAll(int fd, const char* text, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, text, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    text += w;
    n -= static_cast<size_t>(w);
  }
}

// Digits of `v` into `out` (async-signal-safe), returns the length.
size_t FormatUnsigned(unsigned long v, char* out) {
  char tmp[24];
  size_t n = 0;
  do {
    tmp[n++] = static_cast<char>('0' + v % 10);
    v /= 10;
  } while (v != 0);
  for (size_t i = 0; i < n; ++i) out[i] = tmp[n - 1 - i];
  return n;
}

void OnStackDump(int signo) {
  const int saved = errno;
  const pid_t pid = ::getpid();
  const pid_t tid = static_cast<pid_t>(::syscall(SYS_gettid));
  if (tid != pid) {
    // The agent wants the main thread (the training loop), not a transport thread.
    ::syscall(SYS_tgkill, pid, pid, signo);
    errno = saved;
    return;
  }
  const int fd = ::open(g_stack_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd >= 0) {
    char line[64] = "pid ";
    size_t n = 4 + FormatUnsigned(static_cast<unsigned long>(pid), line + 4);
    const char tail[] = " main thread:\n";
    std::memcpy(line + n, tail, sizeof tail - 1);
    n += sizeof tail - 1;
    WriteAll(fd, line, n);
    // Frame 0 is this handler, frame 1 the kernel's return trampoline.
    void* frames[kStackDumpFrames + 2];
    const int count = ::backtrace(frames, kStackDumpFrames + 2);
    if (count > 2) ::backtrace_symbols_fd(frames + 2, count - 2, fd);
    WriteAll(fd, "end\n", 4);
    ::close(fd);
  }
  errno = saved;
}

}  // namespace

int StackDumpSignal() { return SIGRTMIN + 6; }

bool DeclareInPlaceRecovery() {
  const char* path = std::getenv(kCollectiveRingEnv);
  if (path == nullptr || *path == '\0') return false;
  const int fd = ::open(InPlacePathFor(path).c_str(),
                        O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

void InstallStackDump(const std::string& path) {
  if (path.size() >= sizeof g_stack_path) return;
  std::memcpy(g_stack_path, path.c_str(), path.size() + 1);
  // backtrace() loads libgcc on its first call (malloc, dlopen): never first inside a handler.
  void* warm[2];
  (void)::backtrace(warm, 2);
  struct sigaction sa {};
  sa.sa_handler = OnStackDump;
  sa.sa_flags = SA_RESTART;  // the interrupted wait goes on afterwards
  sigemptyset(&sa.sa_mask);
  ::sigaction(StackDumpSignal(), &sa, nullptr);
}

}  // namespace launch
