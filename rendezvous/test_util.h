#pragma once

// Test helpers for rendezvous_test: a server on 127.0.0.1:<free port> and recording clients,
// all on one io_context that the test drives with RunUntil().

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio.hpp>

#include "rendezvous/client.h"
#include "rendezvous/server.h"

namespace launch::rendezvous::testing {

namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

// Runs `io` until `done()` or `timeout` passes; returns done().
inline bool RunUntil(asio::io_context& io, const std::function<bool()>& done,
                     std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  auto deadline = Clock::now() + timeout;
  while (!done() && Clock::now() < deadline) {
    io.restart();
    io.run_for(std::chrono::milliseconds(5));
  }
  return done();
}

// Everything one client was told.
struct Recorder {
  std::vector<Assignment> assignments;
  std::vector<RestartNotice> restarts;
  bool done = false;
  std::optional<Status> failed;
  std::optional<JobFailure> failure;
  std::shared_ptr<RendezvousClient> client;
  bool finished() const { return done || failed.has_value(); }
};

inline JoinRequest Join(int min_nodes, int max_nodes, int node_rank, int local_world_size = 1,
                        const std::string& host = "host") {
  JoinRequest j;
  j.run_id = "test";
  j.min_nodes = min_nodes;
  j.max_nodes = max_nodes;
  j.node_rank = node_rank;
  j.local_world_size = local_world_size;
  j.master_port = 30000 + (node_rank < 0 ? 999 : node_rank);
  j.hostname = host;
  j.fingerprint = "fp";
  j.join_timeout_s = 5;
  j.last_call_timeout_s = 0.2;
  j.heartbeat_timeout_s = 1;
  return j;
}

class Harness {
 public:
  // `listen_host`: where the server listens (clients connect there too).
  explicit Harness(ServerOptions options = {}, const std::string& listen_host = "127.0.0.1")
      : client_host(listen_host) {
    options.host = listen_host;
    if (options.port == 29500) options.port = 0;
    options.log = [this](const std::string& line) { log.push_back(line); };
    server = RendezvousServer::Create(io, options);
    Status s = server->Listen();
    LAUNCH_CHECK(s.ok(), s.ToString());
  }
  ~Harness() {
    for (auto& r : recorders)
      if (r->client) r->client->Close();
    server->Stop();
    io.restart();
    io.run_for(std::chrono::milliseconds(20));
  }

  // Creates and starts a client; `auto_rejoin` re-joins right after a RESTART.
  Recorder& AddClient(JoinRequest join, const std::string& token = "", bool auto_rejoin = true,
                      int port = -1) {
    auto rec = std::make_unique<Recorder>();
    Recorder* r = rec.get();
    ClientOptions options;
    options.host = client_host;
    options.local_address = client_local_address;
    options.port = port >= 0 ? port : server->port();
    options.token = token;
    options.join = join;
    options.handshake_timeout = client_handshake_timeout;
    ClientEvents events;
    events.on_assigned = [r](const Assignment& a) { r->assignments.push_back(a); };
    events.on_restart = [r, auto_rejoin](const RestartNotice& n) {
      r->restarts.push_back(n);
      if (auto_rejoin) r->client->Rejoin(0);
    };
    events.on_done = [r]() { r->done = true; };
    events.on_failed = [r](const Status& s, const JobFailure& f) {
      r->failed = s;
      r->failure = f;
    };
    r->client = RendezvousClient::Create(io, options, events);
    r->client->Start();
    recorders.push_back(std::move(rec));
    return *r;
  }

  bool LogContains(const std::string& needle) const {
    for (const auto& l : log)
      if (l.find(needle) != std::string::npos) return true;
    return false;
  }

  asio::io_context io;
  std::shared_ptr<RendezvousServer> server;
  // For clients added from now on: where they connect, the address they connect from ("" =
  // any), how long they wait for the server's side of the handshake.
  std::string client_host;
  std::string client_local_address;
  std::chrono::milliseconds client_handshake_timeout{1000};
  std::vector<std::string> log;
  std::vector<std::unique_ptr<Recorder>> recorders;
};

}  // namespace launch::rendezvous::testing
