#pragma once

// The machines of a job started from one head over ssh (`launch --hostfile FILE`, `--hosts
// h1:2,h2:2`): DeepSpeed's host file and Horovod's -H list, parsed into one plain list. The
// first host is node 0 and hosts the rendezvous; a host's slots are its workers
// (nproc_per_node there).
//
// Host file (DeepSpeed's format), one host per line:
//     worker-1 slots=4      # a comment after the entry
//     # a whole-line comment; blank lines are skipped
// Host list (Horovod's -H): "h1:2,h2:2"; a host without ":N" has 1 slot, as in Horovod.
//
// Refused, naming file:line (or the list's entry): a line that is not `HOST slots=N`, slots not
// an integer from 1 to kMaxWorkersPerNode (limits.h), a host given twice, no host at all.

#include <string>
#include <vector>

#include "base/status.h"

namespace launch::config {

struct HostSlots {
  std::string host;   // as ssh is given it: a name from ~/.ssh/config, a DNS name or an address
  int slots = 1;      // workers on that host
  std::string where;  // "hosts.txt:3" or "--hosts entry 2": for messages
};

// `text` is the content of the file at `path` (named in errors).
StatusOr<std::vector<HostSlots>> ParseHostfile(const std::string& text, const std::string& path);
StatusOr<std::vector<HostSlots>> ParseHostList(const std::string& text);

// Reads and parses the file at `path` (at most 1 MiB).
StatusOr<std::vector<HostSlots>> LoadHostfile(const std::string& path);

}  // namespace launch::config
