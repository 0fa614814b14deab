#include "trainer_runtime/data/prefetcher.h"

#include <utility>

#include "base/check.h"

namespace launch::trainer {

BatchPrefetcher::BatchPrefetcher(Fetch fetch, int workers, int capacity)
    : fetch_(std::move(fetch)), capacity_(capacity) {
  LAUNCH_CHECK(workers >= 1 && capacity >= 1, "BatchPrefetcher: workers and capacity >= 1");
  for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Work(); });
}

BatchPrefetcher::~BatchPrefetcher() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
    jobs_.clear();
  }
  work_cv_.NotifyAll();
  for (std::thread& t : threads_) t.join();
}

int64_t BatchPrefetcher::pending() const {
  MutexLock lock(&mu_);
  return next_submit_ - next_take_;
}

void BatchPrefetcher::Submit(std::vector<size_t> indices) {
  {
    MutexLock lock(&mu_);
    LAUNCH_CHECK(next_submit_ - next_take_ < capacity_, "BatchPrefetcher: queue full");
    jobs_.emplace_back(next_submit_++, std::move(indices));
  }
  work_cv_.NotifyOne();
}

torch::data::Example<> BatchPrefetcher::Take() {
  MutexLock lock(&mu_);
  LAUNCH_CHECK(next_take_ < next_submit_, "BatchPrefetcher: nothing submitted");
  while (results_.count(next_take_) == 0) done_cv_.Wait();
  auto it = results_.find(next_take_++);
  Result result = std::move(it->second);
  results_.erase(it);
  lock.Unlock();
  if (result.error) std::rethrow_exception(result.error);
  return std::move(result.batch);
}

void BatchPrefetcher::Clear() {
  MutexLock lock(&mu_);
  jobs_.clear();
  results_.clear();
  next_take_ = next_submit_;  // results of jobs still being fetched fall below it: dropped
}

void BatchPrefetcher::Work() {
  MutexLock lock(&mu_);
  while (true) {
    while (!stop_ && jobs_.empty()) work_cv_.Wait();
    if (stop_) return;
    auto [seq, indices] = std::move(jobs_.front());
    jobs_.pop_front();
    lock.Unlock();
    Result result;
    try {
      result.batch = fetch_(indices);
    } catch (...) {
      result.error = std::current_exception();  // no exception escapes a thread: Take rethrows
    }
    lock.Lock();
    if (seq >= next_take_) results_.emplace(seq, std::move(result));
    done_cv_.NotifyAll();
  }
}

}  // namespace launch::trainer
