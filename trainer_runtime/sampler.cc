#include "trainer_runtime/sampler.h"

#include <random>

#include "base/check.h"

namespace launch::trainer {

ShardedSampler::ShardedSampler(int64_t num_samples, int rank, int world_size, int64_t batch_size,
                               uint64_t seed)
    : num_samples_(num_samples),
      rank_(rank),
      world_size_(world_size),
      batch_size_(batch_size),
      seed_(seed) {
  LAUNCH_CHECK(num_samples >= 1 && rank >= 0 && rank < world_size && batch_size >= 1,
               "bad sampler arguments");
  per_rank_ = (num_samples + world_size - 1) / world_size;
  batches_per_epoch_ = per_rank_ / batch_size;
}

std::vector<int64_t> ShardedSampler::Permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[static_cast<size_t>(i)] = i;
  // std::mt19937_64 and our own Fisher-Yates (std::shuffle's algorithm is unspecified), so the
  // order is the same with every standard library: reproducible bit for bit.
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(epoch) + 1);
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
  }
  return perm;
}

std::vector<int64_t> ShardedSampler::Batch(int64_t epoch, int64_t batch) {
  LAUNCH_CHECK(batch >= 0 && batch < batches_per_epoch_, "batch index out of range");
  if (epoch != cached_epoch_) {
    cached_perm_ = Permutation(num_samples_, seed_, epoch);
    cached_epoch_ = epoch;
  }
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(batch_size_));
  for (int64_t j = 0; j < batch_size_; ++j) {
    const int64_t i = batch * batch_size_ + j;                     // position in this rank's share
    const int64_t pos = (rank_ + world_size_ * i) % num_samples_;  // wrap-around padding
    out.push_back(cached_perm_[static_cast<size_t>(pos)]);
  }
  return out;
}

}  // namespace launch::trainer
