#pragma once

// `launch`'s subcommands, in one table (ninja's `Tool` table): `launch --help` lists them from
// it and Main dispatches through it. Each runs on its own arguments (after the subcommand's
// name) and returns the process's exit code (base/exit_code.h). The launch itself (no
// subcommand, or `launch test`, which is a launch of the self-check) is launcher.h's Main.

#include <string>
#include <vector>

namespace launch::launcher {

struct Subcommand {
  const char* name;
  const char* summary;  // one line for `launch --help`
  int (*run)(const std::vector<std::string>& args);
};

// config, env, rdzv-server (test is the launch itself: launcher.cc).
const std::vector<Subcommand>& Subcommands();
const Subcommand* FindSubcommand(const std::string& name);

// `launch rdzv-server --port PORT [--host ADDRESS] [--token SECRET] [--quiet]`: a standalone
// rendezvous server, for jobs where no node should host it. The token may also come from the
// environment (LAUNCH_RDZV_TOKEN). Runs until SIGINT/SIGTERM, serving one job after another.
// Exit codes: 0 after a signal, 2 for bad flags or a port that cannot be bound (one line naming
// the address).
int RunRendezvousServerCommand(const std::vector<std::string>& args);

}  // namespace launch::launcher
