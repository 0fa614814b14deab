#pragma once

// EtcdRendezvous: an agent's side of `launch --rdzv_backend etcd`. The rendezvous protocol and
// its decisions stay launch's own (rendezvous/server.h, round_machine.h); etcd decides which
// agent serves them, and keeps what the job must not forget when that agent's machine is lost.
//
//   auto etcd = EtcdRendezvous::Start(io, options, on_claim_lost);  // grants this agent's lease
//   etcd->Find(offer, /*lost=*/"", deadline, done);   // done(server): connect there; `ours`:
//                                                      // this agent's offer won, serve it
//   etcd->Keep(record);        // the serving agent: the job's record, after each change
//   ... the server is lost:
//   etcd->Find(offer, lost_endpoint, deadline, done); // the next server; `ours` with the record
//   etcd->Forget();            // the serving agent at the job's end: its keys go
//
// Keys, under "<prefix><run_id>/":
//   server  "host:port" of the agent serving the rendezvous, attached to that agent's lease
//           (TTL lease_ttl_s, renewed every third of it): it disappears within lease_ttl_s of
//           the agent's machine going, and the first survivor to ask claims it (one
//           transaction: created only when absent, so exactly one agent serves at a time).
//   record  the job's record (round_machine.h JobRecord: spec, round, restarts, generations),
//           attached to a second lease of the serving agent with TTL record_ttl_s: it outlives
//           the agent long enough for the next one to resume from it, and no job's record stays
//           in the cluster longer than that after the job's last agent is gone.
//
// A serving agent whose lease lapsed (etcd said it is gone, or no renewal got through for
// lease_ttl_s: it is cut off from the cluster's majority, where another agent may claim the job
// now), or whose record write found another agent named as the server, must stop serving:
// `on_claim_lost` fires once per claim, on the io_context's thread. The record is written only
// while the server key names this agent (a fenced transaction), so a server that lost its claim
// unseen cannot overwrite its successor's record. The agent may claim the job again later (a
// new offer, through Find).
//
// Every etcd request runs on this object's own thread (each one bounded by the client's
// request_timeout per member, etcd_client.h), never on the agent's io_context thread, which
// supervises the workers and the rendezvous connections; results are posted back to it.
//
// Thread-safety: the public methods are for the io_context's thread. Lifetime: destroy before
// the io_context; the destructor stops the thread and revokes both leases (bounded).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <boost/asio.hpp>

#include "base/status.h"
#include "rendezvous/etcd_client.h"
#include "rendezvous/round_machine.h"

namespace launch::agent {

struct EtcdRendezvousOptions {
  rendezvous::EtcdOptions etcd;
  std::string prefix = "/launch/";
  std::string run_id;
  int lease_ttl_s = 10;    // how soon a lost serving agent's claim lapses
  int record_ttl_s = 660;  // how long a job record outlives the last agent that kept it
};

class EtcdRendezvous {
 public:
  struct Server {
    std::string host;
    int port = 0;
    bool ours = false;  // this agent's offer was claimed: it serves the job now
    // With `ours`: the job's record a lost server left (resume from it), if any.
    std::optional<rendezvous::JobRecord> record;
    std::string record_error;  // a record was there but could not be read
  };
  using FoundFn = std::function<void(StatusOr<Server>)>;

  // Grants this agent's lease: an error (PeerLost naming every member and why) when the cluster
  // cannot be reached, before anything else starts. Each member gets at most a quarter of the
  // lease's TTL per request (options.etcd.request_timeout, lowered to it): a member that went
  // silent delays one renewal by that much before the next member answers, never by the
  // lease's whole life.
  static StatusOr<std::unique_ptr<EtcdRendezvous>> Start(
      boost::asio::io_context& io, EtcdRendezvousOptions options,
      std::function<void(const std::string&)> on_claim_lost);
  ~EtcdRendezvous();
  EtcdRendezvous(const EtcdRendezvous&) = delete;
  EtcdRendezvous& operator=(const EtcdRendezvous&) = delete;

  // This machine's address on its route to the cluster: where its server listens.
  const std::string& local_address() const { return local_address_; }
  // "a:2379, b:2379" for messages.
  std::string Describe() const { return described_; }

  // Finds the job's server: the one published, unless it is `lost` (the endpoint just lost,
  // still published until its lease lapses), or else claims the job for `offer` ("host:port"
  // of this agent's listening server). Retries until `deadline`, then Timeout naming the last
  // etcd error. `done` runs on the io_context's thread. A second Find replaces the first.
  void Find(std::string offer, std::string lost, std::chrono::steady_clock::time_point deadline,
            FoundFn done);
  // The serving agent: stores the job's record (written by the thread; the newest wins).
  void Keep(const rendezvous::JobRecord& record);
  // The serving agent at the job's end: deletes the job's keys (bounded, synchronous).
  void Forget();
  // The serving agent steps down (its server stopped): its claim goes (its lease revoked: the
  // server key with it; the record stays for the next server), before any Find made after this
  // call. This agent then serves again only through a new Find.
  void Release();

 private:
  EtcdRendezvous(boost::asio::io_context& io, EtcdRendezvousOptions options,
                 rendezvous::EtcdClient client,
                 std::function<void(const std::string&)> on_claim_lost);
  void Loop();
  // One attempt of the pending Find (the lock is not held): a result, or nullopt to retry.
  std::optional<StatusOr<Server>> TryFind(const std::string& offer, const std::string& lost);
  void Renew(std::chrono::steady_clock::time_point now);
  // Puts the record on the record lease (granted when there is none, or again once when it
  // lapsed); a failure leaves it to the next change or renewal.
  void WriteRecord(const std::string& text);
  // Tells the agent, once, that it must stop serving.
  void ClaimLost(const std::string& why);
  // Release()'s work, on the thread: the claim's lease revoked, a new one granted.
  void GiveUpClaim();

  boost::asio::io_context& io_;
  EtcdRendezvousOptions options_;
  rendezvous::EtcdClient client_;  // used by the thread only (after Start)
  std::function<void(const std::string&)> on_claim_lost_;
  std::string local_address_;
  std::string described_;
  std::string server_key_, record_key_;
  int64_t lease_ = 0;          // this agent's (the server key's)
  int64_t record_lease_ = 0;   // the serving agent's record lease (0: none yet)
  bool serving_ = false;       // this agent's offer was claimed
  std::string serving_offer_;  // ... that offer: what the server key holds while it serves
  std::chrono::steady_clock::time_point last_renewed_;
  bool told_claim_lost_ = false;
  std::string last_record_;  // the newest record written (again, when its lease lapsed)
  std::string find_error_;   // the last etcd error of a Find attempt

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  struct PendingFind {
    std::string offer, lost;
    std::chrono::steady_clock::time_point deadline;
    FoundFn done;
  };
  std::optional<PendingFind> find_;             // guarded by mu_
  uint64_t find_seq_ = 0;                       // guarded by mu_: Find() calls so far
  std::optional<std::string> record_to_write_;  // guarded by mu_
  bool release_ = false;                        // guarded by mu_: Release() asked
  std::thread thread_;
};

}  // namespace launch::agent
