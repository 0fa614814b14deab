#include "agent/line_buffer.h"

namespace launch::agent {

void LineBuffer::Feed(std::string_view data, std::string_view prefix, std::string* out) {
  while (!data.empty()) {
    if (after_cr_ && partial_.empty() && data.front() == '\n') {
      out->push_back('\n');  // the rest of a "\r\n" split between two reads
      data.remove_prefix(1);
    }
    after_cr_ = false;
    size_t end = data.find_first_of("\r\n");
    if (end == std::string_view::npos) {
      partial_.append(data);
      while (partial_.size() >= max_line_) {
        out->append(prefix);
        out->append(partial_, 0, max_line_);
        out->push_back('\n');
        partial_.erase(0, max_line_);
      }
      return;
    }
    if (data[end] == '\r' && end + 1 < data.size() && data[end + 1] == '\n') ++end;  // "\r\n"
    if (end == 0 && data[0] == '\r' && partial_.empty()) {
      data.remove_prefix(1);  // a redraw's leading '\r' with nothing before it: nothing to show
      after_cr_ = true;
      continue;
    }
    out->append(prefix);
    out->append(partial_);
    out->append(data.substr(0, end + 1));
    partial_.clear();
    after_cr_ = data[end] == '\r';
    data.remove_prefix(end + 1);
  }
}

void LineBuffer::Flush(std::string_view prefix, std::string* out) {
  if (partial_.empty()) return;
  out->append(prefix);
  out->append(partial_);
  out->push_back('\n');
  partial_.clear();
}

std::string EraseAfterRedraws(std::string_view chunk, bool* after_cr) {
  std::string out;
  out.reserve(chunk.size() + 3);
  for (char c : chunk) {
    // "\r\n" ends the redraw's row as it stands: nothing to erase.
    if (*after_cr && c != '\n' && c != '\r') out += "\x1b[K";
    out.push_back(c);
    *after_cr = c == '\r';
  }
  return out;
}

void TailLines::Feed(std::string_view data) {
  while (!data.empty()) {
    size_t nl = data.find('\n');
    if (nl == std::string_view::npos) {
      partial_.append(data.substr(0, 4096 - std::min<size_t>(partial_.size(), 4096)));
      return;
    }
    partial_.append(data.substr(0, std::min<size_t>(nl, 4096)));
    lines_.push_back(std::move(partial_));
    partial_.clear();
    if (lines_.size() > capacity_) lines_.pop_front();
    data.remove_prefix(nl + 1);
  }
}

std::deque<std::string> TailLines::Lines() const {
  std::deque<std::string> out = lines_;
  if (!partial_.empty()) {
    out.push_back(partial_);
    if (out.size() > capacity_) out.pop_front();
  }
  return out;
}

}  // namespace launch::agent
