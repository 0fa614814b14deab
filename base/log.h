#pragma once

// The launcher's own messages ("[launch] ..."), on stderr, coloured by level on a terminal.
// Workers' output never goes through here (the agent multiplexes it line by line). Backed by
// spdlog with a single-threaded sink: every caller runs on the agent's one thread.

#include <string>

namespace launch::log {

void Info(const std::string& message);
void Warn(const std::string& message);   // "[launch] warning: ..."
void Error(const std::string& message);  // "[launch] error: ..."

}  // namespace launch::log
