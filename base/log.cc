#include "base/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace launch::log {
namespace {

spdlog::logger& Logger() {
  // Flushed on every message: our lines interleave with the workers' on the same terminal.
  static spdlog::logger* logger = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_st>();
    auto* l = new spdlog::logger("launch", sink);
    l->set_pattern("%^[launch] %v%$");
    l->flush_on(spdlog::level::trace);
    return l;
  }();
  return *logger;
}

}  // namespace

void Info(const std::string& message) { Logger().info(message); }
void Warn(const std::string& message) { Logger().warn("warning: " + message); }
void Error(const std::string& message) { Logger().error("error: " + message); }

}  // namespace launch::log
