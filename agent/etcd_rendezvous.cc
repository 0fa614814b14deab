#include "agent/etcd_rendezvous.h"

#include <algorithm>

#include "base/strings.h"

namespace launch::agent {

namespace asio = boost::asio;
namespace rdzv = launch::rendezvous;
using Clock = std::chrono::steady_clock;

namespace {

// How often a Find that found nothing usable asks again: the lost server's key lapses within
// lease_ttl_s, and a survivor should take the job over moments after.
constexpr std::chrono::milliseconds kFindRetry{100};

// "host:port" / "[v6]:port" as published by an agent (FormatEndpoint).
bool SplitEndpoint(const std::string& text, std::string* host, int* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0) return false;
  long long p = 0;
  if (!ParseInt64(text.substr(colon + 1), &p) || p <= 0 || p > 65535) return false;
  *host = text.substr(0, colon);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']')
    *host = host->substr(1, host->size() - 2);
  *port = static_cast<int>(p);
  return true;
}

}  // namespace

StatusOr<std::unique_ptr<EtcdRendezvous>> EtcdRendezvous::Start(
    asio::io_context& io, EtcdRendezvousOptions options,
    std::function<void(const std::string&)> on_claim_lost) {
  options.etcd.request_timeout = std::min(
      options.etcd.request_timeout, std::chrono::milliseconds(options.lease_ttl_s * 1000LL / 4));
  StatusOr<rdzv::EtcdClient> client = rdzv::EtcdClient::Create(options.etcd);
  if (!client.ok()) return client.status();
  StatusOr<int64_t> lease = client->Grant(options.lease_ttl_s);
  if (!lease.ok())
    return Status::PeerLost("rdzv_backend etcd: cannot reach the etcd cluster at rdzv_endpoint " +
                            client->Describe() + ": " + lease.status().message());
  std::unique_ptr<EtcdRendezvous> r(
      new EtcdRendezvous(io, std::move(options), std::move(*client), std::move(on_claim_lost)));
  r->lease_ = *lease;
  r->last_renewed_ = Clock::now();
  r->local_address_ = r->client_.local_address();
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

EtcdRendezvous::EtcdRendezvous(asio::io_context& io, EtcdRendezvousOptions options,
                               rdzv::EtcdClient client,
                               std::function<void(const std::string&)> on_claim_lost)
    : io_(io),
      options_(std::move(options)),
      client_(std::move(client)),
      on_claim_lost_(std::move(on_claim_lost)),
      described_(client_.Describe()),
      server_key_(options_.prefix + options_.run_id + "/server"),
      record_key_(options_.prefix + options_.run_id + "/record") {}

EtcdRendezvous::~EtcdRendezvous() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // This agent's claim (if any) goes with its lease. The record stays while its lease lives
  // unless the job ended (Forget): a server that lost its claim leaves it to its successor.
  if (lease_ != 0) (void)client_.Revoke(lease_);
}

void EtcdRendezvous::Find(std::string offer, std::string lost, Clock::time_point deadline,
                          FoundFn done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    find_ = PendingFind{std::move(offer), std::move(lost), deadline, std::move(done)};
    ++find_seq_;
  }
  cv_.notify_all();
}

void EtcdRendezvous::Keep(const rdzv::JobRecord& record) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    record_to_write_ = rdzv::EncodeJobRecord(record);
  }
  cv_.notify_all();
}

void EtcdRendezvous::Forget() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  (void)client_.DeletePrefix(options_.prefix + options_.run_id + "/");
  if (record_lease_ != 0) (void)client_.Revoke(record_lease_);
}

void EtcdRendezvous::Loop() {
  const auto renew_every = std::chrono::milliseconds(std::max(1, options_.lease_ttl_s) * 1000 / 3);
  auto next_renew = Clock::now() + renew_every;
  auto next_find = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  uint64_t tried_seq = 0;
  while (!stop_) {
    auto wake = next_renew;
    if (find_) wake = std::min(wake, next_find);
    cv_.wait_until(lock, wake, [&] {
      return stop_ || release_ || record_to_write_.has_value() || (find_ && tried_seq != find_seq_);
    });
    if (stop_) break;
    if (release_) {  // before a Find made after it
      release_ = false;
      record_to_write_.reset();  // the stopped server's last word is not the job's
      lock.unlock();
      GiveUpClaim();
      lock.lock();
    }
    if (record_to_write_) {
      std::string text = std::move(*record_to_write_);
      record_to_write_.reset();
      lock.unlock();
      WriteRecord(text);
      lock.lock();
    }
    Clock::time_point now = Clock::now();
    if (now >= next_renew) {
      lock.unlock();
      Renew(now);
      lock.lock();
      next_renew = now + renew_every;
    }
    if (!find_ || (tried_seq == find_seq_ && Clock::now() < next_find)) continue;
    const uint64_t seq = find_seq_;
    tried_seq = seq;
    const std::string offer = find_->offer, lost = find_->lost;
    lock.unlock();
    std::optional<StatusOr<Server>> result = TryFind(offer, lost);
    lock.lock();
    if (!find_ || seq != find_seq_) continue;  // replaced meanwhile
    now = Clock::now();
    if (!result && now >= find_->deadline) {
      const std::string why = !find_error_.empty() ? "the last etcd error: " + find_error_
                              : !lost.empty()
                                  ? "the lost server " + lost + " stayed published in etcd"
                                  : "no server was published";
      result = Status::Timeout("rdzv_backend etcd: no rendezvous server found for job '" +
                               options_.run_id + "' in the etcd cluster " + described_ +
                               " within join_timeout (" + why + ")");
    }
    if (!result) {
      next_find = now + kFindRetry;
      continue;
    }
    FoundFn done = std::move(find_->done);
    find_.reset();
    asio::post(io_, [done = std::move(done), r = std::move(*result)]() mutable { done(r); });
  }
}

std::optional<StatusOr<EtcdRendezvous::Server>> EtcdRendezvous::TryFind(const std::string& offer,
                                                                        const std::string& lost) {
  std::string published;
  StatusOr<std::optional<rdzv::EtcdKeyValue>> got = client_.Get(server_key_);
  if (!got.ok()) {
    find_error_ = got.status().message();
    return std::nullopt;
  }
  if (got->has_value()) {
    published = (*got)->value;
  } else {
    if (lease_ == 0) {  // a grant that failed (GiveUpClaim): a claim must expire with this agent
      StatusOr<int64_t> lease = client_.Grant(options_.lease_ttl_s);
      if (!lease.ok()) {
        find_error_ = lease.status().message();
        return std::nullopt;
      }
      lease_ = *lease;
    }
    StatusOr<std::pair<bool, rdzv::EtcdKeyValue>> claim =
        client_.CreateIfAbsent(server_key_, offer, lease_);
    if (!claim.ok()) {
      find_error_ = claim.status().message();
      if (claim.status().code() == Status::Code::kNotFound) {  // our lease lapsed: a new one
        StatusOr<int64_t> lease = client_.Grant(options_.lease_ttl_s);
        if (lease.ok()) lease_ = *lease;
      }
      return std::nullopt;
    }
    published = claim->second.value;
  }
  if (published == lost) return std::nullopt;  // until its lease lapses
  Server s;
  if (!SplitEndpoint(published, &s.host, &s.port)) {
    find_error_ = "the published server '" + SanitizeForTerminal(published) +
                  "' is not host:port (another program's key?)";
    return std::nullopt;
  }
  if (published != offer) return StatusOr<Server>(std::move(s));
  // Ours: resume from the record a lost server left, if there is one.
  serving_ = true;
  serving_offer_ = offer;
  told_claim_lost_ = false;  // a claim lost before (this agent serves again) was told already
  StatusOr<std::optional<rdzv::EtcdKeyValue>> record = client_.Get(record_key_);
  if (!record.ok()) {
    find_error_ = record.status().message();
    return std::nullopt;  // claimed: the next attempt comes back here
  }
  s.ours = true;
  if (record->has_value()) {
    StatusOr<rdzv::JobRecord> decoded = rdzv::DecodeJobRecord((*record)->value);
    if (decoded.ok()) {
      s.record = std::move(*decoded);
    } else {
      s.record_error = decoded.status().message();
    }
  }
  return StatusOr<Server>(std::move(s));
}

void EtcdRendezvous::WriteRecord(const std::string& text) {
  // Only the agent etcd names as the server writes the record, and only while etcd names it
  // (one transaction): a server whose claim lapsed unseen (its process stalled, its host cut
  // off) must not overwrite its successor's record with the job as it last saw it.
  if (!serving_) return;
  last_record_ = text;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (record_lease_ == 0) {
      StatusOr<int64_t> lease = client_.Grant(options_.record_ttl_s);
      if (!lease.ok()) return;  // written again at the next change or renewal
      record_lease_ = *lease;
    }
    StatusOr<bool> put =
        client_.PutIfValue(record_key_, text, record_lease_, server_key_, serving_offer_);
    if (put.ok() && !*put) {
      ClaimLost("etcd names another agent as the job's server now (its key no longer holds " +
                serving_offer_ + ")");
      return;
    }
    if (put.ok() || put.status().code() != Status::Code::kNotFound) return;
    record_lease_ = 0;  // lapsed: a new one, once
  }
}

void EtcdRendezvous::Renew(Clock::time_point now) {
  StatusOr<int64_t> ttl = client_.KeepAlive(lease_);
  if (ttl.ok() && *ttl > 0) {
    last_renewed_ = now;
  } else if (ttl.ok()) {
    // Gone: nobody holds the job on this lease any more.
    if (serving_) {
      ClaimLost("its etcd lease expired (another agent may serve the job now)");
    } else {
      StatusOr<int64_t> lease = client_.Grant(options_.lease_ttl_s);
      if (lease.ok()) lease_ = *lease;
    }
  } else if (serving_ && now - last_renewed_ > std::chrono::seconds(options_.lease_ttl_s)) {
    ClaimLost("no renewal of its etcd lease got through for " +
              std::to_string(options_.lease_ttl_s) + " s (" + ttl.status().message() +
              "): the cluster's majority may have given the job to another agent");
  }
  if (record_lease_ != 0) {
    StatusOr<int64_t> rttl = client_.KeepAlive(record_lease_);
    if (rttl.ok() && *rttl == 0) {
      record_lease_ = 0;
      if (!last_record_.empty()) WriteRecord(last_record_);
    }
  }
}

void EtcdRendezvous::Release() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    release_ = true;
  }
  cv_.notify_all();
}

void EtcdRendezvous::GiveUpClaim() {
  if (!serving_) return;  // lost already: nothing of it is left to give up
  serving_ = false;
  told_claim_lost_ = true;       // the agent knows: it asked
  (void)client_.Revoke(lease_);  // the server key goes with it
  StatusOr<int64_t> lease = client_.Grant(options_.lease_ttl_s);
  lease_ = lease.ok() ? *lease : 0;  // 0: granted by the next renewal or Find
}

void EtcdRendezvous::ClaimLost(const std::string& why) {
  if (told_claim_lost_) return;
  told_claim_lost_ = true;
  serving_ = false;
  asio::post(io_, [this, why] { on_claim_lost_(why); });
}

}  // namespace launch::agent
