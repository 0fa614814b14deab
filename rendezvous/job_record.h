#pragma once

// JobRecord: what a rendezvous server must hand on for another one to take its job over.

#include <string>
#include <string_view>

#include "base/status.h"
#include "rendezvous/protocol.h"

namespace launch::rendezvous {

// What a rendezvous must remember of a job for another server to take it over when the server's
// host is lost (launch --rdzv_backend etcd keeps it in the cluster): the spec every JOIN is held
// to, and the counters that must never go back (rounds, restarts spent, in-place generations).
// The rest (sessions, timers, the running round's ranks) lives and dies with the connections.
struct JobRecord {
  JoinRequest spec;
  std::string spec_origin;  // who set the spec, for mismatch messages
  int round = 0;
  int restarts_used = 0;
  int generation = 0;
  int num_nodes = 0;  // nodes of the latest round formed (0: none formed yet)
};
// As text (the protocol's field encoding; binary-safe) and back; Decode names what is wrong.
std::string EncodeJobRecord(const JobRecord& record);
StatusOr<JobRecord> DecodeJobRecord(std::string_view text);

}  // namespace launch::rendezvous
