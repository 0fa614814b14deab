#include "launcher/plan_system.h"

#include <sys/stat.h>
#include <unistd.h>

#include <ctime>

#include "agent/ports.h"
#include "agent/subprocess.h"
#include "base/elf.h"
#include "base/files.h"

namespace launch::launcher {

StatusOr<std::string> RealPlanSystem::ResolveProgram(const std::string& program) {
  return agent::ResolveProgram(program);
}

StatusOr<int> RealPlanSystem::PickFreePort(const std::string& host) {
  return agent::PickFreePort(host);
}

FileFacts RealPlanSystem::Inspect(const std::string& path) {
  FileFacts facts;
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return facts;
  facts.regular = S_ISREG(st.st_mode);
  facts.readable = ::access(path.c_str(), R_OK) == 0;
  facts.executable = ::access(path.c_str(), X_OK) == 0;
  return facts;
}

StatusOr<std::string> RealPlanSystem::ReadRegularFile(const std::string& path, size_t max_bytes) {
  return launch::ReadRegularFile(path, max_bytes);
}

std::vector<std::string> RealPlanSystem::ElfNeededLibraries(const std::string& path) {
  return launch::ElfNeededLibraries(path);
}

std::string RealPlanSystem::CurrentDir() {
  char cwd[4096];
  return ::getcwd(cwd, sizeof(cwd)) != nullptr ? cwd : "";
}

std::string RealPlanSystem::HostName() {
  char host[256] = {};
  return ::gethostname(host, sizeof(host) - 1) == 0 ? host : "";
}

std::string RealPlanSystem::NewRunId() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y%m%d-%H%M%S", &tm);
  return std::string(buf) + "-" + std::to_string(getpid());
}

}  // namespace launch::launcher
