#include "agent/elastic_agent.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <boost/asio.hpp>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>

#include "agent/etcd_rendezvous.h"
#include "agent/failure_report.h"
#include "agent/output_writer.h"
#include "agent/ports.h"
#include "agent/socket_interfaces.h"
#include "base/exit_code.h"
#include "base/files.h"
#include "base/interfaces.h"
#include "base/log.h"
#include "base/strings.h"
#include "rendezvous/client.h"
#include "rendezvous/server.h"

namespace launch::agent {

namespace asio = boost::asio;
namespace rdzv = launch::rendezvous;

namespace {

// How long the hosting agent keeps its server up after its own job ended, so every other agent
// receives the final DONE/FAILED.
constexpr std::chrono::milliseconds kServerDrainLimit{3000};

// How long a replacement node's workers may take, once its agent is assigned the lost node's
// place, to start and announce their generation (process start, LibTorch, the store).
constexpr std::chrono::seconds kReplacementStart{60};

int ExitCodeForReport(const rdzv::FailureReport& r) {
  return ExitCodeForWorker(r.exit_code, r.signal);
}

class ElasticAgent {
 public:
  ElasticAgent(const ElasticAgentOptions& options, asio::io_context& io,
               const GroupFactory& make_group)
      : options_(options), io_(io), make_group_(make_group), signals_(io_), drain_timer_(io_) {
    AddAgentSignals(signals_);
  }

  int Run() {
    std::signal(SIGPIPE, SIG_IGN);
    RouteLogThroughConsole();  // from the first line on: a stalled console never blocks the loop
    ArmSignals();
    // Under etcd the endpoint is the cluster's; the rendezvous is served by an agent, at its
    // address on the route there.
    std::string where = etcd_mode()
                            ? "(served by one of the agents, found through etcd at " +
                                  options_.etcd_endpoints.front() + ")"
                            : rdzv::FormatEndpoint(options_.endpoint_host, options_.endpoint_port);
    if (options_.token.empty() && !IsLoopbackHost(options_.endpoint_host))
      log::Warn("the rendezvous endpoint " + where +
                " is not on loopback and no rdzv_token is set: any host that reaches it can join "
                "this job; give every node the same secret (export LAUNCH_RDZV_TOKEN=$(openssl "
                "rand -hex 16) before srun, mpirun or ssh)");
    Status hosted = etcd_mode() ? StartEtcd() : MaybeHostServer();
    if (!hosted.ok()) {
      log::Error(hosted.message());
      return kExitUsage;
    }
    StatusOr<int> port = ReservePort();
    if (!port.ok()) {
      log::Error(port.status().message());
      return kExitUsage;
    }
    rdzv::ClientOptions co;
    co.host = options_.endpoint_host;
    co.port = options_.endpoint_port;
    co.token = options_.token;
    co.local_address = options_.local_address;
    co.log = [](const std::string& line) { log::Warn(line); };
    co.join = MakeJoin();
    co.join.master_port = *port;
    rdzv::ClientEvents events;
    events.on_assigned = [this](const rdzv::Assignment& a) { OnAssigned(a); };
    events.on_restart = [this](const rdzv::RestartNotice& n) { OnRestart(n); };
    events.on_replaced = [this](const rdzv::ReplaceAnswer& a) { OnReplaced(a); };
    events.on_done = [this] { OnDone(); };
    events.on_failed = [this](const Status& s, const rdzv::JobFailure& f) { OnFailed(s, f); };
    events.on_lost = [this](const Status& s) { OnLost(s); };
    if (etcd_mode()) {
      // The client connects once etcd says where the job's server is (FindServer).
      client_options_ = co;
      client_events_ = events;
      FindServer("", *port);
    } else {
      client_ = rdzv::RendezvousClient::Create(io_, co, events);
      client_->Start();
    }
    io_.run();
    group_.reset();  // kills and reaps anything still running (never expected here)
    etcd_.reset();   // revokes this agent's lease (its claim, if it served)
    return exit_code_;
  }

  bool etcd_mode() const { return !options_.etcd_endpoints.empty(); }

  // rdzv_backend etcd: this agent's lease, and a server of its own listening on its route to
  // the cluster, offered to the job in FindServer (idle unless etcd takes the offer).
  Status StartEtcd() {
    EtcdRendezvousOptions eo;
    eo.etcd.endpoints = options_.etcd_endpoints;
    eo.run_id = options_.run_id;
    eo.lease_ttl_s = std::max(2, static_cast<int>(std::ceil(options_.heartbeat_timeout_s)));
    eo.record_ttl_s = std::max(60, static_cast<int>(std::ceil(options_.join_timeout_s)) + 60);
    auto etcd =
        EtcdRendezvous::Start(io_, eo, [this](const std::string& why) { OnClaimLost(why); });
    if (!etcd.ok()) return etcd.status();
    etcd_ = std::move(*etcd);
    LAUNCH_RETURN_IF_ERROR(OpenStandby());
    log::Info("rendezvous through etcd at " + etcd_->Describe() + " (job '" +
              SanitizeForTerminal(options_.run_id) + "'); this agent offers to serve it at " +
              offer_);
    return Status::Ok();
  }

  // A server of this agent's, listening on a new port, and its endpoint as the offer FindServer
  // makes (idle unless etcd takes it).
  Status OpenStandby() {
    const std::string host =
        !options_.local_address.empty() ? options_.local_address : etcd_->local_address();
    rdzv::ServerOptions so = ServerOptionsAt(host, 0, "serving");
    so.on_record = [this](const rdzv::JobRecord& record) {
      if (etcd_ && server_) etcd_->Keep(record);
    };
    standby_ = rdzv::RendezvousServer::Create(io_, so);
    Status s = standby_->Listen();
    if (!s.ok()) return s;
    offer_ = rdzv::FormatEndpoint(host, standby_->port());
    return Status::Ok();
  }

  // Asks etcd for the job's server (claiming it for this agent's offer when none serves; `lost`:
  // the endpoint just lost, whose claim lapses within the lease's TTL), then connects there
  // with the workers' store port `master_port`.
  void FindServer(const std::string& lost, int master_port) {
    const auto deadline =
        std::chrono::steady_clock::now() +
        std::chrono::milliseconds(static_cast<long long>(options_.join_timeout_s * 1000));
    etcd_->Find(offer_, lost, deadline,
                [this, lost, master_port](StatusOr<EtcdRendezvous::Server> found) {
                  OnServerFound(lost, master_port, std::move(found));
                });
  }

  void OnServerFound(const std::string& lost, int master_port,
                     StatusOr<EtcdRendezvous::Server> found) {
    if (finished_ || interrupt_signal_ != 0) return;
    if (!found.ok()) {
      log::Error(found.status().message());
      if (client_) client_->Close();
      Finish(lost.empty() ? kExitUsage : kExitFailure);
      return;
    }
    if (found->ours && !server_) {
      server_ = std::move(standby_);
      hosted_endpoint_ = offer_;
      claim_lost_ = false;
      if (found->record) {
        const std::string why = lost.empty() ? "the server that held the job is gone"
                                             : "the rendezvous server at " + lost + " was lost";
        log::Info("serving the rendezvous at " + offer_ + ": taking the job over (" + why + ")");
        server_->Resume(*found->record, why);
      } else {
        if (!found->record_error.empty())
          log::Warn("the job's record in etcd cannot be read (" + found->record_error +
                    "): the job starts over at round 0");
        log::Info("serving the rendezvous at " + offer_ + " (claimed in etcd)");
      }
    }
    if (!client_) {
      client_options_.host = found->host;
      client_options_.port = found->port;
      client_options_.join.master_port = master_port;
      client_ = rdzv::RendezvousClient::Create(io_, client_options_, client_events_);
      client_->Start();
    } else {
      client_->Reconnect(master_port, found->host, found->port);
    }
  }

  // etcd no longer holds this agent's claim: another agent may serve the job now. This one
  // stops serving at once and stays in the job as a node (StepDown); its client's connection to
  // the stopped server ends, and OnLost joins the job again wherever etcd says it is served.
  void OnClaimLost(const std::string& why) {
    if (finished_ || !server_) return;
    StepDown(why, /*release_claim=*/false);
  }

  // The serving agent stops serving (rdzv_backend etcd): its server stops, and unless its claim
  // is already gone (`release_claim` false) it gives the claim up in etcd, so that a live agent
  // (this one again, with a new offer) takes the job over from its record at once. It stays in
  // the job as a node with a new offer; without a restart left, or without a new offer, it
  // leaves (exit 1). Returns whether it stays.
  bool StepDown(const std::string& why, bool release_claim) {
    claim_lost_ = true;  // its keys are its successor's: never Forget() them
    const std::string lost = hosted_endpoint_;
    server_->Stop();
    server_.reset();
    hosted_endpoint_.clear();
    if (release_claim) etcd_->Release();
    const Status standby = restarts_left_ > 0 ? OpenStandby() : Status::Ok();
    if (restarts_left_ <= 0 || !standby.ok()) {
      log::Error("this agent stops serving the rendezvous at " + lost + ": " + why +
                 (standby.ok() ? "" : "; " + standby.message()));
      if (client_) client_->Close();
      StopWorkersThen(After::kExit, kExitFailure);
      return false;
    }
    log::Warn("this agent stops serving the rendezvous at " + lost + ": " + why +
              "; it stays in the job as a node and offers " + offer_ + " to serve it again");
    return true;
  }

 private:
  // This node's JOIN, less the workers' store port (reserved after the server is up).
  rdzv::JoinRequest MakeJoin() const {
    rdzv::JoinRequest join;
    join.run_id = options_.run_id;
    join.min_nodes = options_.min_nodes;
    join.max_nodes = options_.max_nodes;
    join.node_rank = options_.node_rank;
    join.local_world_size = options_.local.group.local_world_size;
    join.hostname = !options_.hostname.empty() ? options_.hostname
                    : !Hostname().empty()      ? Hostname()
                                               : "unknown";
    join.fingerprint = options_.fingerprint;
    join.max_restarts = options_.max_restarts;
    join.join_timeout_s = options_.join_timeout_s;
    join.last_call_timeout_s = options_.last_call_timeout_s;
    join.heartbeat_timeout_s = options_.heartbeat_timeout_s;
    join.recover_in_place = options_.local.recover_in_place;
    return join;
  }

  // A server of this agent's at host:port, for this job: its token, liveness and log, and this
  // agent's own JOIN as the spec expected (another job's agent may reach the port before this
  // agent's own JOIN: it must be the one refused, not this job). `role`: "hosting" or
  // "serving", for the refusals' wording.
  rdzv::ServerOptions ServerOptionsAt(const std::string& host, int port, const char* role) const {
    rdzv::ServerOptions so;
    so.host = host;
    so.port = port;
    so.token = options_.token;
    so.default_heartbeat_timeout =
        std::chrono::milliseconds(static_cast<long long>(options_.heartbeat_timeout_s * 1000));
    so.log = [](const std::string& line) { log::Info("rendezvous: " + line); };
    so.expected_join = MakeJoin();
    so.expected_origin = std::string("the agent ") + role + " this rendezvous (host " +
                         SanitizeForTerminal(so.expected_join->hostname) + ")";
    return so;
  }

  Status MaybeHostServer() {
    using Host = ElasticAgentOptions::HostServer;
    if (options_.host_server == Host::kNever) return Status::Ok();
    bool must = options_.host_server == Host::kAlways || options_.node_rank == 0;
    if (!must && options_.node_rank > 0) return Status::Ok();
    // Resolve the endpoint to the address to listen on.
    asio::ip::tcp::resolver resolver(io_);
    boost::system::error_code ec;
    auto results =
        resolver.resolve(options_.endpoint_host, std::to_string(options_.endpoint_port), ec);
    std::string where = rdzv::FormatEndpoint(options_.endpoint_host, options_.endpoint_port);
    if (ec || results.empty())
      return Status::InvalidConfig("cannot resolve rendezvous host '" + options_.endpoint_host +
                                   "' (" + where + "): " + (ec ? ec.message() : "no addresses"));
    auto listen_address = results.begin()->endpoint().address();
    std::string listen_host = listen_address.to_string();
    // A host name that resolves to loopback here (Debian maps the machine's own name to
    // 127.0.1.1) must still be reachable from the other machines: listen on every address.
    boost::system::error_code literal_ec;
    asio::ip::make_address(options_.endpoint_host, literal_ec);
    if (listen_address.is_loopback() && literal_ec && options_.endpoint_host != "localhost")
      listen_host = listen_address.is_v6() ? "::" : "0.0.0.0";
    // A node standing in at another address is not the endpoint's machine.
    if (!must && !options_.local_address.empty() &&
        options_.local_address != listen_address.to_string())
      return Status::Ok();
    rdzv::ServerOptions so = ServerOptionsAt(listen_host, options_.endpoint_port, "hosting");
    auto server = rdzv::RendezvousServer::Create(io_, so);
    Status s = server->Listen();
    if (!s.ok()) {
      // In use: another agent of this job (or a standalone `launch rdzv-server`) hosts it; if
      // it is something else, the client's handshake fails naming the address. Not local: the
      // server runs elsewhere. Either way this agent joins as a client. Remembered: a refusal
      // from that server then means another job holds the port (OnFailed).
      port_taken_ = must;
      return Status::Ok();
    }
    server_ = server;
    hosted_endpoint_ = rdzv::FormatEndpoint(listen_host, server_->port());
    log::Info("hosting the rendezvous at " + hosted_endpoint_);
    return Status::Ok();
  }

  StatusOr<int> ReservePort() {
    StatusOr<int> port = PickFreePort(options_.local_address);
    if (!port.ok())
      return Status::InvalidConfig("cannot reserve a port for the workers' store: " +
                                   port.status().message());
    return port;
  }

  void ArmSignals() {
    signals_.async_wait([this](const boost::system::error_code& ec, int signo) {
      if (ec) return;
      if (signo == kCollectiveReportSignal) {
        if (group_ && group_running_) group_->ReportCollectives();
      } else if (signo == SIGUSR1 || signo == SIGUSR2) {
        log::Info("forwarding " + SignalName(signo) + " to the workers");
        if (group_ && group_running_) group_->Signal(signo);
      } else if (interrupt_signal_ != 0) {
        log::Info("second " + SignalName(signo) + ": killing the workers now");
        if (group_ && group_running_) group_->Kill();
      } else {
        interrupt_signal_ = signo;
        log::Info("received " + SignalName(signo) + ": stopping the workers and leaving the job");
        // The job cannot outlive its rendezvous: tell every agent why now, instead of letting
        // them count this node as lost (a restart round spent) and then lose the server.
        if (server_)
          server_->FailAndStop("the rendezvous host " + hosted_endpoint_ +
                               " is leaving: it received " + SignalName(signo));
        if (client_) client_->Close();
        StopWorkersThen(After::kExit, ExitCodeForSignal(signo), signo);
      }
      ArmSignals();
    });
  }

  enum class After { kNothing, kRejoin, kReconnect, kExit };

  // Stops the workers (when running), then rejoins or exits.
  void StopWorkersThen(After after, int exit_code, int signo = SIGTERM) {
    after_stop_ = after;
    if (after == After::kExit) exit_code_ = exit_code;
    if (group_ && group_running_) {
      group_->Stop(signo);
      RefusePendingReplacements();  // the group ends only once it has every answer
      return;                       // continued in OnGroupDone
    }
    ContinueAfterStop();
  }

  // launch --recover in_place: the rendezvous decides whether a dead worker is replaced alone,
  // since the generation and the restart count are the job's, not this node's.
  void AskReplace(int round, const WorkerExit& e, WorkerGroupSpec::ReplaceDecision decide) {
    if (finished_ || interrupt_signal_ != 0 || round != round_ || after_stop_ != After::kNothing ||
        pending_replacements_.count(e.rank))
      return decide(0);
    rdzv::ReplaceRequest request;
    request.round = round;
    request.global_rank = e.rank;
    request.reason = e.status.ToString();
    if (!client_->AskReplace(request)) return decide(0);
    pending_replacements_[e.rank] = PendingReplacement{e, std::move(decide)};
  }

  void OnReplaced(const rdzv::ReplaceAnswer& a) {
    auto it = pending_replacements_.find(a.global_rank);
    if (it == pending_replacements_.end() || a.round != round_) return;
    PendingReplacement pending = std::move(it->second);
    pending_replacements_.erase(it);
    const WorkerExit& e = pending.exit;
    if (a.generation > 0) {
      restarts_left_ = options_.max_restarts - a.restart_count;
      // The worker's own log says when its replacement redid the step (the recovery's cost).
      log::Info("rank " + std::to_string(e.rank) + " (pid " + std::to_string(e.pid) + ") " +
                e.status.ToString() + ": starting a replacement for rank " +
                std::to_string(e.rank) + " alone; the other workers keep running (restart " +
                std::to_string(a.restart_count) + " of " + std::to_string(options_.max_restarts) +
                ", in place, generation " + std::to_string(a.generation) + ")");
    } else {
      log::Info("rank " + std::to_string(e.rank) + " " + e.status.ToString() +
                " is not replaced in place: " + SanitizeForTerminal(a.message));
    }
    pending.decide(a.generation);
  }

  // No answer will come (the round ends, the server is gone): each dead worker is a failure.
  void RefusePendingReplacements() {
    auto pending = std::move(pending_replacements_);
    pending_replacements_.clear();
    for (auto& [rank, p] : pending) p.decide(0);
  }

  void ContinueAfterStop() {
    After after = after_stop_;
    after_stop_ = After::kNothing;
    if (after == After::kRejoin || after == After::kReconnect) {
      StatusOr<int> port = ReservePort();
      if (!port.ok()) {
        log::Error(port.status().message());
        client_->Close();
        Finish(kExitFailure);
        return;
      }
      if (after == After::kRejoin)
        client_->Rejoin(*port);
      else if (etcd_mode())
        FindServer(client_->endpoint(), *port);
      else
        client_->Reconnect(*port);
    } else if (after == After::kExit) {
      Finish(exit_code_);
    }
  }

  void OnAssigned(const rdzv::Assignment& a) {
    if (finished_ || interrupt_signal_ != 0) return;
    round_ = a.round;
    restarts_left_ = a.max_restarts - a.restart_count;
    WorkerGroupSpec spec = options_.local.group;
    spec.local_world_size = a.local_world_size;
    spec.rank_offset = a.rank_offset;
    spec.world_size = a.world_size;
    spec.group_rank = a.node_rank;
    spec.group_world_size = a.num_nodes;
    spec.master_addr = a.master_addr;
    spec.master_port = a.master_port;
    spec.restart_count = a.restart_count;
    spec.max_restarts = a.max_restarts;
    spec.run_id = a.run_id;
    spec.recover_generation = a.generation;
    if (a.generation > 0 && a.lost_ms_ago > 0) {
      spec.recover_lost_at =
          std::chrono::system_clock::now() - std::chrono::milliseconds(a.lost_ms_ago);
      spec.recover_lost_by = "the rendezvous (node " + std::to_string(a.node_rank) + " lost)";
    }
    const int assigned_round = a.round;
    if (options_.local.recover_in_place) {
      // A survivor waits for a replacement until the rendezvous has given up on one: it notices
      // a lost node within LossDeadline(heartbeat_timeout), waits join_timeout for a node to
      // take its place, whose workers then need a moment to start (kReplacementStart). After
      // that the rendezvous restarts every node, which stops the survivors anyway.
      const std::chrono::milliseconds heartbeat(
          static_cast<long long>(options_.heartbeat_timeout_s * 1000));
      const std::chrono::duration<double> wait =
          std::chrono::duration<double>(options_.join_timeout_s) + rdzv::LossDeadline(heartbeat) +
          kReplacementStart;
      if (BaseEnvironment(spec).count("LAUNCH_RECOVER_WAIT_S") == 0)
        spec.extra_env["LAUNCH_RECOVER_WAIT_S"] =
            std::to_string(static_cast<long long>(std::ceil(wait.count())));
      spec.replace_in_place = [this, assigned_round](const WorkerExit& e,
                                                     WorkerGroupSpec::ReplaceDecision decide) {
        AskReplace(assigned_round, e, std::move(decide));
      };
    }
    if (options_.export_socket_interfaces) ExportSocketInterfaces(&spec);
    if (!options_.local.log_root.empty()) {
      spec.log_dir = options_.local.log_root + "/attempt_" + std::to_string(a.round);
      Status s = MakeDirs(spec.log_dir);
      if (!s.ok()) log::Warn(s.message() + "; no per-rank log files this round");
      if (!s.ok()) spec.log_dir.clear();
    }
    log::Info("round " + std::to_string(a.round) + ": node " + std::to_string(a.node_rank) +
              " of " + std::to_string(a.num_nodes) + ", ranks " + std::to_string(a.rank_offset) +
              "-" + std::to_string(a.rank_offset + a.local_world_size - 1) + " of " +
              std::to_string(a.world_size) + ", master " +
              rdzv::FormatEndpoint(a.master_addr, a.master_port));
    if (a.generation > 0)
      log::Info("taking a lost node's place in the running round " + std::to_string(a.round) +
                ": the workers join the others' in-place recovery as generation " +
                std::to_string(a.generation));
    group_ = make_group_(io_);
    int round = a.round;
    reported_round_ = -1;
    // Report the first failure as soon as it is known, before the siblings are stopped (that
    // can take stop_grace): the server takes the earliest failure of the round as the root
    // cause, and only reports it has received count.
    group_->OnFirstFailure([this, round](const WorkerExit& first) { Report(round, first); });
    Status started =
        group_->Start(spec, [this, round](const GroupResult& r) { OnGroupDone(round, r); });
    if (!started.ok()) {
      group_running_ = false;
      log::Error(started.message());
      rdzv::FailureReport report;
      report.round = round;
      report.reason = "could not start the workers: " + started.message();
      client_->ReportFailure(report);
      return;
    }
    group_running_ = true;
  }

  // GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME for this round's workers where PyTorch would bind
  // loopback (socket_interfaces.h); the reason is logged once, and again only if it changes (a
  // re-formed round with another master).
  void ExportSocketInterfaces(WorkerGroupSpec* spec) {
    const SocketInterfaceExport e = ChooseSocketInterfaces(ProbeSocketInterfaceFacts(
        spec->group_world_size, spec->master_addr, BaseEnvironment(*spec)));
    for (const auto& [k, v] : e.env) spec->extra_env[k] = v;
    if (e.message.empty() || e.message == told_interfaces_) return;
    told_interfaces_ = e.message;
    if (e.env.empty())
      log::Warn(e.message);
    else
      log::Info(e.message);
  }

  void OnGroupDone(int round, const GroupResult& result) {
    group_running_ = false;
    if (after_stop_ != After::kNothing) {
      ContinueAfterStop();
      return;
    }
    if (finished_ || round != round_) return;
    if (result.outcome == GroupResult::Outcome::kSucceeded) {
      log::Info("local workers finished; waiting for the other nodes");
      client_->ReportSuccess(round);
      return;
    }
    if (result.failures.empty()) return;     // stopped without a failure of its own
    Report(round, result.failures.front());  // unless OnFirstFailure already did
  }

  // Sends the round's failure report once.
  void Report(int round, const WorkerExit& first) {
    if (finished_ || round != round_ || reported_round_ == round) return;
    reported_round_ = round;
    rdzv::FailureReport report;
    report.round = round;
    report.global_rank = first.rank;
    report.local_rank = first.local_rank;
    report.exit_code = first.status.signaled ? -1 : std::min(first.status.code, 255);
    report.signal = first.status.signaled ? first.status.signal : 0;
    report.reason = first.status.ToString();
    report.stderr_tail = Join(first.stderr_tail, "\n");
    if (!first.error_message.empty())  // its TORCHELASTIC_ERROR_FILE says more than stderr
      report.stderr_tail = "error: " + first.error_message + "\n" + first.error_traceback;
    // Every node's report shows it: the interpreter is this node's.
    std::string hint =
        MissingModuleHint(first, options_.local.python, options_.local.python_choice);
    if (!hint.empty()) report.stderr_tail += "\n" + hint;
    report.time_us =
        std::chrono::duration_cast<std::chrono::microseconds>(first.time.time_since_epoch())
            .count();
    log::Info("local worker rank " + std::to_string(first.rank) + " " + first.status.ToString() +
              "; reported to the rendezvous");
    client_->ReportFailure(report);
  }

  void OnRestart(const rdzv::RestartNotice& n) {
    if (finished_) return;
    std::string text = std::string(n.counts_as_restart ? "restarting" : "re-forming") +
                       " every node (round " + std::to_string(n.next_round) +
                       "): " + SanitizeForTerminal(n.reason);
    log::Info(text);
    if (n.report) PrintReport(*n.report);
    StopWorkersThen(After::kRejoin, 0);
  }

  void OnDone() {
    if (finished_) return;
    log::Info("job done: every node finished");
    StopWorkersThen(After::kExit, 0);
  }

  void OnFailed(const Status& status, const rdzv::JobFailure& failure) {
    if (finished_) return;
    // The rendezvous decides before and between runs: a timeout there means nothing ran.
    int code = ExitCodeFor(status, Phase::kSetup);
    if (status.code() == Status::Code::kWorkerFailed)
      code = failure.report && failure.report->global_rank >= 0 ? ExitCodeForReport(*failure.report)
                                                                : kExitFailure;
    if (interrupt_signal_ != 0) return;  // our own leaving; the signal decides the exit code
    log::Error(SanitizeForTerminal(status.message()));
    const bool foreign_id = status.message().find("run_id mismatch") != std::string::npos;
    if (port_taken_ && (foreign_id || status.code() == Status::Code::kAuthFailed)) {
      log::Error(
          "machine_rank " + std::to_string(options_.node_rank) +
          " was to host the rendezvous, but " +
          rdzv::FormatEndpoint(options_.endpoint_host, options_.endpoint_port) +
          " was already taken on this machine, by another job's rendezvous (" +
          (foreign_id ? "its run id is the other one above" : "it refused this job's rdzv_token") +
          "): give this job its own --master_port, or stop the other job");
    } else if (foreign_id && options_.run_id_derived) {
      log::Info(
          "a run id that --rdzv_id does not give is derived from the node's command: the "
          "program (and its file's contents), its arguments, the trainer's settings, "
          "--nnodes and --max_restarts. The nodes ran different commands (or another "
          "job's nodes joined this rendezvous): run the same command everywhere, or give "
          "every node the same --rdzv_id");
    }
    if (failure.report) PrintReport(*failure.report);
    StopWorkersThen(After::kExit, code);
  }

  // The server went away without a last word (its connection closed or timed out). The host's
  // own loss ends the job: the rendezvous (and the round's state) went with it. Another agent
  // was most likely cut off by the network: it does what a restarted `launch` with the same
  // machine_rank would do, stop its workers and join again (until join_timeout), and the server
  // takes it back in place of the session it lost (one restart). With no restart left that
  // loss ends the job anyway, so it leaves at once.
  void OnLost(const Status& status) {
    if (finished_ || interrupt_signal_ != 0) return;
    std::string why = SanitizeForTerminal(status.message());
    // rdzv_backend etcd: the serving agent lost its own connection to its own server, which
    // happens when the agent's process stalled past the heartbeat timeout (every node, this
    // one included, timed out in its server at once): a server that lost every node cannot go
    // on, and another agent may have taken the job over meanwhile. It steps down and, as a
    // node, joins the job wherever etcd says it is served.
    if (etcd_mode() && server_ &&
        !StepDown("it lost its own connection to it (" + why + ")", /*release_claim=*/true))
      return;
    if (server_ || restarts_left_ <= 0) {
      log::Error(why + (server_ || round_ < 0 ? "" : "; no restart left to re-join with"));
      client_->Close();
      StopWorkersThen(After::kExit, kExitFailure);
      return;
    }
    std::string rank =
        options_.node_rank >= 0 ? "machine_rank " + std::to_string(options_.node_rank) : "a node";
    log::Warn(why + "; stopping the workers and joining again as " + rank +
              (etcd_mode() ? " wherever etcd says the job is served (a surviving agent takes it "
                             "over)"
                           : "") +
              " (for up to " + std::to_string(static_cast<long long>(options_.join_timeout_s)) +
              " s, join_timeout)");
    StopWorkersThen(After::kReconnect, 0);
  }

  void PrintReport(const rdzv::FailureReport& r) {
    if (!options_.print_failure_report) return;
    std::string text = rdzv::FormatFailureReport(r);
    for (const std::string& line : Split(text, '\n')) log::Info(line);
  }

  void Finish(int code) {
    if (finished_) return;
    RefusePendingReplacements();
    finished_ = true;
    exit_code_ = code;
    if (client_) client_->Close();
    drain_deadline_ = std::chrono::steady_clock::now() + kServerDrainLimit;
    Drain();
  }

  // The hosting agent waits (bounded) until its server has said goodbye to every agent.
  void Drain() {
    if (!server_ || server_->connection_count() == 0 ||
        std::chrono::steady_clock::now() >= drain_deadline_) {
      if (server_) server_->Stop();
      if (standby_) standby_->Stop();
      // The job is over: its keys go (a server whose claim lapsed leaves them to its successor).
      if (etcd_ && server_ && !claim_lost_) etcd_->Forget();
      signals_.cancel();
      io_.stop();
      return;
    }
    drain_timer_.expires_after(std::chrono::milliseconds(5));
    drain_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (!ec) Drain();
    });
  }

  const ElasticAgentOptions& options_;
  asio::io_context& io_;
  const GroupFactory& make_group_;
  asio::signal_set signals_;
  asio::steady_timer drain_timer_;
  std::chrono::steady_clock::time_point drain_deadline_;
  std::shared_ptr<rdzv::RendezvousServer> server_;
  // rdzv_backend etcd: the cluster, this agent's listening server while etcd has not taken its
  // offer, that offer ("host:port"), and what the client is made with once the server is found.
  std::unique_ptr<EtcdRendezvous> etcd_;
  std::shared_ptr<rdzv::RendezvousServer> standby_;
  std::string offer_;
  rdzv::ClientOptions client_options_;
  rdzv::ClientEvents client_events_;
  bool claim_lost_ = false;
  bool port_taken_ = false;  // machine_rank 0 found the rendezvous port in use (MaybeHostServer)
  std::string hosted_endpoint_;  // host:port of server_, for messages
  std::shared_ptr<rdzv::RendezvousClient> client_;
  std::unique_ptr<GroupSupervisor> group_;
  bool group_running_ = false;
  struct PendingReplacement {
    WorkerExit exit;
    WorkerGroupSpec::ReplaceDecision decide;
  };
  // Dead workers whose REPLACE the server has not answered yet, by global rank.
  std::map<int, PendingReplacement> pending_replacements_;
  After after_stop_ = After::kNothing;
  int round_ = -1;
  // Restarts the job has left as of this node's latest assignment; before the first
  // assignment nothing has run, so a lost server is simply joined again.
  int restarts_left_ = 1;
  int reported_round_ = -1;  // the round whose failure this agent has reported
  int interrupt_signal_ = 0;
  bool finished_ = false;
  int exit_code_ = 1;
  std::string told_interfaces_;  // the last socket-interface message logged
};

}  // namespace

int RunElasticAgent(const ElasticAgentOptions& options) {
  asio::io_context io;
  return RunElasticAgent(options, io, [](asio::io_context& ctx) {
    return std::unique_ptr<GroupSupervisor>(new WorkerGroup(ctx));
  });
}

int RunElasticAgent(const ElasticAgentOptions& options, asio::io_context& io,
                    const GroupFactory& make_group) {
  ElasticAgent agent(options, io, make_group);
  return agent.Run();
}

}  // namespace launch::agent
