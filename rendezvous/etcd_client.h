#pragma once

// EtcdClient: a small synchronous client for etcd's v3 API through etcd's JSON gateway
// (HTTP/1.1 POST of JSON to /v3/kv/..., /v3/lease/...; etcd 3.4 and later).
//
//   LAUNCH_ASSIGN_OR_RETURN(EtcdClient etcd, EtcdClient::Create(options));
//   LAUNCH_ASSIGN_OR_RETURN(int64_t lease, etcd.Grant(10));
//   LAUNCH_ASSIGN_OR_RETURN(auto created, etcd.CreateIfAbsent("/job/leader", me, lease));
//   ... every few seconds: etcd.KeepAlive(lease)   // 0 = the lease expired: start over
//   etcd.Revoke(lease);                             // drops every key attached to it
//
// Keys and values are byte strings (any bytes; base64 on the wire). Each call is one HTTP
// request on a fresh TCP connection (no pooling: the callers make a few calls a second at most).
//
// Endpoints and failover: a call tries the endpoints in order, starting from the last one that
// answered. An endpoint fails when it cannot be connected to, when it does not answer within
// request_timeout (a member of a cluster without quorum holds requests forever: the timeout is
// what turns that into an error), when its answer is not etcd's JSON, or when etcd says it
// cannot serve now (gRPC code Unavailable: no leader, request timed out). When every endpoint
// failed, the call returns PeerLost naming each endpoint and its error. An endpoint given by
// name is resolved at each call by the system resolver, whose own timeouts bound that step.
//
// Errors etcd reports (it answered, but refused the request) are returned with etcd's text and
// are not retried elsewhere: NotFound for a missing lease, InvalidArgument for a request etcd
// rejects, IoError for the rest (a full database, too many requests).
//
// Thread-safety: none; one thread at a time (a call blocks that thread for up to
// request_timeout per endpoint). Copyable: a copy is an independent client.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/status.h"

namespace launch::rendezvous {

struct EtcdOptions {
  // Client URLs of the cluster's members: "host:port", "http://host:port" or "[v6addr]:port"
  // (no TLS: "https://" is refused). No default: at least one is required.
  std::vector<std::string> endpoints;
  // How long one request may take on one endpoint, connecting included (default 2 s).
  std::chrono::milliseconds request_timeout{2000};
};

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t create_revision = 0;  // the store's revision when the key was created
  int64_t mod_revision = 0;     // ... when it was last written
  int64_t lease = 0;            // the lease it is attached to; 0 = none
};

class EtcdClient {
 public:
  // Validates the options: InvalidConfig naming the first bad endpoint (no port, a port out of
  // range, an IPv6 address without brackets, https), an empty list or a timeout <= 0. No I/O.
  static StatusOr<EtcdClient> Create(EtcdOptions options);

  // A new lease of `ttl_s` seconds (etcd may round a very short one up): its id.
  // REQUIRES: ttl_s > 0 (InvalidArgument otherwise).
  StatusOr<int64_t> Grant(int ttl_s);
  // Renews `lease`: its remaining TTL in seconds, 0 when the lease is gone (expired or revoked;
  // its keys are gone with it).
  StatusOr<int64_t> KeepAlive(int64_t lease);
  // Ends `lease` and deletes its keys. A lease already gone is OK.
  Status Revoke(int64_t lease);

  // The key, or nullopt when it does not exist.
  StatusOr<std::optional<EtcdKeyValue>> Get(const std::string& key);
  // Every key that starts with `prefix` ("" = every key), in key order.
  StatusOr<std::vector<EtcdKeyValue>> GetPrefix(const std::string& prefix);
  // Sets `key` = `value`, attached to `lease` (0 = none; NotFound when the lease is gone).
  Status Put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Creates `key` = `value` (attached to `lease`, 0 = none) unless the key exists, atomically
  // (one transaction): whether this call created it and, either way, the key as it is now.
  StatusOr<std::pair<bool, EtcdKeyValue>> CreateIfAbsent(const std::string& key,
                                                         const std::string& value, int64_t lease);
  // Sets `key` = `value` (attached to `lease`, 0 = none) only while `guard_key` holds
  // `guard_value`, atomically (one transaction): whether it did. A missing guard key does not
  // hold. NotFound when the lease is gone. A fence: a writer that lost its claim (the guard)
  // cannot overwrite what its successor wrote.
  StatusOr<bool> PutIfValue(const std::string& key, const std::string& value, int64_t lease,
                            const std::string& guard_key, const std::string& guard_value);
  // Deletes every key that starts with `prefix` ("" = every key).
  Status DeletePrefix(const std::string& prefix);

  // This machine's address on the last connection that reached etcd, i.e. on the route towards
  // the cluster: an address other hosts can reach this one at. Empty before any call reached
  // etcd.
  const std::string& local_address() const { return local_address_; }
  // "a:2379, b:2379", for messages.
  std::string Describe() const;

 private:
  struct Endpoint {
    std::string host;  // as given, without brackets
    std::string port;
    std::string text;  // "host:port" ("[v6]:port"): for messages and the Host header
  };
  struct Reply;  // etcd's answer, parsed (defined in the .cc: the JSON library stays private)
  EtcdClient(EtcdOptions options, std::vector<Endpoint> endpoints);
  // POSTs the JSON `request` to `path` ("/v3/kv/range") on the first endpoint that answers:
  // etcd's answer, or the error (see the header comment).
  StatusOr<Reply> Call(const char* path, const std::string& request);

  EtcdOptions options_;
  std::vector<Endpoint> endpoints_;
  size_t preferred_ = 0;  // the endpoint that answered last: tried first
  std::string local_address_;
};

}  // namespace launch::rendezvous
