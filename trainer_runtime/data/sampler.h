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
//
// A resume at another world size (an epoch "taken over" at global position `start` > 0): the
// permutation does not depend on W, so the old world's checkpoint at its batch k has consumed
// positions [0, k*W*B) of the epoch. The new world W' deals the rest [start, N) as the sampler
// deals: rank r takes start + r, start + r + W', ..., cut into full batches of B; the part of
// the rest that does not fill a whole global batch of W'*B (fewer than W'*B positions, the
// epoch's last) is dropped and there is no wrap-around padding (which would repeat samples the
// old world already trained on). So:
//   - an epoch that no resume cut at another world size (start == 0) is exactly PyTorch's:
//     every sample exactly once when W*B divides N (otherwise the last partial global batch is
//     dropped, or the padding repeats the epoch's first positions, as DistributedSampler does);
//   - an epoch resharded mid-way sees every sample at most once: positions [0, start) by the
//     old world(s), [start, start + b*W'*B) by the new one, b = BatchesFrom(start), and the
//     (N - start) mod (W'*B) last positions not at all.
// Later epochs start at 0 again. A resume at the same world size that wrote the checkpoint keeps
// the epoch's own `start` and batch index, so it continues bit-identically.

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
  int64_t num_samples() const { return num_samples_; }

  // Full batches on every rank of an epoch taken over at global position `start` (see the top
  // of this file): batches_per_epoch() when start is 0, else (N - start) / (W * B), 0 when
  // start >= N.
  int64_t BatchesFrom(int64_t start) const {
    return BatchesFrom(num_samples_, world_size_ * batch_size_, batches_per_epoch_, start);
  }
  // The same for any world: `global_batch` = W * B, `batches_per_epoch` that world's.
  static int64_t BatchesFrom(int64_t num_samples, int64_t global_batch, int64_t batches_per_epoch,
                             int64_t start);

  // Indices (into 0..num_samples) of this rank's batch `batch` of epoch `epoch`, counted from
  // global position `start` (0: the epoch's beginning); with `positions`, also their places
  // in the epoch's permutation. REQUIRES: batch < BatchesFrom(start). Caches the last epoch's
  // permutation.
  std::vector<int64_t> Batch(int64_t epoch, int64_t batch, int64_t start = 0,
                             std::vector<int64_t>* positions = nullptr);

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

// accelerate's split_between_processes: rank `rank` of `world_size` takes [begin, end) of
// 0..n, consecutive, in rank order; the first n % world_size ranks take one more.
// REQUIRES: n >= 0, 0 <= rank < world_size.
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
IndexRange SplitBetween(int64_t n, int rank, int world_size);

// The evaluation loader's order (accelerate's even_batches=False, in data set order): every
// sample exactly once, no padding, no dropping, no shuffle. Rank r takes the samples r, r + W,
// r + 2W, ... Global batch k is the samples [k*W*B, min((k+1)*W*B, N)), and rank r's batch k
// is its samples inside it, so every rank has the same number of batches, ceil(N / (W*B)), and
// so meets every collective its peers make per batch; the last batch may be partial, and
// smaller on the higher ranks (empty on a rank when fewer than W samples are left).
// Rank r's row j of batch k is sample k*W*B + r + j*W: interleaving the ranks' rows (row 0 of
// every rank in rank order, then row 1, ...) gives the global batch in data set order.
class EvalSampler {
 public:
  // REQUIRES: num_samples >= 0, 0 <= rank < world_size, batch_size >= 1.
  EvalSampler(int64_t num_samples, int rank, int world_size, int64_t batch_size);
  int64_t num_batches() const { return num_batches_; }
  int64_t num_samples() const { return num_samples_; }
  // This rank's samples, in all batches together.
  int64_t samples_on_rank() const;
  // Indices of this rank's batch `batch`, ascending. REQUIRES: 0 <= batch < num_batches().
  std::vector<int64_t> Batch(int64_t batch) const;

 private:
  int64_t num_samples_;
  int rank_;
  int world_size_;
  int64_t batch_size_;
  int64_t num_batches_;
};

}  // namespace launch::trainer
