#pragma once

// The launcher's own messages ("[launch] ..."), on stderr, coloured by level on a terminal.
// Workers' output never goes through here (the agent multiplexes it line by line).
//
// Thread-safety: none; every caller runs on the agent's one thread, SetSink included.

#include <functional>
#include <string>

namespace launch::log {

void Info(const std::string& message);
void Warn(const std::string& message);   // "[launch] warning: ..."
void Error(const std::string& message);  // "[launch] error: ..."

// Where finished lines go: each call gets one whole line ending in '\n', colour codes included
// when stderr is a colour terminal. Without a sink (the default) a line is written to stderr at
// once, a write that blocks while nobody reads stderr; the agent installs its console writer here
// (agent/output_writer.h), which never blocks the caller and may drop lines (and says so).
// An empty function restores the default.
void SetSink(std::function<void(std::string line)> sink);

// Whether `fd` is a terminal that takes ANSI escapes (colours, erasing a line): a tty, and TERM
// set and not "dumb".
bool AnsiTerminal(int fd);

}  // namespace launch::log
