#pragma once

// Where the survivors of a lost rank and its replacement meet (launch --recover in_place; the
// protocol as a whole is the Accelerator's, accelerator.h "In-place recovery").
//
// The job's store holds one key, kGenerationKey: the newest generation a replacement announced
// (LAUNCH_RECOVER_GENERATION, which the agent counts from 1). A replacement announces itself
// before it forms its group; survivors wait for a generation newer than the one they run; then
// all of them form the group WorldGroupName(generation), whose store keys (Gloo's, the
// shared-memory segment's) are that generation's own, so nothing of the broken group's
// collides with them. When rank 0 was the one lost, the store went with it: its replacement
// hosts a new one at the same address, which the survivors reach with a new client.
//
// Internal to trainer_runtime (includes LibTorch).

#include <chrono>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/status.h"

namespace launch::trainer {

inline constexpr const char* kGenerationKey = "launch_recover/generation";

// The job's group of generation `generation`: "world" (the first workers') or "world.g<N>".
std::string WorldGroupName(int generation);

// A replacement's announcement that generation `generation` forms now. IoError when the store
// fails.
Status AnnounceGeneration(c10d::Store& store, int generation);

// Waits until the store's generation is above `after` and returns it, asking the store about
// every 2 ms. Interrupted as soon as `stop()` says so (checked between asks: a SIGTERM while
// waiting); Timeout after `timeout` ("no replacement joined within ..."); IoError when the
// store fails.
StatusOr<int> WaitForGeneration(c10d::Store& store, int after, std::chrono::milliseconds timeout,
                                const std::function<bool()>& stop);

}  // namespace launch::trainer
