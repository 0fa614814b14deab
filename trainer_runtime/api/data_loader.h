#pragma once

// The Accelerator's data loaders over a user's torch::data dataset (any Dataset<Self, Example<>>,
// whose examples are stacked, or a BatchDataset whose get_batch returns an Example<>):
//
//   DistributedDataLoader (PrepareDataLoader)  training: PyTorch's DistributedSampler order,
//       the same number of full batches on every rank, a cursor saved with the state;
//   EvalDataLoader (PrepareEvalLoader)         evaluation: every sample exactly once, in data
//       set order, no padding and no dropping (accelerate's even_batches=False), to be
//       combined with Accelerator::GatherForMetrics.
//
// Each loader has its own position. Exactly one loader is the accelerator's training loader:
// the first one PrepareDataLoader makes (or, once that one and all its copies are destroyed,
// the next one, which continues at its position), until the loop's first Accumulate() shows
// otherwise: when the batch served last before it came from another loader (a validation
// loader prepared first), that loader becomes the training loader, as if prepared first (with
// a LoadState before it, whose position went to the first loader: a CHECK failure naming the
// order, since the batch already served came from the wrong place). Only the training loader
// closes accumulation
// windows at its epoch's end (sync_with_dataloader), sets Accelerator::epoch(), counts
// samples_seen, is recorded by SaveState and restored by LoadState. Any other loader (an
// evaluation or a second training set made with PrepareDataLoader) starts at its epoch 0 and
// changes nothing in the accelerator.
//
// Thread-safety: none; a loader is used by the thread that runs the training loop.

#include <cstdint>
#include <deque>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "base/check.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/prefetcher.h"
#include "trainer_runtime/data/sampler.h"

namespace launch::trainer {
namespace loader_internal {

template <typename D>
constexpr bool kReturnsExample = std::is_same_v<typename D::BatchType, torch::data::Example<>>;

// `indices` of `dataset` as one Example (stacked when the data set yields single examples).
// Zero indices give zero rows shaped like the data set's (REQUIRES: the data set is not empty).
template <typename DatasetT>
torch::data::Example<> Fetch(DatasetT& dataset, const std::vector<size_t>& indices) {
  if (indices.empty()) {
    torch::data::Example<> one = Fetch(dataset, std::vector<size_t>{0});
    return {one.data.slice(0, 0, 0), one.target.slice(0, 0, 0)};
  }
  if constexpr (kReturnsExample<DatasetT>) {
    return dataset.get_batch(indices);
  } else {
    return torch::data::transforms::Stack<>().apply_batch(dataset.get_batch(indices));
  }
}

}  // namespace loader_internal

// A data loader over this rank's shard (Accelerator::PrepareDataLoader). Batches are taken on
// the calling thread, in sampler order; `Epoch(e)` iterates epoch e from the restored position
// (or its start), `Next()` runs on across epochs. Copies share one position (and workers).
template <typename DatasetT>
class DistributedDataLoader {
 public:
  DistributedDataLoader(Accelerator* accel, DatasetT dataset, int64_t batch_size)
      : accel_(accel),
        dataset_(std::make_shared<DatasetT>(std::move(dataset))),
        batch_size_(batch_size),
        sampler_(static_cast<int64_t>(dataset_->size().value()), accel->data_parallel_rank(),
                 accel->data_parallel_size(), batch_size, accel->options().seed,
                 accel->options().data.shuffle),
        cursor_(std::make_shared<LoaderCursor>()) {
    cursor_->batches_per_epoch = sampler_.batches_per_epoch();
    cursor_->batches_this_epoch = cursor_->batches_per_epoch;
    cursor_->num_samples = sampler_.num_samples();
    cursor_->global_batch = batch_size * accel->data_parallel_size();
    accel_->AttachCursor(cursor_);
  }

  // Full batches per epoch on this rank (0 when the shard is smaller than one batch); an epoch
  // taken over by a resume at another world size has cursor().batches_this_epoch.
  int64_t batches_per_epoch() const { return cursor_->batches_per_epoch; }
  int64_t batch_size() const { return batch_size_; }
  const DatasetT& dataset() const { return *dataset_; }
  const LoaderCursor& cursor() const { return *cursor_; }

  // LibTorch's DataLoaderOptions::workers: `n` threads fetch the next batches ahead (up to
  // 2n batches, in the sampler's order) while the loop trains on this one; Next() returns the
  // same batches as without workers, in the same order. The data set's get / get_batch is
  // then called from those threads concurrently (as LibTorch's loader calls it). 0: batches
  // are fetched by Next() on the calling thread (the default). Destroying the loader (its
  // last copy) mid-epoch drops what was fetched ahead and joins the threads. Returns *this.
  // REQUIRES: n >= 0.
  DistributedDataLoader& workers(int n) {
    LAUNCH_CHECK(n >= 0, "DistributedDataLoader::workers: n must be >= 0");
    prefetch_.reset();
    if (n == 0) return *this;
    prefetch_ = std::make_shared<Prefetch>();
    std::shared_ptr<DatasetT> dataset = dataset_;  // the threads' own reference
    prefetch_->fetcher = std::make_unique<BatchPrefetcher>(
        [dataset](const std::vector<size_t>& indices) {
          return loader_internal::Fetch(*dataset, indices);
        },
        n, 2 * n);
    return *this;
  }
  // Whether this is the accelerator's training loader (see the top of this file).
  bool is_training_loader() const { return accel_->IsTrainingCursor(cursor_); }

  // The next batch, moving to the next epoch after the last one.
  // REQUIRES: batches_per_epoch() > 0.
  torch::data::Example<> Next() {
    const bool trace = is_training_loader() && accel_->tracing();
    std::vector<int64_t> places;
    std::vector<int64_t> positions =
        sampler_.Batch(cursor_->epoch, cursor_->batch, cursor_->start, trace ? &places : nullptr);
    if (trace) accel_->TraceBatch(cursor_->epoch, places, positions);
    std::vector<size_t> indices(positions.begin(), positions.end());
    torch::data::Example<> batch =
        prefetch_ ? TakePrefetched() : loader_internal::Fetch(*dataset_, indices);
    Advance(*cursor_);
    accel_->Served(cursor_, static_cast<int64_t>(indices.size()));
    return accel_->ToDevice(std::move(batch));
  }

  // Range over the rest of epoch `e` (all of it unless the loader was restored into it).
  class EpochRange {
   public:
    class Iterator {
     public:
      Iterator(DistributedDataLoader* loader, int64_t left) : loader_(loader), left_(left) {}
      torch::data::Example<>& operator*() { return current_; }
      Iterator& operator++() {
        --left_;
        return *this;
      }
      bool operator!=(const Iterator& other) const {
        if (left_ == other.left_) return false;
        current_ = loader_->Next();  // fetched when the loop asks whether to go on
        return true;
      }

     private:
      DistributedDataLoader* loader_;
      int64_t left_;
      mutable torch::data::Example<> current_;  // filled by operator!= (range-for asks it first)
    };
    EpochRange(DistributedDataLoader* loader, int64_t left) : loader_(loader), left_(left) {}
    Iterator begin() { return Iterator(loader_, left_); }
    Iterator end() { return Iterator(loader_, 0); }

   private:
    DistributedDataLoader* loader_;
    int64_t left_;
  };
  EpochRange Epoch(int64_t e) {
    if (cursor_->epoch != e) cursor_->StartEpoch(e);
    return EpochRange(this, cursor_->batches_this_epoch - cursor_->batch);
  }

 private:
  // Where a cursor goes after serving a batch.
  static void Advance(LoaderCursor& c) {
    c.last_was_end = ++c.batch == c.batches_this_epoch;
    if (c.last_was_end) c.StartEpoch(c.epoch + 1);
  }
  struct Position {
    int64_t epoch, batch, start;
    bool operator==(const Position& o) const {
      return epoch == o.epoch && batch == o.batch && start == o.start;
    }
  };
  static Position At(const LoaderCursor& c) { return {c.epoch, c.batch, c.start}; }
  // Batches fetched ahead: `ahead` holds the positions submitted to `fetcher`, in order, and
  // `look` the position after the last of them.
  struct Prefetch {
    std::unique_ptr<BatchPrefetcher> fetcher;
    std::deque<Position> ahead;
    LoaderCursor look;
  };
  // The batch at the cursor from the workers. The cursor moves only through Next() unless
  // Epoch(e) jumps or LoadState restores a position: then what was fetched ahead is dropped.
  torch::data::Example<> TakePrefetched() {
    Prefetch& p = *prefetch_;
    if (p.ahead.empty() || !(p.ahead.front() == At(*cursor_))) {
      p.fetcher->Clear();
      p.ahead.clear();
      p.look = *cursor_;
    }
    Refill();
    torch::data::Example<> batch = p.fetcher->Take();
    p.ahead.pop_front();
    Refill();
    return batch;
  }
  void Refill() {
    Prefetch& p = *prefetch_;
    while (p.fetcher->pending() < p.fetcher->capacity()) {
      std::vector<int64_t> positions = sampler_.Batch(p.look.epoch, p.look.batch, p.look.start);
      p.fetcher->Submit(std::vector<size_t>(positions.begin(), positions.end()));
      p.ahead.push_back(At(p.look));
      Advance(p.look);
    }
  }

  Accelerator* accel_;
  std::shared_ptr<DatasetT> dataset_;  // shared with the workers' fetch
  int64_t batch_size_;
  ShardedSampler sampler_;
  std::shared_ptr<LoaderCursor> cursor_;
  std::shared_ptr<Prefetch> prefetch_;  // workers(n > 0)
};

// An evaluation loader (Accelerator::PrepareEvalLoader): this rank's samples r, r + W, ... in
// data set order, batch_size per batch, every rank the same number of batches (EvalSampler in
// sampler.h: the last batch partial, possibly empty on the higher ranks). Every sample of the
// data set is on exactly one rank once per pass; Accelerator::GatherForMetrics puts the ranks'
// rows of a batch back in data set order. Each `for (auto& batch : loader)` is a full pass from
// the first batch. No state is saved with the accelerator's.
template <typename DatasetT>
class EvalDataLoader {
 public:
  EvalDataLoader(Accelerator* accel, DatasetT dataset, int64_t batch_size)
      : accel_(accel),
        dataset_(std::move(dataset)),
        sampler_(static_cast<int64_t>(dataset_.size().value()), accel->rank(), accel->world_size(),
                 batch_size),
        batch_size_(batch_size) {}

  // Batches per pass, equal on every rank.
  int64_t num_batches() const { return sampler_.num_batches(); }
  int64_t batch_size() const { return batch_size_; }
  // The whole data set's size and this rank's part of it.
  int64_t num_samples() const { return sampler_.num_samples(); }
  int64_t samples_on_rank() const { return sampler_.samples_on_rank(); }
  const DatasetT& dataset() const { return dataset_; }

  // This rank's batch `k`, on the accelerator's device. REQUIRES: 0 <= k < num_batches().
  torch::data::Example<> Batch(int64_t k) {
    const std::vector<int64_t> rows = sampler_.Batch(k);
    return accel_->ToDevice(
        loader_internal::Fetch(dataset_, std::vector<size_t>(rows.begin(), rows.end())));
  }

  class Iterator {
   public:
    Iterator(EvalDataLoader* loader, int64_t k) : loader_(loader), k_(k) {}
    torch::data::Example<>& operator*() {
      if (!fetched_) current_ = loader_->Batch(k_);
      fetched_ = true;
      return current_;
    }
    Iterator& operator++() {
      ++k_;
      fetched_ = false;
      return *this;
    }
    bool operator!=(const Iterator& other) const { return k_ != other.k_; }

   private:
    EvalDataLoader* loader_;
    int64_t k_;
    bool fetched_ = false;
    torch::data::Example<> current_;
  };
  Iterator begin() { return Iterator(this, 0); }
  Iterator end() { return Iterator(this, num_batches()); }

 private:
  Accelerator* accel_;
  DatasetT dataset_;
  EvalSampler sampler_;
  int64_t batch_size_;
};

template <typename DatasetT>
DistributedDataLoader<DatasetT> Accelerator::PrepareDataLoader(DatasetT dataset,
                                                               int64_t batch_size) {
  return DistributedDataLoader<DatasetT>(this, std::move(dataset), batch_size);
}

template <typename DatasetT>
EvalDataLoader<DatasetT> Accelerator::PrepareEvalLoader(DatasetT dataset, int64_t batch_size) {
  LAUNCH_CHECK(!options_.parallel.pipelined(),
               "PrepareEvalLoader: not in pipeline mode (evaluate with PipelineForward)");
  LAUNCH_CHECK(batch_size >= 1, "PrepareEvalLoader: batch_size must be >= 1");
  return EvalDataLoader<DatasetT>(this, std::move(dataset), batch_size);
}

}  // namespace launch::trainer
