#pragma once

// LoaderCursor: where the Accelerator's training loader (data_loader.h) stands, the part of
// the saved state that says which batch comes next, at any world size. A value type.

#include <cstdint>

namespace launch::trainer {

// Position of a data loader: the next batch it yields. Part of the saved state. The global
// sample position of the next batch (all data-parallel ranks together) is
// start + batch * global_batch; a checkpoint stores it, so a resume at another world size
// continues from there (sampler.h).
struct LoaderCursor {
  int64_t epoch = 0;
  int64_t batch = 0;              // next batch within the epoch, counted from `start`
  int64_t batches_per_epoch = 0;  // per rank (ShardedSampler: the last partial batch is dropped)
  int64_t start = 0;              // global position of batch 0 of `epoch`: 0, or where a resume
                                  // at another world size took the epoch over
  int64_t batches_this_epoch =
      0;                      // per rank, of `epoch` from `start` (ShardedSampler::BatchesFrom)
  int64_t num_samples = 0;    // the data set's size
  int64_t global_batch = 0;   // data-parallel ranks x batch size
  bool last_was_end = false;  // the batch served last was the epoch's last

  // Samples of `epoch` consumed by all ranks together: the next batch's global position.
  int64_t offset() const { return start + batch * global_batch; }
  // Moves to epoch `e`'s beginning.
  void StartEpoch(int64_t e) {
    epoch = e;
    batch = 0;
    start = 0;
    batches_this_epoch = batches_per_epoch;
  }
};

}  // namespace launch::trainer
