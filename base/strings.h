#pragma once

// Small string helpers shared by every module (no dependencies beyond the STL).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace launch {

std::vector<std::string> Split(std::string_view s, char sep);
std::string Trim(std::string_view s);
std::string Join(const std::vector<std::string>& parts, std::string_view sep);
// `text` as lines of at most `width` characters, broken at spaces (a word longer than `width`
// gets a line of its own, runs of spaces become one); the text's own newlines are kept.
std::vector<std::string> WrapText(std::string_view text, size_t width);
bool StartsWith(std::string_view s, std::string_view prefix);
bool EndsWith(std::string_view s, std::string_view suffix);
std::string ToLower(std::string_view s);
// No C0 control character and no DEL (UTF-8 beyond ASCII is fine): text that may go in a log
// line or a terminal as it is.
bool IsPrintable(std::string_view s);
// `s` with every control character but newline and tab replaced by '?': text from another
// process or machine (a worker's error message, a peer's hostname) cannot move the cursor,
// recolour or retitle the terminal it is printed on.
std::string SanitizeForTerminal(std::string_view s);

// Levenshtein distance; used for "did you mean" suggestions.
size_t EditDistance(std::string_view a, std::string_view b);
// The candidate closest to `word` when it is a plausible typo (small distance, or one is a
// prefix of the other); empty when none is close.
std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates);

// Strict number parsing: the whole string must be the number. Return false otherwise.
bool ParseInt64(std::string_view s, long long* out);
bool ParseDouble(std::string_view s, double* out);

// FNV-1a, 64 bits: a stable, fast, non-cryptographic hash (the same on every machine and
// build). Chain calls by passing the previous result as `state`.
inline constexpr uint64_t kFnv1aInit = 1469598103934665603ull;
uint64_t Fnv1a64(std::string_view data, uint64_t state = kFnv1aInit);
// Lowercase hex of `value`, 16 digits.
std::string Hex64(uint64_t value);

// "SIGSEGV" for 11, "signal 77" for unknown numbers.
std::string SignalName(int signo);

// True when `host` can only mean this machine: "localhost", an IPv4 address in 127.0.0.0/8,
// "::1" or an IPv4-mapped loopback address. Names other than "localhost" are not resolved.
bool IsLoopbackHost(std::string_view host);

}  // namespace launch
