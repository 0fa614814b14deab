#include "base/log.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace launch::log {
namespace {

std::function<void(std::string)>& Sink() {
  static auto* sink = new std::function<void(std::string)>;
  return *sink;
}

// Colours only where a person reads: stderr a terminal that is not `dumb`. (A small writer
// rather than spdlog: three line kinds do not pay for two more shared libraries, whose
// relocation is a measurable part of `launch`'s start.)
bool Colours() {
  static const bool colours = AnsiTerminal(STDERR_FILENO);
  return colours;
}

void Emit(const char* colour, const std::string& text) {
  std::string line;
  line.reserve(text.size() + 24);
  if (Colours()) line += colour;
  line += "[launch] ";
  line += text;
  if (Colours()) line += "\033[m";
  line += '\n';
  if (Sink()) {
    Sink()(std::move(line));
    return;
  }
  // Flushed at once: our lines interleave with the workers' on the same terminal.
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace

void Info(const std::string& message) { Emit("\033[32m", message); }                       // green
void Warn(const std::string& message) { Emit("\033[33m\033[1m", "warning: " + message); }  // yellow
void Error(const std::string& message) { Emit("\033[31m\033[1m", "error: " + message); }   // red
bool AnsiTerminal(int fd) {
  const char* term = std::getenv("TERM");
  return ::isatty(fd) == 1 && term != nullptr && *term != '\0' && std::strcmp(term, "dumb") != 0;
}

void SetSink(std::function<void(std::string line)> sink) { Sink() = std::move(sink); }

}  // namespace launch::log
