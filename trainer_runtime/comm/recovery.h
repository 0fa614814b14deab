#pragma once

// Where the survivors of a lost rank and its replacement meet (launch --recover in_place; the
// protocol as a whole is the Accelerator's, accelerator.h "In-place recovery").
//
// The job's store holds kGenerationKey: the newest generation a replacement announced
// (LAUNCH_RECOVER_GENERATION, which the agent counts from 1; the key only ever grows). Survivors
// wait for a generation newer than the one they run, a replacement for its own; then each rank
// counts itself in at the newest generation and waits there until the whole world has arrived,
// before any of them forms the group WorldGroupName(generation). Two ranks lost at once get two
// replacements of two generations: the first generation never fills up (the second replacement
// goes to its own), the key moves on, and everyone meets in the second. The group's store keys
// (Gloo's, the shared-memory segment's) are that generation's own, so nothing of the broken
// group's collides with them. When rank 0 was the one lost, the store went with it: its
// replacement hosts a new one at the same address, which the survivors reach with a new client.
//
// Internal to trainer_runtime (includes LibTorch).

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/status.h"

namespace launch::trainer {

inline constexpr const char* kGenerationKey = "launch_recover/generation";

// The job's group of generation `generation`: "world" (the first workers') or "world.g<N>".
std::string WorldGroupName(int generation);
// Any group's name in `generation`: `base` ("world", "data1", "stage0") in generation 0, then
// "<base>.g<generation>".
std::string GroupNameIn(const std::string& base, int generation);

// A replacement's announcement that generation `generation` forms now: the store's generation
// becomes it unless it is newer already. IoError when the store fails.
Status AnnounceGeneration(c10d::Store& store, int generation);

// The newest generation announced in the store, 0 while none was. Never blocks on a missing
// key. IoError when the key holds no number; the store's own failures throw.
StatusOr<int64_t> AnnouncedGeneration(c10d::Store& store);

// When a loss was first noticed, for recovery times measured from it rather than from each
// rank's own (later) detection.
struct LossNotice {
  std::chrono::system_clock::time_point at;
  std::string by;  // "rank 2", "the agent of rank 1"
};
// Records that `by` noticed, at `at`, the loss of a rank of the group of generation
// `generation`; the store keeps the earliest notice per generation. IoError when the store
// fails.
Status NoteLoss(c10d::Store& store, int generation, const LossNotice& notice);
// The earliest notice of a loss in the group of generation `generation`; nullopt when none was
// recorded. Never blocks.
std::optional<LossNotice> FirstNoticedLoss(c10d::Store& store, int generation);

// Waits until the store's generation is at least `at_least`, then meets the others in the
// newest one as above and returns it once all `world_size` ranks counted themselves in there.
// Asks the store about every 2 ms; interrupted as soon as `stop()` says so (a SIGTERM while
// waiting); Timeout after `timeout` ("no replacement joined within ..." while none announced,
// else naming how many arrived); IoError when the store fails.
StatusOr<int> JoinGeneration(c10d::Store& store, int at_least, int world_size,
                             std::chrono::milliseconds timeout, const std::function<bool()>& stop);

}  // namespace launch::trainer
