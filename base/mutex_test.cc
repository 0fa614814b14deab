#include "base/mutex.h"

#include <doctest/doctest.h>

#include <thread>

namespace launch {
namespace {

TEST_CASE("CondVarWakesAWaiterAndTimesOut") {
  Mutex mu;
  CondVar cv(&mu);
  bool ready = false;  // guarded by mu
  std::thread t([&] {
    MutexLock lock(&mu);
    ready = true;
    cv.NotifyAll();
  });
  {
    MutexLock lock(&mu);
    while (!ready) cv.Wait();
    CHECK(ready);
  }
  t.join();
  MutexLock lock(&mu);
  const auto start = std::chrono::steady_clock::now();
  CHECK_FALSE(cv.WaitUntil(start + std::chrono::milliseconds(20), [] { return false; }));
  CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(20));
  lock.Unlock();  // let go in between, and take it again
  lock.Lock();
}

}  // namespace
}  // namespace launch
