#pragma once

#include <string>

#include "base/status.h"

namespace launch {

// mkdir -p: creates `path` and its missing parents (0755). IoError names the folder that
// could not be created.
Status MakeDirs(const std::string& path);

// The first `limit` bytes of a file ("" when it cannot be read): /proc and /sys files, small
// configuration files.
std::string ReadSmallFile(const std::string& path, size_t limit = 1 << 20);
// Writes `text` to an existing file (a /proc or /sys control file): IoError naming it.
Status WriteExistingFile(const std::string& path, const std::string& text);

// Raises this process's RLIMIT_NOFILE soft limit to the hard limit (a rendezvous server may
// hold thousands of connections); best effort.
void RaiseDescriptorLimit();
// The soft limit this process started with (what its children should get back).
unsigned long long OriginalDescriptorLimit();

}  // namespace launch
