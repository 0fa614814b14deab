#pragma once

// The trainer: runs the `train:` section of a job file on this worker. Rank, world size and
// the store address come from the environment (torchrun's contract, see env.h), so the same
// binary runs under `launch`, torchrun, srun and mpirun.
//
// This header is LibTorch-free on purpose: main.cc and any other module may include it.

#include <string>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

// What a run does beyond its configuration (train.output_dir, max_steps and every other key
// come from config::TrainConfig, resolved once: config/train_cli.h).
struct TrainerOptions {
  // Also write <output_dir>/params_rank<R>.bin: every parameter as raw little-endian float32,
  // concatenated in parameter order (the numerics tests compare these between runs).
  bool dump_params = false;
  // How long to wait for all ranks to join the process group (env LAUNCH_INIT_TIMEOUT_S, read
  // by Accelerator::Create, overrides it).
  double init_timeout_s = 300;
};

// Trains to completion. Returns InvalidConfig (exit 2: nothing was trained) for settings the
// trainer rejects before starting, Timeout when the process group did not form, PeerLost when
// another rank died mid-run, IoError for checkpoint/output failures, Internal for LibTorch
// errors (with the phase and step in the message).
// REQUIRES: train.present.
Status RunTrainer(const config::TrainConfig& train, const TrainerOptions& options);

// What `train --version` prints after its own version: the LibTorch it was built with and the
// collectives it can use ("LibTorch 2.6.0, Gloo, NCCL no").
std::string BuildDescription();
// The LibTorch library file this process loaded ("" when the loader cannot say): the second line
// of `train --version`, "LibTorch library: PATH", which `launch env` reports.
std::string LibTorchLibrary();

}  // namespace launch::trainer
