#include "trainer_runtime/util/timeline.h"

#include <sstream>

#include "base/files.h"

namespace launch::trainer {

namespace {

// JSON string body: names are ours ("bucket 3 all-reduce"), but escape anyway.
std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
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
  std::ostringstream os;
  MutexLock lock(&mu_);
  const std::string pid = std::to_string(rank_);
  os << "[\n{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << pid
     << ",\"args\":{\"name\":\"rank " << pid << "\"}},\n"
     << "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":" << pid
     << ",\"args\":{\"sort_index\":" << pid << "}}";
  for (const Event& e : events_) {
    os << ",\n{\"ph\":\"" << e.phase << "\",\"pid\":" << pid << ",\"tid\":\"" << Escape(e.track)
       << "\",\"name\":\"" << Escape(e.name) << "\",\"cat\":\"" << Escape(e.track)
       << "\",\"ts\":" << e.ts_us;
    if (e.phase == 'X') os << ",\"dur\":" << e.dur_us;
    if (e.phase != 'X') os << ",\"id\":" << e.id;
    os << "}";
  }
  os << "\n]\n";
  return WriteFileAtomically(path, os.str());
}

Status Timeline::Merge(const std::vector<std::string>& rank_files, const std::string& out) {
  std::string merged = "[";
  bool first = true;
  for (const std::string& file : rank_files) {
    LAUNCH_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
    const size_t open = text.find('[');
    const size_t close = text.rfind(']');
    if (open == std::string::npos || close == std::string::npos || close < open)
      return Status::IoError(file + ": not a JSON array of trace events");
    std::string body = text.substr(open + 1, close - open - 1);
    if (body.find_first_not_of(" \n") == std::string::npos) continue;
    merged += first ? "" : ",";
    merged += body;
    first = false;
  }
  merged += "]\n";
  return WriteFileAtomically(out, merged);
}

Timeline::Scope::Scope(const char* track, std::string name)
    : track_(track), name_(std::move(name)), active_(Timeline::Get().recording()) {
  if (active_) start_ = Clock::now();
}

Timeline::Scope::~Scope() {
  if (active_) Timeline::Get().Span(track_, name_, start_, Clock::now());
}

}  // namespace launch::trainer
