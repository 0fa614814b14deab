#include "base/log.h"

#include <spdlog/details/null_mutex.h>
#include <spdlog/details/os.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <cstdio>

namespace launch::log {
namespace {

std::function<void(std::string)>& Sink() {
  static auto* sink = new std::function<void(std::string)>;
  return *sink;
}

// spdlog's stderr colour sink, except that the finished line goes to Sink() when one is set
// instead of being written from the logging thread.
class LineSink final : public spdlog::sinks::base_sink<spdlog::details::null_mutex> {
 public:
  LineSink()
      : colors_(spdlog::details::os::in_terminal(stderr) &&
                spdlog::details::os::is_color_terminal()) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    std::string line(formatted.data(), formatted.size());
    if (colors_ && msg.color_range_end > msg.color_range_start) {
      line.insert(msg.color_range_end, "\033[m");
      line.insert(msg.color_range_start, Color(msg.level));
    }
    if (Sink()) {
      Sink()(std::move(line));
      return;
    }
    // Flushed at once: our lines interleave with the workers' on the same terminal.
    std::fwrite(line.data(), 1, line.size(), stderr);
    std::fflush(stderr);
  }
  void flush_() override {}

 private:
  static const char* Color(spdlog::level::level_enum level) {
    switch (level) {
      case spdlog::level::warn:
        return "\033[33m\033[1m";  // yellow, bold
      case spdlog::level::err:
      case spdlog::level::critical:
        return "\033[31m\033[1m";  // red, bold
      default:
        return "\033[32m";  // green
    }
  }

  const bool colors_;
};

spdlog::logger& Logger() {
  static spdlog::logger* logger = [] {
    auto* l = new spdlog::logger("launch", std::make_shared<LineSink>());
    l->set_pattern("%^[launch] %v%$");
    return l;
  }();
  return *logger;
}

}  // namespace

void Info(const std::string& message) { Logger().info(message); }
void Warn(const std::string& message) { Logger().warn("warning: " + message); }
void Error(const std::string& message) { Logger().error("error: " + message); }
void SetSink(std::function<void(std::string line)> sink) { Sink() = std::move(sink); }

}  // namespace launch::log
