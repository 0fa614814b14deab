#pragma once

// torchrun's error-file contract. Each worker gets TORCHELASTIC_ERROR_FILE, a path of its own;
// a Python program whose entry point is decorated with torch's @record (or any program that
// follows the format) writes its uncaught exception there as JSON before it exits:
//
//   {"message": {"message": "ValueError: boom",
//                "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}
//
// ("message" may also be a plain string.) The failure report quotes the root cause's message
// and traceback from it instead of guessing from the stderr tail. Strings decode as JSON defines
// them: \u escapes (surrogate pairs, which Python's json writes for an emoji) become UTF-8.

#include <optional>
#include <string>

namespace launch::agent {

struct WorkerError {
  std::string message;    // "ValueError: boom"
  std::string traceback;  // py_callstack, may be empty
};

// The error recorded at `path`, or nullopt when the file is missing, empty, larger than 1 MiB
// or not in the format above (a malformed file never fails the report; it is ignored).
std::optional<WorkerError> ReadErrorFile(const std::string& path);

}  // namespace launch::agent
