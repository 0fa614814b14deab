#pragma once

// Batches fetched ahead on worker threads, handed out in the order they were asked for: what
// LibTorch's DataLoaderOptions::workers(n) does for its own loader, for the Accelerator's
// (data_loader.h). The caller decides which batches come next (the sampler's order) and
// submits their indices; `workers` threads call `fetch` on them concurrently, and Take returns
// them in submission order, so the batches are the same as without workers.
//
// Thread-safety: Submit, Take and Clear are called by one thread (the training loop); `fetch`
// runs on the worker threads, several at a time, so it must be safe to call concurrently (as
// LibTorch's loader requires of a dataset's get/get_batch). An exception thrown by `fetch` is
// kept and rethrown by the Take that asks for that batch, on the caller's thread.
// Lifecycle: the destructor drops what was not taken, lets each worker finish the batch it is
// fetching, and joins them (no thread outlives the prefetcher).

#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "base/mutex.h"
#include "base/thread_annotations.h"

namespace launch::trainer {

class BatchPrefetcher {
 public:
  using Fetch = std::function<torch::data::Example<>(const std::vector<size_t>& indices)>;
  // REQUIRES: workers >= 1, capacity >= 1.
  BatchPrefetcher(Fetch fetch, int workers, int capacity);
  ~BatchPrefetcher();
  BatchPrefetcher(const BatchPrefetcher&) = delete;
  BatchPrefetcher& operator=(const BatchPrefetcher&) = delete;

  // Batches submitted and not yet taken (fetched or not), at most capacity().
  int64_t pending() const;
  int capacity() const { return capacity_; }
  // Queues the batch of `indices`. REQUIRES: pending() < capacity().
  void Submit(std::vector<size_t> indices);
  // The oldest batch not taken yet, waiting until a worker fetched it.
  // REQUIRES: pending() > 0.
  torch::data::Example<> Take();
  // Forgets every batch not taken (the caller's order changed): queued ones are not fetched,
  // ones being fetched are dropped when done.
  void Clear();

 private:
  struct Result {
    torch::data::Example<> batch;
    std::exception_ptr error;
  };
  void Work();

  const Fetch fetch_;
  const int capacity_;
  mutable Mutex mu_;
  CondVar work_cv_{&mu_};  // a job was queued, or stop
  CondVar done_cv_{&mu_};  // a result arrived
  bool stop_ GUARDED_BY(mu_) = false;
  int64_t next_submit_ GUARDED_BY(mu_) = 0;  // sequence number of the next Submit
  int64_t next_take_ GUARDED_BY(mu_) = 0;    // sequence number Take returns next
  std::deque<std::pair<int64_t, std::vector<size_t>>> jobs_ GUARDED_BY(mu_);
  std::map<int64_t, Result> results_ GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace launch::trainer
