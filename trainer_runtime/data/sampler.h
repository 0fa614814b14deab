#pragma once

// PyTorch's DistributedSampler, index for index (the header is plain C++; sampler.cc uses
// LibTorch's generator): every epoch the training indices are shuffled by
// torch.randperm(n, generator seeded with seed + epoch), identical on every rank (no shuffle:
// file order); the list is padded by wrapping around to a multiple of the world size, and
// rank r takes positions r, r + W, r + 2W, ... Each rank then cuts its share into
// full batches (the last partial batch is dropped), so every rank runs the same number of
// batches per epoch (even batches) and DDP never waits on a rank that ran out of data.
//
// Consequence used by the numerics tests: global batch k of world W with per-rank batch B
// holds exactly the shuffled positions [k*W*B, (k+1)*W*B), the same samples a single process
// sees in its batch k with batch size W*B.

#include <cstdint>
#include <vector>

namespace launch::trainer {

class ShardedSampler {
 public:
  // REQUIRES: num_samples >= 1, 0 <= rank < world_size, batch_size >= 1.
  ShardedSampler(int64_t num_samples, int rank, int world_size, int64_t batch_size, uint64_t seed,
                 bool shuffle = true);

  // Full batches per epoch on every rank (may be 0 when the data is too small).
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t samples_per_rank() const { return per_rank_; }

  // Indices (into 0..num_samples) of this rank's batch `batch` of epoch `epoch`.
  // REQUIRES: batch < batches_per_epoch(). Caches the last epoch's permutation.
  std::vector<int64_t> Batch(int64_t epoch, int64_t batch);

  // The epoch's shuffled order: torch.randperm(n) drawn from a CPU generator seeded with
  // seed + epoch, as DistributedSampler(seed=seed) after set_epoch(epoch).
  static std::vector<int64_t> Permutation(int64_t n, uint64_t seed, int64_t epoch);

 private:
  int64_t num_samples_;
  int rank_;
  int world_size_;
  int64_t batch_size_;
  uint64_t seed_;
  bool shuffle_;
  int64_t per_rank_;
  int64_t batches_per_epoch_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_perm_;
};

}  // namespace launch::trainer
