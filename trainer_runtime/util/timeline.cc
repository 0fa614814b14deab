#include "trainer_runtime/util/timeline.h"

#include <nlohmann/json.hpp>

#include "base/files.h"

namespace launch::trainer {

namespace {

using nlohmann::ordered_json;  // the keys keep the order the files always had ("ph" first)

// The file's text. A name that is not UTF-8 gets U+FFFD instead of failing the write.
std::string Text(const ordered_json& events) {
  return events.dump(-1, ' ', false, ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace

Timeline& Timeline::Get() {
  static Timeline* timeline = new Timeline();  // never destroyed: callbacks may outlive main
  return *timeline;
}

int64_t Timeline::Micros(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

void Timeline::Configure(int rank, int64_t from_step, int64_t steps) {
  MutexLock lock(&mu_);
  rank_ = rank;
  from_step_ = from_step;
  steps_ = steps;
}

void Timeline::BeginStep(int64_t step) {
  bool on;
  {
    MutexLock lock(&mu_);
    on = steps_ > 0 && step >= from_step_ && step < from_step_ + steps_;
  }
  recording_.store(on, std::memory_order_relaxed);
}

void Timeline::EndStep() { recording_.store(false, std::memory_order_relaxed); }

bool Timeline::has_events() const {
  MutexLock lock(&mu_);
  return !events_.empty();
}

void Timeline::Span(const char* track, const std::string& name, Clock::time_point start,
                    Clock::time_point end) {
  MutexLock lock(&mu_);
  events_.push_back(Event{'X', track, name, Micros(start), Micros(end) - Micros(start), 0});
}

uint64_t Timeline::BeginAsync(const char* track, const std::string& name) {
  if (!recording()) return 0;
  const int64_t now = Micros(Clock::now());
  MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  events_.push_back(Event{'b', track, name, now, 0, id});
  open_.push_back(Open{id, track, name});
  return id;
}

void Timeline::EndAsync(uint64_t id) {
  if (id == 0) return;
  const int64_t now = Micros(Clock::now());
  MutexLock lock(&mu_);
  for (auto it = open_.begin(); it != open_.end(); ++it) {
    if (it->id != id) continue;
    // Ends even after the step: an all-reduce launched in it completes when it completes.
    events_.push_back(Event{'e', it->track, it->name, now, 0, id});
    open_.erase(it);
    return;
  }
}

Status Timeline::WriteRank(const std::string& path) const {
  MutexLock lock(&mu_);
  ordered_json events = ordered_json::array();
  events.push_back({{"ph", "M"},
                    {"name", "process_name"},
                    {"pid", rank_},
                    {"args", {{"name", "rank " + std::to_string(rank_)}}}});
  events.push_back({{"ph", "M"},
                    {"name", "process_sort_index"},
                    {"pid", rank_},
                    {"args", {{"sort_index", rank_}}}});
  for (const Event& e : events_) {
    ordered_json event = {{"ph", std::string(1, e.phase)},
                          {"pid", rank_},
                          {"tid", e.track},
                          {"name", e.name},
                          {"cat", e.track},
                          {"ts", e.ts_us}};
    if (e.phase == 'X') {
      event["dur"] = e.dur_us;
    } else {
      event["id"] = e.id;
    }
    events.push_back(std::move(event));
  }
  return WriteFileAtomically(path, Text(events));
}

Status Timeline::Merge(const std::vector<std::string>& rank_files, const std::string& out) {
  ordered_json merged = ordered_json::array();
  for (const std::string& file : rank_files) {
    LAUNCH_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
    ordered_json events = ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (events.is_discarded() || !events.is_array())
      return Status::IoError(file + ": not a JSON array of trace events");
    for (ordered_json& e : events) merged.push_back(std::move(e));
  }
  return WriteFileAtomically(out, Text(merged));
}

Timeline::Scope::Scope(const char* track, std::string name)
    : track_(track), name_(std::move(name)), active_(Timeline::Get().recording()) {
  if (active_) start_ = Clock::now();
}

Timeline::Scope::~Scope() {
  if (active_) Timeline::Get().Span(track_, name_, start_, Clock::now());
}

}  // namespace launch::trainer
