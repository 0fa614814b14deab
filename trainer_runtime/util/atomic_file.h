#pragma once

// Crash-safe file replacement: write `PATH.tmp.<pid>`, fsync it, rename it over PATH, fsync
// the directory. A process killed at any point leaves either the old complete file or the new
// complete file at PATH, never a torn one. No LibTorch here.

#include <string>
#include <string_view>

#include "base/status.h"

namespace launch::trainer {

// Replaces `path` with `contents` atomically (see above). Creates missing parent directories.
Status WriteFileAtomically(const std::string& path, std::string_view contents);

// Reads a whole file. NotFound when it does not exist.
StatusOr<std::string> ReadFile(const std::string& path);

// mkdir -p.
Status MakeDirs(const std::string& path);

}  // namespace launch::trainer
