#pragma once

// What the shared-memory transports (shm_allreduce.h, shm_p2p.h) share: futex waits on words in
// memory mapped by several processes, liveness of a peer process, the c10d store as a string
// map, and the Work they return. Internal to trainer_runtime (includes LibTorch).

#include <atomic>
#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "base/status.h"

namespace launch::trainer::shm {

constexpr size_t kCacheLine = 64;
// Spins before sleeping in the kernel: about a microsecond or two of polling, enough to catch
// a peer that is just arriving without burning a core that the other rank's compute needs.
constexpr int kSpins = 256;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared atomics must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared atomics must be lock-free");

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

// FUTEX_WAIT / FUTEX_WAKE on a word shared between processes (not FUTEX_PRIVATE_FLAG). The
// wait returns when woken, when *word != expected, on a signal, or after `timeout`.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

// A pidfd for `pid` (close-on-exec), or -1 where pidfd_open is unavailable.
int PidfdOpen(int pid);
// Whether `pid` has exited: polls `pidfd` when it is >= 0, else kill(pid, 0) and /proc/<pid>/stat
// (a zombie counts as exited: kill(pid, 0) still succeeds on one).
bool PidExited(int pid, int pidfd);

// The memfd_create'd segment of `bytes`, sealed against resizing and allocated up front (an
// out-of-memory shows here, not as a SIGBUS later), mapped shared. Returns the fd (close-on-exec)
// or -1 with `error` set; *base is the mapping.
int CreateSegment(const char* name, size_t bytes, void** base, std::string* error);
// Opens and maps another process's segment through /proc/<pid>/fd/<fd> (the fd is closed again:
// the mapping keeps the memory). Returns the mapping, or nullptr with `error` set.
void* OpenSegment(int pid, int fd, size_t bytes, std::string* error);

std::string StoreGet(c10d::Store& store, const std::string& key);
void StoreSet(c10d::Store& store, const std::string& key, const std::string& value);

// The Work the transports return: completion and errors come from the future, and unlike
// c10d's FutureWrappingWork, wait() rethrows the error (callers such as AllReduceFlat only
// wait()). No timeout of its own: the operations fail within the group's timeout.
class FutureWork : public c10d::Work {
 public:
  FutureWork(c10::intrusive_ptr<c10::ivalue::Future> future, c10d::OpType type)
      : c10d::Work(-1, type), future_(std::move(future)) {}
  bool isCompleted() override { return future_->completed(); }
  bool isSuccess() const override { return future_->completed() && !future_->hasError(); }
  std::exception_ptr exception() const override { return future_->exception_ptr(); }
  std::vector<at::Tensor> result() override { return future_->value().toTensorVector(); }
  bool wait(std::chrono::milliseconds) override {
    future_->wait();
    if (future_->hasError()) std::rethrow_exception(future_->exception_ptr());
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 protected:
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// A future of a tensor list, as c10d's Work futures are.
c10::intrusive_ptr<c10::ivalue::Future> TensorListFuture();
// Completes `future` with [tensor] when `status` is OK, else with a c10::Error carrying it.
void Complete(c10::ivalue::Future& future, const Status& status, const at::Tensor& tensor);

}  // namespace launch::trainer::shm
