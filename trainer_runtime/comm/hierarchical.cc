#include "trainer_runtime/comm/hierarchical.h"

#include <cstdio>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "trainer_runtime/comm/shm_common.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {

namespace {

// "all-reduce across 2 hosts 1.50 MB" for the timeline's cross-host track.
std::string CrossHostName(const char* op, int hosts, int64_t bytes) {
  char text[96];
  std::snprintf(text, sizeof text, "%s across %d hosts %.2f MB", op, hosts,
                static_cast<double>(bytes) / (1 << 20));
  return text;
}

// A completed Work's failure (ShmAllReduce completes its broadcast before returning it).
Status WaitStatus(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait();
    return Status::Ok();
  } catch (const std::exception& e) {
    return Status::PeerLost(e.what());
  }
}

}  // namespace

StatusOr<HierarchicalSetup> HierarchicalAllReduce::Create(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, const std::vector<std::string>& hosts,
    const LeaderGroupFactory& leaders, const ShmAllReduceOptions& shm) {
  HierarchicalSetup none;
  const int world = static_cast<int>(hosts.size());
  for (int r = 0; r < world; ++r) {
    if (hosts[r] == "off") {
      none.reason = "LAUNCH_SHM_ALLREDUCE=0 on rank " + std::to_string(r);
      return none;
    }
  }
  // Hosts numbered in order of their lowest rank (host 0 holds rank 0); a host's ranks in group
  // rank order, so its leader (local rank 0) is its lowest rank and rank 0 leads host 0.
  std::vector<std::string> ids;
  std::vector<std::vector<int>> members;
  for (int r = 0; r < world; ++r) {
    size_t h = 0;
    while (h < ids.size() && ids[h] != hosts[r]) ++h;
    if (h == ids.size()) {
      ids.push_back(hosts[r]);
      members.emplace_back();
    }
    members[h].push_back(r);
  }
  if (ids.size() < 2) {
    none.reason = "every rank on one host";
    return none;
  }
  bool shared = false;
  for (const auto& m : members) shared = shared || m.size() > 1;
  if (!shared) {
    none.reason = "one rank per host";
    return none;
  }
  int host = 0, local_rank = 0;
  for (size_t h = 0; h < members.size(); ++h)
    for (size_t i = 0; i < members[h].size(); ++i)
      if (members[h][i] == rank) host = static_cast<int>(h), local_rank = static_cast<int>(i);
  const int local_size = static_cast<int>(members[host].size());
  const std::string me = std::to_string(rank);
  try {
    // 1. Each host's segment (a host of one rank needs none), through its own prefix.
    std::unique_ptr<ShmAllReduce> local;
    std::string mine = "ok";
    if (local_size > 1) {
      ShmAllReduceOptions options = shm;
      options.host_identity = hosts[rank];
      auto host_store =
          c10::make_intrusive<c10d::PrefixStore>("host" + std::to_string(host), store);
      LAUNCH_ASSIGN_OR_RETURN(
          ShmSetup setup, ShmAllReduce::Create(*host_store, local_rank, local_size, true, options));
      local = std::move(setup.shm);
      if (!local) mine = "rank " + me + ": no shared memory on its host (" + setup.reason + ")";
    }
    // 2. All ranks go hierarchical only if every host has its segment: the others' sequences of
    // operations must match.
    shm::StoreSet(*store, "ready/" + me, mine);
    for (int r = 0; r < world; ++r) {
      const std::string ready = shm::StoreGet(*store, "ready/" + std::to_string(r));
      if (ready != "ok") {
        none.reason = ready;
        return none;
      }
    }
    // 3. The leaders' Gloo group.
    c10::intrusive_ptr<c10d::ProcessGroup> group;
    if (local_rank == 0) {
      try {
        group = leaders(c10::make_intrusive<c10d::PrefixStore>("leaders", store), host,
                        static_cast<int>(ids.size()));
      } catch (const std::exception& e) {
        return Status::Timeout("rank " + me + ": the Gloo group of the " +
                               std::to_string(ids.size()) +
                               " host leaders did not form: " + e.what());
      }
    }
    HierarchicalSetup setup;
    setup.hierarchical.reset(new HierarchicalAllReduce(host, static_cast<int>(ids.size()),
                                                       local_rank, std::move(local), group));
    return setup;
  } catch (const std::exception& e) {
    return Status::Timeout("rank " + me +
                           ": hierarchical all-reduce setup through the store: " + e.what());
  }
}

bool HierarchicalAllReduce::Supports(const std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) {
  return ShmAllReduce::Supports(tensors, opts);
}

bool HierarchicalAllReduce::SupportsBroadcast(const at::Tensor& tensor) {
  return ShmAllReduce::SupportsBroadcast(tensor);
}

HierarchicalAllReduce::HierarchicalAllReduce(int host, int host_count, int local_rank,
                                             std::unique_ptr<ShmAllReduce> local,
                                             c10::intrusive_ptr<c10d::ProcessGroup> leaders)
    : host_(host),
      host_count_(host_count),
      local_rank_(local_rank),
      local_(std::move(local)),
      leaders_(std::move(leaders)) {
  worker_ = std::thread([this] { WorkerLoop(); });
}

HierarchicalAllReduce::~HierarchicalAllReduce() {
  {
    MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.NotifyAll();
  if (worker_.joinable()) worker_.join();
  for (Op& op : queue_)
    op.future->setError(
        compat::ErrorPtr("hierarchical all-reduce shut down before this operation ran"));
  queue_.clear();
  local_.reset();
  leaders_.reset();
}

std::string HierarchicalAllReduce::Describe() const {
  return "hierarchical: shared memory within " + std::to_string(host_count_) +
         " hosts + Gloo across";
}

c10::intrusive_ptr<c10d::Work> HierarchicalAllReduce::Enqueue(Op op, c10d::OpType type) {
  auto future = shm::TensorListFuture();
  c10::intrusive_ptr<c10d::Work> work = c10::make_intrusive<shm::FutureWork>(future, type);
  op.future = future;
  {
    MutexLock lock(&mu_);
    if (stop_) {
      future->setError(compat::ErrorPtr("hierarchical all-reduce used after shut down"));
      return work;
    }
    queue_.push_back(std::move(op));
  }
  cv_.NotifyAll();
  return work;
}

c10::intrusive_ptr<c10d::Work> HierarchicalAllReduce::AllReduceAsync(const at::Tensor& tensor) {
  return Enqueue(Op{Kind::kAllReduce, tensor, {}}, c10d::OpType::ALLREDUCE);
}

c10::intrusive_ptr<c10d::Work> HierarchicalAllReduce::BroadcastFromRank0Async(
    const at::Tensor& tensor) {
  return Enqueue(Op{Kind::kBroadcast, tensor, {}}, c10d::OpType::BROADCAST);
}

void HierarchicalAllReduce::WorkerLoop() {
  MutexLock lock(&mu_);
  while (true) {
    while (!stop_ && queue_.empty()) cv_.Wait();
    if (stop_) return;
    Op op = std::move(queue_.front());
    queue_.pop_front();
    lock.Unlock();
    const Status status = Execute(op);
    // Outside mu_: a completion callback may issue the next operation.
    shm::Complete(*op.future, status, op.tensor);
    op = Op();
    lock.Lock();
  }
}

Status HierarchicalAllReduce::Execute(const Op& op) {
  if (!failed_.ok()) return failed_;
  // Every rank skips an empty tensor alike: nothing to exchange.
  if (op.tensor.numel() == 0) return Status::Ok();
  Status status;
  // 1. The host's sum, in local-rank order, on every rank of the host.
  if (op.kind == Kind::kAllReduce && local_) status = local_->AllReduceNow(op.tensor);
  // 2. The leaders: sum of the host sums, or rank 0's tensor.
  if (status.ok() && leaders_) {
    status = CrossHost(op);
    // The host's other ranks wait for this leader's broadcast: tell them it will not come.
    if (!status.ok() && local_) local_->AbortPeers();
  }
  // 3. Every rank copies its leader's bytes.
  if (status.ok() && local_) status = WaitStatus(local_->BroadcastFromRank0(op.tensor));
  if (!status.ok()) failed_ = status;
  return status;
}

Status HierarchicalAllReduce::CrossHost(const Op& op) {
  const at::Tensor& t = op.tensor;
  const int64_t bytes = t.numel() * t.element_size();
  const bool reduce = op.kind == Kind::kAllReduce;
  const uint64_t trace = Timeline::Get().BeginAsync(
      "cross_host", CrossHostName(reduce ? "all-reduce" : "broadcast", host_count_, bytes));
  Status status;
  try {
    if (reduce) {
      // LibTorch 1.13's Gloo cannot add bfloat16: the host sums are added in float, rounded once
      // (twice the bytes on the wire). float16 crosses as float16, as comm_hook fp16 wants: Gloo
      // adds it, rounding after each addition.
      at::Tensor sum = t.scalar_type() == at::kBFloat16 ? t.to(at::kFloat) : t;
      std::vector<at::Tensor> tensors = {sum};
      leaders_->allreduce(tensors, c10d::AllreduceOptions())->wait();
      if (!sum.is_same(t)) t.copy_(sum);
    } else {
      // Bytes: Gloo's broadcast copies them, whatever the dtype (1.13's has no bfloat16 or bool).
      std::vector<at::Tensor> tensors = {t.view({-1}).view(at::kByte)};
      c10d::BroadcastOptions opts;
      opts.rootRank = 0;
      leaders_->broadcast(tensors, opts)->wait();
    }
    cross_host_count_.fetch_add(1);
    cross_host_bytes_.fetch_add(bytes);
  } catch (const std::exception& e) {
    status = Status::PeerLost(std::string("cross-host ") + (reduce ? "all-reduce" : "broadcast") +
                              " among the " + std::to_string(host_count_) +
                              " host leaders (Gloo) failed on host " + std::to_string(host_) +
                              ": " + e.what());
  }
  Timeline::Get().EndAsync(trace);
  return status;
}

}  // namespace launch::trainer
