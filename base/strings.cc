#include "base/strings.h"

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>

namespace launch {

std::vector<std::string> Split(std::string_view s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) {
      out.emplace_back(s.substr(start));
      return out;
    }
    out.emplace_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string Join(const std::vector<std::string>& parts, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += sep;
    out += parts[i];
  }
  return out;
}

std::vector<std::string> WrapText(std::string_view text, size_t width) {
  std::vector<std::string> lines;
  for (const std::string& paragraph : Split(text, '\n')) {
    std::string line;
    for (const std::string& word : Split(paragraph, ' ')) {
      if (word.empty()) continue;
      if (!line.empty() && line.size() + 1 + word.size() > width) {
        lines.push_back(std::move(line));
        line.clear();
      }
      if (!line.empty()) line += ' ';
      line += word;
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

bool StartsWith(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool EndsWith(std::string_view s, std::string_view x) {
  return s.size() >= x.size() && s.substr(s.size() - x.size()) == x;
}

bool IsPrintable(std::string_view s) {
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) return false;
  }
  return true;
}

std::string SanitizeForTerminal(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    out.push_back(c == '\n' || c == '\t' || (u >= 0x20 && u != 0x7f) ? c : '?');
  }
  return out;
}

std::string ToLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates) {
  std::string lw = ToLower(word);
  std::string best;
  size_t best_score = static_cast<size_t>(-1);
  for (const auto& c : candidates) {
    std::string lc = ToLower(c);
    size_t d = EditDistance(lw, lc);
    // Abbreviations ("nprocs" for "nproc_per_node") are near misses too.
    bool prefix = lw.size() >= 3 && (StartsWith(lc, lw.substr(0, std::min<size_t>(lw.size(), 5))));
    size_t limit = std::max<size_t>(2, std::min(lw.size(), lc.size()) / 3);
    if (d <= limit || prefix) {
      // Ties go to the candidate of the same length (a typo, not an abbreviation).
      size_t score = (prefix && d > limit ? 100 + d : d) * 2 + (lw.size() == lc.size() ? 0 : 1);
      if (score < best_score) {
        best_score = score;
        best = c;
      }
    }
  }
  return best;
}

bool ParseInt64(std::string_view s, long long* out) {
  std::string str = Trim(s);
  if (str.empty()) return false;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(str.c_str(), &end, 10);
  if (errno != 0 || end != str.c_str() + str.size()) return false;
  *out = v;
  return true;
}

bool ParseDouble(std::string_view s, double* out) {
  std::string str = Trim(s);
  if (str.empty()) return false;
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(str.c_str(), &end);
  if (errno != 0 || end != str.c_str() + str.size()) return false;
  *out = v;
  return true;
}

uint64_t Fnv1a64(std::string_view data, uint64_t state) {
  for (unsigned char c : data) {
    state ^= c;
    state *= 1099511628211ull;
  }
  return state;
}

std::string Hex64(uint64_t value) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, value >>= 4) out[static_cast<size_t>(i)] = kDigits[value & 0xf];
  return out;
}

std::string SignalName(int signo) {
  const char* abbrev = sigabbrev_np(signo);
  if (abbrev) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(signo);
}

bool IsLoopbackHost(std::string_view host) {
  if (host == "localhost") return true;
  const std::string text(host);
  in_addr v4;
  if (inet_pton(AF_INET, text.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, text.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

}  // namespace launch
