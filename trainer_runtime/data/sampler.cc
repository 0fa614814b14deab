#include "trainer_runtime/data/sampler.h"

#include <algorithm>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "base/check.h"

namespace launch::trainer {

ShardedSampler::ShardedSampler(int64_t num_samples, int rank, int world_size, int64_t batch_size,
                               uint64_t seed, bool shuffle)
    : num_samples_(num_samples),
      rank_(rank),
      world_size_(world_size),
      batch_size_(batch_size),
      seed_(seed),
      shuffle_(shuffle) {
  LAUNCH_CHECK(num_samples >= 1 && rank >= 0 && rank < world_size && batch_size >= 1,
               "bad sampler arguments");
  per_rank_ = (num_samples + world_size - 1) / world_size;
  batches_per_epoch_ = per_rank_ / batch_size;
}

std::vector<int64_t> ShardedSampler::Permutation(int64_t n, uint64_t seed, int64_t epoch) {
  // LibTorch's randperm is the same ATen code as Python's, so a PyTorch job that shuffles with
  // DistributedSampler(seed=seed) visits the samples in exactly this order.
  at::Generator gen = at::detail::createCPUGenerator(seed + static_cast<uint64_t>(epoch));
  torch::Tensor perm = torch::randperm(n, gen, torch::kLong);
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + n);
}

int64_t ShardedSampler::BatchesFrom(int64_t num_samples, int64_t global_batch,
                                    int64_t batches_per_epoch, int64_t start) {
  if (start <= 0) return batches_per_epoch;
  if (start >= num_samples) return 0;
  // No padding after a takeover: only positions not yet trained on this epoch, whole global
  // batches only (every rank runs the same number of batches).
  return (num_samples - start) / global_batch;
}

std::vector<int64_t> ShardedSampler::Batch(int64_t epoch, int64_t batch, int64_t start,
                                           std::vector<int64_t>* positions) {
  LAUNCH_CHECK(batch >= 0 && batch < BatchesFrom(start), "batch index out of range");
  if (epoch != cached_epoch_) {
    if (shuffle_) {
      cached_perm_ = Permutation(num_samples_, seed_, epoch);
    } else {
      cached_perm_.resize(static_cast<size_t>(num_samples_));
      for (int64_t i = 0; i < num_samples_; ++i) cached_perm_[static_cast<size_t>(i)] = i;
    }
    cached_epoch_ = epoch;
  }
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(batch_size_));
  for (int64_t j = 0; j < batch_size_; ++j) {
    const int64_t i = batch * batch_size_ + j;  // position in this rank's share
    // Wrap-around padding; only an epoch that starts at 0 can reach past N (BatchesFrom).
    const int64_t pos = (start + rank_ + world_size_ * i) % num_samples_;
    out.push_back(cached_perm_[static_cast<size_t>(pos)]);
    if (positions) positions->push_back(pos);
  }
  return out;
}

IndexRange SplitBetween(int64_t n, int rank, int world_size) {
  LAUNCH_CHECK(n >= 0 && rank >= 0 && rank < world_size, "SplitBetween: bad arguments");
  const int64_t base = n / world_size, extra = n % world_size;
  IndexRange range;
  range.begin = rank * base + std::min<int64_t>(rank, extra);
  range.end = range.begin + base + (rank < extra ? 1 : 0);
  return range;
}

EvalSampler::EvalSampler(int64_t num_samples, int rank, int world_size, int64_t batch_size)
    : num_samples_(num_samples), rank_(rank), world_size_(world_size), batch_size_(batch_size) {
  LAUNCH_CHECK(num_samples >= 0 && rank >= 0 && rank < world_size && batch_size >= 1,
               "EvalSampler: bad arguments");
  const int64_t global = batch_size_ * world_size_;
  num_batches_ = (num_samples_ + global - 1) / global;
}

int64_t EvalSampler::samples_on_rank() const {
  return num_samples_ > rank_ ? (num_samples_ - rank_ + world_size_ - 1) / world_size_ : 0;
}

std::vector<int64_t> EvalSampler::Batch(int64_t batch) const {
  LAUNCH_CHECK(batch >= 0 && batch < num_batches_, "EvalSampler: batch index out of range");
  const int64_t first = batch * batch_size_ * world_size_;
  const int64_t last = std::min(first + batch_size_ * world_size_, num_samples_);
  std::vector<int64_t> indices;
  for (int64_t i = first + rank_; i < last; i += world_size_) indices.push_back(i);
  return indices;
}

}  // namespace launch::trainer
