#pragma once

// LineMerger: one console line for what several ranks print alike (`launch --dedup_output S`).
// Eight ranks that each print the same warning, banner or progress line make eight console
// lines that differ only in their "[rank N]: " prefix; merged, it is one "[ranks 0-7]: " line.
//
// Each whole line (LineBuffer's, with its '\n' or '\r') of a rank is held for up to `window`
// after the first rank printed it. Another rank's identical line within that time joins it; the
// line leaves as soon as every rank expected has printed it (or closed its stream: a rank that
// exited prints nothing more), or when its window ends, prefixed
// with the ranks that printed it ("[rank 3]: " when one did). Lines leave in the order they
// were first printed, except that each rank's lines leave in its own order: a copy whose rank
// has printed lines of its own since the held line moves that line after them, when no line in
// between is of a rank that printed it (so "[rank 0]: I am 0", "[rank 1]: I am 1", then one
// "[ranks 0,1]: done"); else the copy is held as a line of its own. A line the merger holds
// delays the lines after it (of any rank) until it leaves, so that order holds: with one rank
// printing alone, its lines reach the console `window` late.
//
// Bounded: from `max_held_bytes` held on, the oldest line leaves at once, whatever its window.
// Not thread-safe; the agent's loop owns it (no I/O, no timers: the caller asks when the next
// line is due and calls Release then).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace launch::agent {

class LineMerger {
 public:
  using Clock = std::chrono::steady_clock;

  // `ranks`: the ranks whose lines are merged (the machine's, its local ranks shown on the
  // console); a line leaves at once when all of them printed it.
  LineMerger(std::vector<int> ranks, Clock::duration window, size_t max_held_bytes = 1 << 20);

  // Holds one whole line of `rank` (ending in '\n' or '\r'), printed at `now`.
  void Add(int rank, std::string line, Clock::time_point now);
  // Add for each line of `lines`: whole lines as LineBuffer leaves them ("\r\n" one line end).
  void AddLines(int rank, std::string_view lines, Clock::time_point now);
  // `rank` prints no more (its stream closed): a held line waits no longer for it. Opened: it
  // prints again (a replacement took the rank over).
  void Closed(int rank);
  void Opened(int rank);
  // Appends the lines due at `now` to `*out`, prefixed. Returns when the next one is due
  // (nullopt: none held).
  std::optional<Clock::time_point> Release(Clock::time_point now, std::string* out);
  // Appends every held line to `*out`, prefixed (a worker's stream closed, the job ends).
  void ReleaseAll(std::string* out);
  bool empty() const { return held_.empty(); }

  // "[rank 3]: ", "[ranks 0-3]: ", "[ranks 0,2,5-7]: " (`ranks` ascending, no repeats).
  static std::string Prefix(const std::vector<int>& ranks);

 private:
  struct Held {
    std::string line;        // "" for the bare '\n' ending a redraw's row
    std::vector<int> ranks;  // ascending
    Clock::time_point due;
    double order;  // increasing along held_ (a moved line gets one between its neighbours')
  };
  using Iter = std::list<Held>::iterator;
  bool Due(const Held& h, Clock::time_point now) const;
  // Whether `rank` may join `e`, moved after the rank's last held line when it is before it.
  bool Join(int rank, Iter e);
  void MoveAfter(Iter e, Iter p);
  void PopFront(std::string* out);

  std::vector<int> ranks_;   // ascending
  std::vector<int> closed_;  // ascending: those of ranks_ that print no more
  Clock::duration window_;
  size_t max_held_bytes_;
  std::list<Held> held_;  // a list: a line moves, and the views below stay valid
  size_t held_bytes_ = 0;
  // Held lines by text, as held (not necessarily in held_'s order after a move).
  std::unordered_map<std::string_view, std::vector<Iter>> by_text_;
  std::unordered_map<int, Iter> last_;      // per rank: its last held line, while held
  std::unordered_map<int, bool> after_cr_;  // per rank: its last line ended in '\r'
};

}  // namespace launch::agent
