#include "trainer_runtime/util/loop_util.h"

#include <fstream>
#include <iomanip>
#include <sstream>

#include <nlohmann/json.hpp>

namespace launch::trainer {

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string Fixed(double v, int digits) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(digits) << v;
  return o.str();
}

std::string FinishedRunMessage(const std::string& path, int64_t step) {
  return "train: " + path + " is from a finished run (step " + std::to_string(step) +
         "); starting a new run (set `resume: never` to always start fresh)";
}

std::string WorldSizeChangedWarning(int64_t written_by, int world_size) {
  return "train: warning: checkpoint was written by " + std::to_string(written_by) +
         " processes, now " + std::to_string(world_size) +
         ", and does not record its sample position (an older version wrote it): the rest of "
         "its epoch is skipped and the data order restarts at the next epoch";
}

std::string RestartSuffix(int restart_count) {
  return restart_count > 0 ? " (restart " + std::to_string(restart_count) + ")" : "";
}

std::string MetricsHistoryUpTo(const std::string& path, int64_t step) {
  std::string kept;
  if (step <= 0) return kept;
  std::ifstream old(path);
  std::string line;
  while (std::getline(old, line)) {
    // A line the crash of a previous run cut short does not parse, and is dropped with the
    // steps that are redone.
    const nlohmann::json object = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!object.is_object()) continue;
    const auto at = object.find("step");
    if (at != object.end() && at->is_number_integer() && at->get<int64_t>() <= step)
      kept += line + "\n";
  }
  return kept;
}

bool IsLostPeerError(const std::string& what) {
  // PeerLost: the shared-memory transports' own reports (a peer's pid exited, or a peer gave up
  // on the operation); Broken pipe: Gloo writing to a peer that is gone.
  return what.find("PeerLost") != std::string::npos ||
         what.find("Broken pipe") != std::string::npos ||
         what.find("Connection closed by peer") != std::string::npos ||
         what.find("Connection reset") != std::string::npos ||
         what.find("Timed out") != std::string::npos || what.find("timed out") != std::string::npos;
}

}  // namespace launch::trainer
