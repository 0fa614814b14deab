#pragma once

// `launch rdzv-server`: a standalone rendezvous server, for jobs where no node should host it.
//
//   launch rdzv-server --port 29500 [--host 0.0.0.0] [--token SECRET] [--quiet]
//
// The token may also come from the environment (LAUNCH_RDZV_TOKEN). Runs until SIGINT/SIGTERM,
// serving one job after another. Exit codes: 0 after a signal, 2 for bad flags or a port that
// cannot be bound (one line naming the address).

namespace launch::rendezvous {

// argv[0] is the subcommand name ("rdzv-server"); the flags follow.
int RunRendezvousServerCommand(int argc, char** argv);

}  // namespace launch::rendezvous
