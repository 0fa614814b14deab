#pragma once

// RendezvousClient: the agent's side of the rendezvous, asynchronous on the agent's own
// io_context (the same one that supervises its workers), reporting through callbacks.
//
//   auto client = RendezvousClient::Create(io, options, events);
//   client->Start();                      // connect (retrying), authenticate, JOIN round 0
//   ... events.on_assigned(assignment)    // start workers with it
//   client->ReportFailure(report);        // a local worker failed (after stopping the others)
//   client->ReportSuccess(round);         // every local worker exited 0
//   ... events.on_restart(notice)         // stop workers, then:
//   client->Rejoin(new_master_port);
//   ... events.on_done() / events.on_failed(status, failure)   // terminal: exit
//   ... events.on_lost(status)            // the server is gone, not terminal: stop workers, then:
//   client->Reconnect(new_master_port);   // connect, authenticate and JOIN again, as Start()
//
// Connection: every attempt resolves the endpoint again and tries each address it resolves to
// in order. A failed resolution (a DNS blip, or a name that appears only once the server's
// machine is up, as a Kubernetes pod's does), refused or unreachable connections, no handshake
// within handshake_timeout after connecting (a server busy with a flood of strangers), and a
// "busy" ERROR before the server took our JOIN (its caps and deadlines for strangers, server.h)
// are retried with backoff until join_timeout (the server may start after the clients), then
// Timeout naming the last error; the first failed resolution and the first missing handshake
// are logged at once, so a misspelt name shows. An endpoint that never said a word in
// kSilentHandshakesBeforeGivingUp connections is a port held by something else: ProtocolError
// naming it. Every read has a deadline (handshake_timeout before the server is authenticated,
// the liveness of protocol.h after); heartbeats go out every heartbeat_timeout / 5.
//
// Losing the server (its connection closed or timed out, with no DONE, FAILED or ERROR) ends
// the client with on_failed(PeerLost) when on_lost is null. Otherwise on_lost fires and the
// client waits for Reconnect(), which goes through Start()'s path again with the same JoinRequest
// (the same machine_rank), so the server takes it back as it would a restarted agent. While
// reconnecting, a failed handshake is retried like a failed connect (the server was a launch
// server a moment ago); a refused connection ends it at once with on_failed(PeerLost) (nothing
// listens there any more: the hosting agent is gone); so does join_timeout without success.
//
// Terminal events fire exactly once, and nothing fires after them or after Close().
// on_failed's Status code tells the exit code: InvalidConfig / AuthFailed / Timeout (setup
// errors, exit 2), WorkerFailed (a worker failure ended the job), PeerLost (the server went away).
//
// Thread-safety: none; use from the io_context's thread. Lifetime: Create(); Close() before
// dropping the last reference (pending handlers keep the object alive until they run).

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio.hpp>

#include "base/status.h"
#include "rendezvous/protocol.h"

namespace launch::rendezvous {

class Connection;

struct ClientOptions {
  std::string host = "127.0.0.1";  // server host name or address (IPv4 or IPv6)
  int port = 29500;
  std::string token;          // shared secret; empty = none
  std::string local_address;  // bind to this address before connecting ("" = any); lets
                              // one machine stand in for several nodes (127.0.0.2, ...)
  JoinRequest join;           // what to send; join.join_timeout_s bounds connecting and
                              // join.heartbeat_timeout_s sets the liveness deadlines
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds write_timeout{5000};
  std::chrono::milliseconds max_retry_delay{500};  // connect backoff cap (starts at 20 ms)
  // Warnings while connecting ("cannot resolve ... yet"). Null = silent.
  std::function<void(const std::string&)> log;
};

struct ClientEvents {
  std::function<void(const Assignment&)> on_assigned;
  std::function<void(const RestartNotice&)> on_restart;
  // The answer to AskReplace.
  std::function<void(const ReplaceAnswer&)> on_replaced;
  std::function<void()> on_done;
  std::function<void(const Status&, const JobFailure&)> on_failed;
  // The server was lost (PeerLost, naming it); see the header comment. Null = terminal.
  std::function<void(const Status&)> on_lost;
};

// Connections to an endpoint that never answered before it is named as not a launch server.
inline constexpr int kSilentHandshakesBeforeGivingUp = 3;

class RendezvousClient : public std::enable_shared_from_this<RendezvousClient> {
 public:
  static std::shared_ptr<RendezvousClient> Create(boost::asio::io_context& io,
                                                  ClientOptions options, ClientEvents events);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  // REQUIRES: called once.
  void Start();
  // After on_restart: join the next round. `master_port` is a freshly reserved free port
  // (0 keeps the previous one).
  void Rejoin(int master_port);
  // After on_lost: connect and JOIN again (retrying until join_timeout from now).
  // `master_port` as for Rejoin. `host`/`port`: the server's new endpoint when another host
  // took the job over (etcd backend); empty keeps the endpoint. Ignored unless the client is
  // lost.
  void Reconnect(int master_port, const std::string& host = "", int port = 0);
  void ReportFailure(const FailureReport& report);
  // REPLACE: may a dead worker be replaced alone? The answer comes through on_replaced. False
  // when nothing was sent (no session with the server now): the caller treats that as a no.
  bool AskReplace(const ReplaceRequest& request);
  void ReportSuccess(int round);
  // Closes the connection; no callback fires afterwards. Idempotent.
  void Close();

  // "host:port" of the server, for messages.
  const std::string& endpoint() const { return endpoint_text_; }

 private:
  RendezvousClient(boost::asio::io_context& io, ClientOptions options, ClientEvents events);
  void Resolve();
  void Connect();
  void RetryLater(const std::string& why);
  void OnConnected(boost::asio::ip::tcp::socket socket);
  void OnFrame(MessageType type, Fields fields);
  void OnClosed(const Status& why);
  // Forgets the connection and its handshake state (the session is over).
  void DropConnection();
  // Drops the connection before the server took our JOIN and connects again later.
  void RetryConnection(const std::string& why);
  void ArmHeartbeat();
  void Fail(Status status, JobFailure failure);
  // Send, or Fail when the message cannot be sent (larger than the protocol allows).
  void SendOrFail(MessageType type, const Fields& fields);
  std::chrono::milliseconds HeartbeatTimeout() const;

  boost::asio::io_context& io_;
  ClientOptions options_;
  ClientEvents events_;
  std::string endpoint_text_;
  boost::asio::ip::tcp::resolver resolver_;
  boost::asio::steady_timer retry_timer_;
  boost::asio::steady_timer heartbeat_timer_;
  std::vector<boost::asio::ip::tcp::endpoint> endpoints_;  // from the latest resolution
  size_t next_endpoint_ = 0;                               // the one Connect() tries
  // When RetryLater last said why it waits (at once, then every kWaitReport).
  std::optional<std::chrono::steady_clock::time_point> reported_wait_;
  static constexpr std::chrono::seconds kWaitReport{10};
  std::chrono::steady_clock::time_point deadline_;
  std::chrono::milliseconds retry_delay_{20};
  std::string last_connect_error_;
  std::shared_ptr<Connection> conn_;
  std::string nonce_;
  std::string server_nonce_;
  bool welcomed_ = false;
  bool lost_ = false;                 // on_lost fired; waiting for Reconnect()
  bool reconnecting_ = false;         // between Reconnect() and the next WELCOME
  bool heard_since_welcome_ = false;  // a frame after WELCOME on this connection
  bool heard_from_server_ = false;    // any frame from the endpoint, ever
  int silent_handshakes_ = 0;         // connections the endpoint never said a word on
  bool warned_handshake_ = false;
  bool finished_ = false;  // terminal event delivered or Close() called
};

}  // namespace launch::rendezvous
