#pragma once

// Timeline: what each rank spent a few chosen optimizer steps on, in the Chrome trace-event JSON
// format that Perfetto (ui.perfetto.dev) and chrome://tracing open: data loading, forward,
// backward, the optimizer, each gradient bucket's all-reduce from launch to completion, and a
// pipeline stage's sends, receives and the time it waited for them. Answers "why is my DDP
// slow?": whether the all-reduces overlap backward, and who waits for whom.
//
// One per process (Timeline::Get()). The training loop calls BeginStep/EndStep around each
// optimizer step; spans are recorded only between the two, for the steps
// train.timeline {from_step, steps} selects, so the cost outside them is one relaxed atomic load
// per span. At the end every rank writes its events (WriteRank) and rank 0 merges the ranks'
// files into one (Merge): one process per rank, every rank on one time axis (microseconds of
// the system clock, which the ranks of one host share; across hosts it is as good as their
// clock synchronisation).
//
// Thread-safety: every method may be called from any thread (the Reducer's hooks and Gloo's
// completion callbacks record from their own threads).
// Plain C++: no LibTorch.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "base/status.h"

namespace launch::trainer {

class Timeline {
 public:
  using Clock = std::chrono::system_clock;

  static Timeline& Get();

  // Records the optimizer steps [from_step, from_step + steps) (1-based, as metrics.jsonl counts
  // them) for `rank`. steps 0 leaves the timeline off.
  void Configure(int rank, int64_t from_step, int64_t steps);
  // Around optimizer step `step` (1-based): turns recording on for a chosen step, off after it.
  void BeginStep(int64_t step);
  void EndStep();
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  // Whether any event was recorded (there is something to write).
  bool has_events() const;

  // A finished span [start, end) named `name` on track `track` ("train", "pipeline", ...).
  void Span(const char* track, const std::string& name, Clock::time_point start,
            Clock::time_point end);
  // A span that may overlap others on its track (a bucket's all-reduce while the next one is
  // launched), drawn as an async slice: Begin returns its id for End, or 0 when not recording.
  uint64_t BeginAsync(const char* track, const std::string& name);
  void EndAsync(uint64_t id);

  // The events of this rank as a JSON array, written atomically to `path`.
  Status WriteRank(const std::string& path) const;
  // The events of the rank files (JSON arrays, as WriteRank writes them), in order, as one
  // array at `out`. IoError naming the file that could not be read, parsed or written.
  static Status Merge(const std::vector<std::string>& rank_files, const std::string& out);

  // RAII span on a track: records [construction, destruction) if recording at construction.
  class Scope {
   public:
    Scope(const char* track, std::string name);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    const char* track_;
    std::string name_;
    Clock::time_point start_;
    bool active_;
  };

 private:
  struct Event {
    char phase;  // 'X' complete, 'b' / 'e' async begin / end
    std::string track, name;
    int64_t ts_us = 0, dur_us = 0;
    uint64_t id = 0;
  };
  struct Open {
    uint64_t id;
    std::string track, name;
  };
  static int64_t Micros(Clock::time_point t);

  std::atomic<bool> recording_{false};
  int rank_ = 0;
  int64_t from_step_ = 1, steps_ = 0;
  mutable Mutex mu_;
  std::vector<Event> events_ GUARDED_BY(mu_);
  std::vector<Open> open_ GUARDED_BY(mu_);
  uint64_t next_id_ GUARDED_BY(mu_) = 1;
};

}  // namespace launch::trainer
