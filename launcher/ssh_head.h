#pragma once

// `launch --hostfile FILE` / `--hosts h1:2,h2:2`: this launch (the head) starts one launch per
// host over ssh, streams their output, and ends them all together.
//
// Each host runs, through OpenSSH's client (`ssh -T -o BatchMode=yes`: the user's own keys,
// agent and ~/.ssh/config, never a password prompt) and the remote user's shell:
//     cd <the head's working directory> && exec <this launch's path> --head_stdin
//        --num_machines N --machine_rank i --nproc_per_node SLOTS
//        --main_process_ip <first host> --main_process_port P --run_id ID <the head's arguments>
// so every host needs launch at the same path and the same working directory (a shared or
// identical file system, as DeepSpeed's and Horovod's runners assume). The first host is node
// 0 and hosts the rendezvous; the head itself is not a node unless it is listed (it reaches
// itself over ssh too, as DeepSpeed's pdsh runner does).
//
// The control channel is ssh's stdin. The head writes, before anything else (one line each; no
// value holds a newline):
//     launch-head 1
//     env KEY=VALUE          the environment allowlist (JobEnvironment below), any number
//     token TOKEN            the rendezvous token: the user's LAUNCH_RDZV_TOKEN, else a fresh
//                            random one, so that a hostfile job always authenticates
//     end
// and then keeps stdin open; afterwards it writes only
//     signal NAME            USR1, USR2 or URG: the head received it and forwards it (below)
// Nothing secret is on any command line (ssh's or the
// remote shell's, which every user of either machine can read in /proc/PID/cmdline). The
// remote launch answers kReadyLine on stdout, and stops its node (as on SIGTERM) when its stdin
// ends: when the head closes it (Ctrl-C, a failure) or when ssh's connection goes (the head
// killed, the link lost: ServerAliveInterval notices on the head's side), so no host is left
// running without its head.
//
// A host whose ssh ends before kReadyLine (unreachable, refused keys, launch missing there) is
// named at once with ssh's own message, and every host is stopped: the job cannot form.

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"
#include "config/hostfile.h"

namespace launch::launcher {

// What the remote launch prints on stdout once it has read the head's message.
inline constexpr const char* kReadyLine = "launch-remote-ready";

struct HeadJob {
  std::vector<config::HostSlots> hosts;  // node i = hosts[i]
  // The remote launch's arguments after the per-host flags: the head's own, without the host
  // list.
  std::vector<std::string> args;
  bool self_test = false;   // `launch test`: every host runs `launch test ...`
  std::string launch_path;  // this launch's absolute path: the same on every host
  std::string cwd;          // the head's working directory: relative paths mean the same there
  std::string master_addr;  // what the other hosts reach node 0 at (the first host by default)
  int port = 29500;         // the rendezvous port on node 0
  std::string run_id;
  std::string token;
  std::vector<std::pair<std::string, std::string>> env;  // JobEnvironment
  std::string ssh = "ssh";                               // the ssh client (resolved on PATH)
  // How long a host's launch gets to stop once asked (its workers' stop_grace), before the
  // head ends its ssh.
  double stop_grace_s = 30;
};

// The command that starts node `node` (argv for posix_spawn; the remote command is one shell
// word list, each argument single-quoted).
std::vector<std::string> SshArgv(const HeadJob& job, size_t node);

// The control message above.
std::string HeadMessage(const HeadJob& job);

// Runs the job: starts every host, streams each one's stdout and stderr to ours with a "HOST: "
// prefix (the remote launches add their own "[rank N]: "), and waits for all. SIGINT, SIGTERM
// and SIGHUP (unless ignored when launch started, as under nohup) stop every host; a second one
// ends their ssh at once. SIGUSR1 and SIGUSR2 (a scheduler's warning before it preempts the job)
// and SIGURG (print the collective report, agent.h) are forwarded to every host's launch, which
// handles them as its own (forwards SIGUSR1/2 to its workers). After a host fails, the others get a
// moment to end through the rendezvous (naming the same root cause), then are stopped. Returns the
// exit code: 0, the first failed host's own code, 128 + the signal that stopped the job, or 1 when
// a host could not be started. REQUIRES: job.hosts is not empty; called once, from main's thread,
// with no other child.
int RunHead(const HeadJob& job);

// The environment every host's launch gets beyond its own login environment, DeepSpeed's
// .deepspeed_env idea: built in, launch's own settings (LAUNCH_* and torchrun's PET_*, but
// never the token, which has its own line) and PYTHONPATH, taken from `env`; then, later ones
// winning, the KEY=VALUE lines of $HOME/.launch_env and of ./.launch_env (`cwd`), where they
// exist. A variable whose value holds a newline is left out, with a warning in `warnings`.
// InvalidConfig naming file:line for a line that is not KEY=VALUE.
StatusOr<std::vector<std::pair<std::string, std::string>>> JobEnvironment(
    const std::map<std::string, std::string>& env, const std::string& cwd,
    std::vector<std::string>* warnings);

// KEY=VALUE lines (`export KEY=VALUE` too), '#' comments and blank lines; the value is taken
// as written, up to the end of the line, except that one pair of single or double quotes
// around all of it is removed (A="x y" is x y; no escapes are interpreted).
StatusOr<std::vector<std::pair<std::string, std::string>>> ParseEnvFile(const std::string& text,
                                                                        const std::string& path);

// The remote side (--head_stdin): reads the head's message from `fd` (30 s at most, 1 MiB at
// most) into `env` and `token`. ProtocolError when it is not the message above.
Status ReceiveFromHead(int fd, std::vector<std::pair<std::string, std::string>>* env,
                       std::string* token);

// The remote side, once the message is read: a thread that reads `fd` to its end, sends this
// process each signal the head forwards ("signal NAME" lines; anything else is ignored), and at
// the end sends it SIGTERM, which stops the node as a Ctrl-C would. SIGUSR1 and SIGUSR2 are
// ignored until the agent installs its handlers. Called at most once.
void StopWhenHeadLeaves(int fd);

// The signals a head forwards to its hosts (SIGUSR1, SIGUSR2, SIGURG), and the line that carries
// `signo` ("signal USR1\n"); "" for any other signal.
std::string ForwardedSignalLine(int signo);
// The signal a "signal NAME" line (without its newline) asks for; 0 for any other line.
int ForwardedSignal(const std::string& line);

}  // namespace launch::launcher
