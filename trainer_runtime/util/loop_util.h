#pragma once

// Plain-C++ pieces of the training loops that trainer.cc, accelerator.cc and pipeline_engine.cc
// share: number formatting for logs, the resume log lines, metrics.jsonl history and
// the lost-peer test. Torch stays out so this is a cheap translation unit.
#include <chrono>
#include <cstdint>
#include <string>

namespace launch::trainer {

// A steady-clock duration in seconds.
double Seconds(std::chrono::steady_clock::duration d);

// `v` with exactly `digits` digits after the point (std::fixed), for human-readable logs.
std::string Fixed(double v, int digits);

// The log line for a checkpoint at `path` whose `step` already reached the end of training:
// the run starts afresh instead of silently doing nothing.
std::string FinishedRunMessage(const std::string& path, int64_t step);

// The warning logged when a checkpoint from before checkpoints recorded the global sample
// position, written by `written_by` processes, is resumed by `world_size`: the caller restarts
// the data order at the next epoch (newer checkpoints continue where they stopped).
std::string WorldSizeChangedWarning(int64_t written_by, int world_size);

// " (restart N)" after a restart (`restart_count` > 0), "" otherwise; ends the "resumed" line.
std::string RestartSuffix(int restart_count);

// The lines of the metrics.jsonl at `path` whose "step" is at most `step`, each ending in a
// newline: the history a run resuming at `step` keeps (redone steps are dropped). "" when `step`
// is 0 or the file cannot be read.
std::string MetricsHistoryUpTo(const std::string& path, int64_t step);

// Whether a collective's error text `what` means a peer went away (Gloo reports a dead peer as a
// closed connection or a timeout).
bool IsLostPeerError(const std::string& what);

}  // namespace launch::trainer
