#pragma once

// What MakePlan (launcher.h) asks of the machine it plans for, behind one interface, as ninja's
// planner reaches the disk only through its DiskInterface: RealPlanSystem asks this machine;
// tests pass a fake, so a plan can be made with no port bound, no PATH searched and no file read.
//
// Thread-safety: RealPlanSystem holds no state; a fake is the test's business.

#include <cstddef>
#include <string>
#include <vector>

#include "base/status.h"

namespace launch::launcher {

// What MakePlan needs to know about one path.
struct FileFacts {
  bool regular = false;     // exists and is a regular file (stat follows links)
  bool readable = false;    // access(R_OK)
  bool executable = false;  // access(X_OK)
};

class PlanSystem {
 public:
  virtual ~PlanSystem() = default;

  // The path execvp would run for `program`: as given when it contains '/', else the first match
  // on PATH (agent::ResolveProgram). NotFound / InvalidArgument ("is a directory", "is not
  // executable") name the program.
  virtual StatusOr<std::string> ResolveProgram(const std::string& program) = 0;

  // A free TCP port on `host` for the workers' store (agent::PickFreePort: binds it, then lets it
  // go). An error names what failed; MakePlan adds the address.
  virtual StatusOr<int> PickFreePort(const std::string& host) = 0;

  // Facts about `path`; all false when it does not exist.
  virtual FileFacts Inspect(const std::string& path) = 0;

  // A regular file of at most `max_bytes`, read whole (base/files.h ReadRegularFile).
  virtual StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) = 0;

  // The DT_NEEDED entries of the ELF file `path` (base/elf.h); empty when it is not one.
  virtual std::vector<std::string> ElfNeededLibraries(const std::string& path) = 0;

  // The working directory; empty when it cannot be read.
  virtual std::string CurrentDir() = 0;

  // This machine's host name; empty when it cannot be read.
  virtual std::string HostName() = 0;

  // A fresh run id for a one-machine job that names none: local time and process id
  // ("20250101-120000-4242").
  virtual std::string NewRunId() = 0;
};

// Asks this machine. Stateless: one instance may serve every plan.
class RealPlanSystem : public PlanSystem {
 public:
  StatusOr<std::string> ResolveProgram(const std::string& program) override;
  StatusOr<int> PickFreePort(const std::string& host) override;
  FileFacts Inspect(const std::string& path) override;
  StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes) override;
  std::vector<std::string> ElfNeededLibraries(const std::string& path) override;
  std::string CurrentDir() override;
  std::string HostName() override;
  std::string NewRunId() override;
};

}  // namespace launch::launcher
