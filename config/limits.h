#pragma once

// The bounds on a job's settings, in one header that includes nothing of the project: the
// config validates against them (naming the file:line, flag or variable of a bad value), and the
// modules that enforce them too (the hostfile parser, the rendezvous protocol) include this
// alone, not the config structs.

#include <cstddef>

namespace launch::config {

// Limits the rendezvous protocol enforces on a JOIN (rendezvous/protocol.cc), checked when the
// configuration is validated too, so that a bad value is named (file:line, flag or variable) at
// once instead of surfacing on another node as a lost server.
inline constexpr size_t kMaxRunIdBytes = 1024;
inline constexpr double kMinRendezvousTimeoutS = 0.05;
inline constexpr int kMaxNodes = 65536;
inline constexpr int kMaxRestarts = 1 << 20;
// A config file larger than this is refused (a real one is a few KiB; yaml-cpp would need
// tens of times its size in memory).
inline constexpr size_t kMaxConfigBytes = 16u << 20;
// Workers one launch starts (nproc_per_node, and num_processes / num_machines; a hostfile's
// slots).
inline constexpr int kMaxWorkersPerNode = 4096;

}  // namespace launch::config
