#pragma once

// The multi-node agent: one per node. It meets the other nodes' agents at the rendezvous, runs
// this node's WorkerGroup with the ranks the round assigned, and follows the rendezvous through
// restarts, scale-up and the end of the job:
//
//   join round -> ASSIGN -> start workers -> (heartbeats) ->
//     local failure   -> stop siblings, REPORT the root cause -> RESTART or FAILED from the server
//     a worker died   -> (--recover in_place) REPLACE; REPLACED with a generation: that rank
//                        alone starts again; refused: the local failure path above
//     ASSIGN with a generation -> this node takes a lost node's place in the running round: its
//                        workers start as replacements (LAUNCH_RECOVER_GENERATION)
//     RESTART         -> stop workers, print the (shared) root cause, reserve a port, re-JOIN
//     local success   -> SUCCEEDED, then DONE (exit 0) as soon as every node is done
//     FAILED          -> print the same root cause every node prints, exit non-zero
//     server lost     -> stop workers; the hosting agent, or one with no restart left, exits 1;
//                        any other reconnects and JOINs again with its machine_rank (as a
//                        restarted `launch` would), retrying until join_timeout; exit 1 when
//                        that fails or nothing listens at the endpoint any more
//
// The agent of the node that owns the endpoint also runs the RendezvousServer on the same
// io_context: rank 0 when node ranks are explicit, otherwise the first agent on the endpoint's
// machine that manages to bind it. With etcd_endpoints, the agent whose claim the etcd cluster
// took serves it, and when its machine is lost the first survivor to claim it takes the job
// over (one restart): the others find it through etcd and join again.
//
// Exit codes: 0 success; 2 setup errors (bad token, duplicate rank, mismatched run_id or spec,
// join timeout, unreachable or unresolvable endpoint, port in use); the root cause's exit code
// (128+signal for a signal) when a worker failure ends the job; 1 when a node or the server was
// lost; 128+signal when this agent was interrupted.
//
// Nothing received from a peer is executed or put into a worker's environment beyond the
// documented rank/address variables (RANK, WORLD_SIZE, MASTER_ADDR, ... from the assignment),
// and the local interface that reaches MASTER_ADDR (export_socket_interfaces).

#include <string>
#include <vector>

#include "agent/agent.h"

namespace launch::agent {

struct ElasticAgentOptions {
  // The template for every round's workers (argv, environment, output routing, stop_grace,
  // exec_shim) and the log root (attempt_<round>/ folders). Ranks, world size, master address
  // and restart count in it are replaced by each round's assignment.
  AgentOptions local;
  // Rendezvous endpoint (main_process_ip / main_process_port, or rdzv_endpoint).
  std::string endpoint_host = "127.0.0.1";
  int endpoint_port = 29500;
  std::string token;  // rdzv_token / LAUNCH_RDZV_TOKEN; empty = none
  std::string run_id = "default";
  // Whether run_id was derived from the command (no --rdzv_id): a run-id mismatch is then
  // explained by what the id is made of.
  bool run_id_derived = false;
  // Whether this node prints the job's failure report (the rendezvous' root cause, the same on
  // every node). A --hosts head's hosts share one console: there only node 0 prints it.
  bool print_failure_report = true;
  int min_nodes = 1;
  int max_nodes = 1;
  int node_rank = -1;  // machine_rank; -1 = assigned
  int max_restarts = 0;
  double join_timeout_s = 600;
  double last_call_timeout_s = 1;
  double heartbeat_timeout_s = 10;  // RdzvConf::heartbeat_timeout_s
  // This node's own address: the rendezvous connection is made from it, so the server (and so
  // MASTER_ADDR) sees it. Empty = the kernel's choice. Lets one machine stand in for several
  // nodes (127.0.0.2, 127.0.0.3) and picks the interface on multi-homed hosts.
  std::string local_address;
  // Settings every node must share, compared by the server (mismatch = exit 2 naming it).
  std::string fingerprint;
  // Run the rendezvous server here: kAuto = when node_rank is 0, or (node_rank -1) when the
  // endpoint is an address of this machine and its port can be bound.
  enum class HostServer { kAuto, kAlways, kNever };
  HostServer host_server = HostServer::kAuto;
  std::string hostname;  // shown to other nodes; empty = gethostname()
  // rdzv_backend etcd: the cluster's client endpoints. Every agent then listens with a server
  // of its own, and the one whose claim etcd takes serves the job (host_server and the
  // endpoint are unused); when it is lost a survivor takes the job over from its record in
  // etcd (agent/etcd_rendezvous.h), so no machine's loss ends the job. Empty = the built-in
  // backend.
  std::vector<std::string> etcd_endpoints;
  // Give the workers GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME where this host's name would make
  // PyTorch bind loopback (socket_interfaces.h). Off for workers that choose their Gloo address
  // themselves from MASTER_ADDR's route (the built-in trainer: an address is more exact than an
  // interface, whose first address Gloo would take).
  bool export_socket_interfaces = true;
};

// Runs the multi-node loop until the job ends; returns the exit code (see above).
int RunElasticAgent(const ElasticAgentOptions& options);
// The same loop over any GroupSupervisor (tests pass a fake); runs `io` until the job ends.
// REQUIRES: `io` is not running elsewhere.
int RunElasticAgent(const ElasticAgentOptions& options, boost::asio::io_context& io,
                    const GroupFactory& make_group);

}  // namespace launch::agent
