#pragma once

// Small string helpers shared by every module (no dependencies beyond the STL).

#include <string>
#include <string_view>
#include <vector>

namespace launch {

std::vector<std::string> Split(std::string_view s, char sep);
std::string Trim(std::string_view s);
std::string Join(const std::vector<std::string>& parts, std::string_view sep);
bool StartsWith(std::string_view s, std::string_view prefix);
bool EndsWith(std::string_view s, std::string_view suffix);
std::string ToLower(std::string_view s);

// Levenshtein distance; used for "did you mean" suggestions.
size_t EditDistance(std::string_view a, std::string_view b);
// The candidate closest to `word` when it is a plausible typo (small distance, or one is a
// prefix of the other); empty when none is close.
std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates);

// Strict number parsing: the whole string must be the number. Return false otherwise.
bool ParseInt64(std::string_view s, long long* out);
bool ParseDouble(std::string_view s, double* out);

// "SIGSEGV" for 11, "signal 77" for unknown numbers.
std::string SignalName(int signo);

}  // namespace launch
