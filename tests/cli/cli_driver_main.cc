// A stand-in for `launch config` / `launch env` that calls the same entry points, so the pty and
// report tests also run where the `launch` binary is not built. The tests prefer `launch`.
#include <iostream>
#include <string>
#include <vector>

#include "launcher/env_report.h"
#include "launcher/wizard.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    std::cerr << "usage: launch-cli-driver config|env ARGS...\n";
    return 2;
  }
  std::string command = args.front();
  args.erase(args.begin());
  if (command == "config") return launch::launcher::RunConfigCommand(args);
  if (command == "env") return launch::launcher::RunEnvCommand(args);
  std::cerr << "launch-cli-driver: unknown command '" << command << "'\n";
  return 2;
}
