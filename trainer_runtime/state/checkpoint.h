#pragma once

// Checkpoint files (LibTorch archives, each written atomically and streamed to its file as it is
// serialised: base/files.h AtomicFileWriter; read back from the file, not from a copy in memory).
// A checkpoint is a folder of them, committed as a whole by Accelerator::SaveState (accelerator.h):
// model files with parameters, buffers and optimizer state, and one file per rank with the loop
// position and that rank's RNG state.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "base/status.h"
#include "trainer_runtime/model/model.h"

namespace launch::trainer {

struct TrainState {
  int64_t step = 0;            // optimizer steps done
  int64_t epoch = 0;           // data-loader position of the next micro-batch ...
  int64_t batch_in_epoch = 0;  // ... (epoch, batch within the epoch, counted from epoch_start)
  int64_t samples_seen = 0;    // per rank
  int64_t world_size = 1;      // the world that wrote it (data positions depend on it)
  // Written since checkpoints survive a change of world size (sampler.h); a checkpoint from
  // before has data_world 0, and a resume at another world size then skips to the next epoch.
  int64_t data_world = 0;           // data-parallel ranks that wrote it (world_size but pipeline)
  int64_t epoch_start = 0;          // global position of the epoch's batch 0 (0 unless taken over)
  int64_t epoch_offset = 0;         // global samples of `epoch` consumed: the next batch's position
  int64_t samples_seen_global = 0;  // samples taken by all data-parallel ranks, all runs
  int64_t origin_data_world = 0;    // data-parallel world the run started with (0: data_world)
  // A program's LR-schedule anchor (Accelerator::ScheduleAnchor): step -1 = none.
  int64_t anchor_step = -1;
  double anchor_position = 0;
  double anchor_slope = 1;
};

// The model file of a checkpoint: parameters ("param/<name>"), buffers ("buffer/<name>") and
// the optimizer's state. Written by one rank per distinct model state (Accelerator::SaveState
// decides which). IoError with the path on failure.
Status SaveModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer);
// Restores what SaveModelState wrote. The model must have the same parameter names and shapes
// (InvalidConfig naming the first mismatch).
Status LoadModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer);

// An optimizer's state alone (a ZeRO rank's shard), with `layout`: a tensor describing how the
// state was cut (parallel/zero.cc), which LoadOptimizerState requires to be equal. IoError
// naming the path; InvalidConfig when the layout differs (naming both).
Status SaveOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout);
Status LoadOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout);

// The per-rank file: the loop position and this process's CPU generator state (each rank
// draws its own dropout masks, so each restores its own). Files written before a field existed
// read back with that field's default.
Status SaveRankState(const std::string& path, const TrainState& state);
// Reads it back; restores the default CPU generator when `restore_rng`.
StatusOr<TrainState> LoadRankState(const std::string& path, bool restore_rng);

}  // namespace launch::trainer
