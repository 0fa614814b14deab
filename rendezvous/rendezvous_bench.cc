// Rendezvous scale benchmark ("agents-only" mode): one server and N agents in one process,
// each agent a real RendezvousClient on its own TCP connection over loopback. Measures the
// time from starting the agents until every agent holds its assignment, then until every agent
// has seen DONE after reporting success; and, with --kill, how long the server takes to tell
// the survivors after one agent's connection drops.
//
//   rendezvous_bench --agents 256 [--kill] [--heartbeat_timeout 5]
//
// Prints one JSON line. Server and agents run on two threads (two io_contexts), as they would
// on two machines' worth of event loops.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/files.h"
#include "base/strings.h"
#include "rendezvous/client.h"
#include "rendezvous/server.h"

using namespace launch::rendezvous;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  int agents = 8;
  bool kill_one = false;
  double heartbeat = 5;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    long long v = 0;
    if (a == "--agents" && i + 1 < argc && launch::ParseInt64(argv[++i], &v)) {
      agents = static_cast<int>(v);
    } else if (a == "--kill") {
      kill_one = true;
    } else if (a == "--heartbeat_timeout" && i + 1 < argc) {
      launch::ParseDouble(argv[++i], &heartbeat);
    } else {
      std::fprintf(stderr, "usage: rendezvous_bench --agents N [--kill] [--heartbeat_timeout S]\n");
      return 2;
    }
  }
  launch::RaiseDescriptorLimit();  // two descriptors per agent (both ends of its connection)

  boost::asio::io_context server_io, client_io;
  ServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  auto server = RendezvousServer::Create(server_io, so);
  launch::Status listen = server->Listen();
  if (!listen.ok()) {
    std::fprintf(stderr, "%s\n", listen.ToString().c_str());
    return 1;
  }
  auto server_guard = boost::asio::make_work_guard(server_io);
  std::thread server_thread([&] { server_io.run(); });

  std::atomic<int> reassigned{0}, assigned{0}, done{0}, failed{0}, restarted{0};
  std::vector<std::shared_ptr<RendezvousClient>> clients;
  Clock::time_point start = Clock::now(), all_assigned{}, all_done{}, killed_at, first_notice;
  std::atomic<bool> noticed{false};
  for (int i = 0; i < agents; ++i) {
    ClientOptions co;
    co.host = "127.0.0.1";
    co.port = server->port();
    co.join.run_id = "bench";
    co.join.min_nodes = kill_one ? 1 : agents;
    co.join.max_nodes = agents;
    co.join.node_rank = -1;
    co.join.local_world_size = 1;
    co.join.master_port = 40000;
    co.join.hostname = "agent" + std::to_string(i);
    co.join.fingerprint = "fp";
    co.join.max_restarts = kill_one ? 1 : 0;
    co.join.join_timeout_s = 60;
    co.join.last_call_timeout_s = 1;
    co.join.heartbeat_timeout_s = heartbeat;
    co.handshake_timeout = std::chrono::milliseconds(30000);
    ClientEvents ev;
    ev.on_assigned = [&](const Assignment& a) {
      if (a.round > 0) {
        ++reassigned;
        return;
      }
      if (++assigned == agents) all_assigned = Clock::now();
    };
    ev.on_restart = [&, i](const RestartNotice&) {
      if (!noticed.exchange(true)) first_notice = Clock::now();
      ++restarted;
      clients[i]->Rejoin(0);
    };
    ev.on_done = [&]() {
      if (++done == agents) all_done = Clock::now();
    };
    ev.on_failed = [&](const launch::Status& s, const JobFailure&) {
      ++failed;
      std::fprintf(stderr, "agent failed: %s\n", s.ToString().c_str());
    };
    clients.push_back(RendezvousClient::Create(client_io, co, ev));
  }
  for (auto& c : clients) c->Start();
  auto run_until = [&](auto pred, double seconds) {
    auto deadline =
        Clock::now() + std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
    while (!pred() && Clock::now() < deadline && failed == 0) {
      client_io.restart();
      client_io.run_for(std::chrono::milliseconds(2));
    }
    return pred();
  };
  bool ok = run_until([&] { return assigned == agents; }, 60);
  double kill_ms = -1;
  if (ok && kill_one) {
    // The last agent's connection drops, as when its process is SIGKILLed.
    killed_at = Clock::now();
    clients.back()->Close();
    ok = run_until([&] { return restarted == agents - 1; }, 60);
    kill_ms = std::chrono::duration<double, std::milli>(first_notice - killed_at).count();
    ok = ok && run_until([&] { return reassigned == agents - 1; }, 60);
    clients.pop_back();
    agents -= 1;
  }
  // -1: not reached (an agent failed or the 60 s bound passed).
  auto since_start = [&](Clock::time_point t) {
    return t < start ? -1.0 : std::chrono::duration<double, std::milli>(t - start).count();
  };
  double assign_ms = since_start(all_assigned);
  if (ok) {
    int round = server->round();
    for (auto& c : clients) c->ReportSuccess(round);
    ok = run_until([&] { return done == agents; }, 60);
  }
  double done_ms = since_start(all_done);
  for (auto& c : clients) c->Close();
  boost::asio::post(server_io, [&] { server->Stop(); });
  server_guard.reset();
  server_thread.join();
  std::printf(
      "{\"agents\": %d, \"ok\": %s, \"all_assigned_ms\": %.1f, \"all_done_ms\": %.1f, "
      "\"loss_notice_ms\": %.2f}\n",
      kill_one ? agents + 1 : agents, ok ? "true" : "false", assign_ms, done_ms, kill_ms);
  return ok ? 0 : 1;
}
