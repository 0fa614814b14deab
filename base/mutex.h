#pragma once

// A mutex, a scoped lock and a condition variable that clang's -Wthread-safety understands
// (base/thread_annotations.h), as leveldb's port::Mutex / MutexLock / CondVar. Thin wrappers
// over std::mutex and std::condition_variable: no cost beyond them.

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "base/thread_annotations.h"

namespace launch {

class CAPABILITY("mutex") Mutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // Takes the mutex if no one holds it; returns whether it did.
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Tag for MutexLock's constructor that takes over a mutex the caller already holds.
struct AdoptLock {};

// Holds `mu` for its scope; Unlock()/Lock() let go of it in between (around a blocking call).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  // Takes over `mu`, locked by the caller (after a successful TryLock()), and releases it at the
  // end of the scope. REQUIRES: `mu` is held.
  MutexLock(Mutex* mu, AdoptLock) REQUIRES(mu) : mu_(mu) {}
  ~MutexLock() RELEASE() {
    if (held_) mu_->Unlock();
  }
  void Unlock() RELEASE() {
    held_ = false;
    mu_->Unlock();
  }
  void Lock() ACQUIRE() {
    mu_->Lock();
    held_ = true;
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* mu_;
  bool held_ = true;
};

// Waits release `mu` while blocked and hold it again when they return.
// REQUIRES: `mu` is held by the caller of Wait/WaitUntil (not annotated, as leveldb's CondVar:
// the analysis cannot tie the constructor's `mu` to the caller's lock).
class CondVar {
 public:
  explicit CondVar(Mutex* mu) : mu_(mu) {}
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Until `done()` holds (checked with `mu` held) or `deadline` passes; returns done().
  template <typename Pred>
  bool WaitUntil(std::chrono::steady_clock::time_point deadline, Pred done) {
    std::unique_lock<std::mutex> lock(mu_->mu_, std::adopt_lock);
    bool ok = cv_.wait_until(lock, deadline, done);
    lock.release();
    return ok;
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  Mutex* const mu_;
  std::condition_variable cv_;
};

}  // namespace launch
