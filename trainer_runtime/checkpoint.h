#pragma once

// Training checkpoints: model parameters and buffers, optimizer state, the step count (the LR
// schedule is a pure function of it), the data-loader position and the torch RNG state, in
// one LibTorch archive written atomically (atomic_file.h): a kill mid-write leaves the last
// good checkpoint intact.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <string>

#include <torch/torch.h>

#include "base/status.h"
#include "trainer_runtime/model.h"

namespace launch::trainer {

struct TrainState {
  int64_t step = 0;            // optimizer steps done
  int64_t epoch = 0;           // data-loader position of the next micro-batch ...
  int64_t batch_in_epoch = 0;  // ... (epoch, batch within the epoch)
  int64_t samples_seen = 0;    // per rank
  int64_t world_size = 1;      // the world that wrote it (data positions depend on it)
};

// Rank 0 calls this; other ranks never write. Returns IoError with the path on failure.
Status SaveCheckpoint(const std::string& path, Model& model, torch::optim::Optimizer& optimizer,
                      const TrainState& state);

// Reads only the TrainState (to decide whether to resume).
StatusOr<TrainState> PeekCheckpoint(const std::string& path);

// Restores model, optimizer and the global torch RNG from `path`. The model must have the same
// parameter names and shapes as the one saved (InvalidConfig naming the first mismatch).
StatusOr<TrainState> LoadCheckpoint(const std::string& path, Model& model,
                                    torch::optim::Optimizer& optimizer);

}  // namespace launch::trainer
