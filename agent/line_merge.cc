#include "agent/line_merge.h"

#include <algorithm>
#include <utility>

namespace launch::agent {

LineMerger::LineMerger(std::vector<int> ranks, Clock::duration window, size_t max_held_bytes)
    : ranks_(std::move(ranks)), window_(window), max_held_bytes_(max_held_bytes) {
  std::sort(ranks_.begin(), ranks_.end());
  ranks_.erase(std::unique(ranks_.begin(), ranks_.end()), ranks_.end());
}

void LineMerger::Add(int rank, std::string line, Clock::time_point now) {
  // The '\n' of a "\r\n" that a read split from its redraw (LineBuffer leaves it alone) ends
  // the redraw's row: held as the empty line, written with no prefix.
  bool& after_cr = after_cr_[rank];
  if (after_cr && line == "\n") line.clear();
  after_cr = !line.empty() && line.back() == '\r';
  if (auto it = by_text_.find(line); it != by_text_.end()) {
    for (Iter e : it->second) {
      if (Join(rank, e)) return;
    }
  }
  held_bytes_ += line.size();
  const double order = held_.empty() ? 0 : held_.back().order + 1;
  held_.push_back(Held{std::move(line), {rank}, now + window_, order});
  const Iter e = std::prev(held_.end());
  // Keyed by a view of the held string: list elements stay where they are.
  by_text_[std::string_view(e->line)].push_back(e);
  last_[rank] = e;
}

void LineMerger::AddLines(int rank, std::string_view lines, Clock::time_point now) {
  while (!lines.empty()) {
    size_t end = lines.find_first_of("\r\n");
    if (end == std::string_view::npos) end = lines.size() - 1;  // LineBuffer ends every line
    if (lines[end] == '\r' && end + 1 < lines.size() && lines[end + 1] == '\n') ++end;
    Add(rank, std::string(lines.substr(0, end + 1)), now);
    lines.remove_prefix(end + 1);
  }
}

bool LineMerger::Join(int rank, Iter e) {
  auto pos = std::lower_bound(e->ranks.begin(), e->ranks.end(), rank);
  if (pos != e->ranks.end() && *pos == rank) return false;  // its own: this is another copy
  auto last = last_.find(rank);
  if (last != last_.end() && last->second->order > e->order) {
    // The rank printed lines since: `e` moves after them, unless a line in between is of a rank
    // that printed `e` (that rank's order would break).
    const Iter p = last->second;
    for (Iter it = std::next(e);; ++it) {
      for (int r : it->ranks)
        if (std::binary_search(e->ranks.begin(), e->ranks.end(), r)) return false;
      if (it == p) break;
    }
    MoveAfter(e, p);
    pos = std::lower_bound(e->ranks.begin(), e->ranks.end(), rank);
  }
  e->ranks.insert(pos, rank);
  last_[rank] = e;
  return true;
}

void LineMerger::MoveAfter(Iter e, Iter p) {
  const Iter next = std::next(p);
  held_.splice(next, held_, e);  // iterators and views of `e` stay valid
  if (next == held_.end()) {
    e->order = p->order + 1;
  } else {
    e->order = (p->order + next->order) / 2;
    if (!(e->order > p->order && e->order < next->order)) {  // out of precision: renumber
      double order = 0;
      for (Held& h : held_) h.order = order++;
    }
  }
}

void LineMerger::Closed(int rank) {
  auto pos = std::lower_bound(closed_.begin(), closed_.end(), rank);
  if (pos == closed_.end() || *pos != rank) closed_.insert(pos, rank);
}

void LineMerger::Opened(int rank) {
  auto pos = std::lower_bound(closed_.begin(), closed_.end(), rank);
  if (pos != closed_.end() && *pos == rank) closed_.erase(pos);
}

bool LineMerger::Due(const Held& h, Clock::time_point now) const {
  if (h.due <= now || held_bytes_ > max_held_bytes_) return true;
  for (int r : ranks_)  // complete: every rank that may still print it has
    if (!std::binary_search(h.ranks.begin(), h.ranks.end(), r) &&
        !std::binary_search(closed_.begin(), closed_.end(), r))
      return false;
  return true;
}

void LineMerger::PopFront(std::string* out) {
  const Iter e = held_.begin();
  auto it = by_text_.find(std::string_view(e->line));
  it->second.erase(std::find(it->second.begin(), it->second.end(), e));
  if (it->second.empty()) by_text_.erase(it);
  for (int r : e->ranks) {
    auto last = last_.find(r);
    if (last != last_.end() && last->second == e) last_.erase(last);
  }
  if (e->line.empty()) {
    out->push_back('\n');
  } else {
    out->append(Prefix(e->ranks));
    out->append(e->line);
  }
  held_bytes_ -= e->line.size();
  held_.pop_front();
}

std::optional<LineMerger::Clock::time_point> LineMerger::Release(Clock::time_point now,
                                                                 std::string* out) {
  while (!held_.empty() && Due(held_.front(), now)) PopFront(out);
  if (held_.empty()) return std::nullopt;
  return held_.front().due;
}

void LineMerger::ReleaseAll(std::string* out) {
  while (!held_.empty()) PopFront(out);
}

std::string LineMerger::Prefix(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return "[rank " + std::to_string(ranks[0]) + "]: ";
  std::string s = "[ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) s += ',';
    s += std::to_string(ranks[i]);
    if (j > i) s += (j == i + 1 ? "," : "-") + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s + "]: ";
}

}  // namespace launch::agent
