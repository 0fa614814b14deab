#pragma once

// Splits a byte stream into whole lines, so that output of different workers can be merged
// without tearing: only complete lines ever leave the buffer. A line ends at '\n' or at '\r'
// (a progress bar that redraws itself, as tqdm does, ends each redraw with '\r' and no '\n'):
// each redraw leaves at once, prefixed and ending in its '\r', so a terminal shows it in place
// while the worker runs; "\r\n" is one line end.

#include <deque>
#include <string>
#include <string_view>

namespace launch::agent {

class LineBuffer {
 public:
  // A line longer than `max_line` bytes is emitted in pieces of that size (bounded memory for a
  // worker that writes megabytes without a newline).
  explicit LineBuffer(size_t max_line = 1 << 20) : max_line_(max_line) {}

  // Appends `data`; appends every completed line, each prefixed by `prefix` and ending in its
  // '\n' or '\r', to `*out`.
  void Feed(std::string_view data, std::string_view prefix, std::string* out);
  // Appends the unterminated rest (if any) as a final line with a '\n' added.
  void Flush(std::string_view prefix, std::string* out);
  bool empty() const { return partial_.empty(); }

 private:
  size_t max_line_;
  std::string partial_;
  bool after_cr_ = false;  // the last line left ended in '\r' (a '\n' next completes "\r\n")
};

// For a terminal: `chunk` (whole lines from LineBuffers, in the order the console shows them)
// with ESC[K, "erase to the end of the line", before every line that follows a redraw (a line
// that ended in '\r' leaves the cursor at the start of its row): a shorter line written over a
// progress bar, another rank's or the bar's next state, would otherwise leave the bar's tail
// on screen. `*after_cr` carries the state from one chunk to the next (false at first).
std::string EraseAfterRedraws(std::string_view chunk, bool* after_cr);

// Keeps the last `capacity` lines seen (for the failure report's stderr tail).
class TailLines {
 public:
  explicit TailLines(size_t capacity = 20) : capacity_(capacity) {}
  void Feed(std::string_view data);
  std::deque<std::string> Lines() const;  // includes an unterminated last line

 private:
  size_t capacity_;
  std::deque<std::string> lines_;
  std::string partial_;
};

}  // namespace launch::agent
