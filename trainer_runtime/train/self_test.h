#pragma once

// `train --self_test`: the worker side of `launch test`, a short distributed self-check that
// proves this machine (or cluster) can train: process group, all-reduce (small and 4 MB),
// broadcast, all-gather, barrier, and one DDP step whose parameters must equal a
// single-process step on the whole batch. The all-reduces and broadcasts run both through the
// job's own routing (shared memory on one host: comm/process_group.h) and through Gloo itself;
// each check names the transport it ran on. Prints one line per check on rank 0; LibTorch-free
// header.

#include "base/status.h"

namespace launch::trainer {

struct SelfTestOptions {
  double init_timeout_s = 60;
};

// Runs every check in order and stops at the first failure, returning a Status that names the
// check and the values seen ("all-reduce: rank 1 got 2, expected 3"). OK when all passed.
Status RunSelfTest(const SelfTestOptions& options);

}  // namespace launch::trainer
