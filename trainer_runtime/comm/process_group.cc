#include "trainer_runtime/comm/process_group.h"

#include <torch/csrc/distributed/c10d/comm.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <thread>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdio>
#include <cstdlib>

#include "base/interfaces.h"
#include "base/strings.h"
#include "trainer_runtime/comm/shm_common.h"
#include "trainer_runtime/compat/platform.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {

CountingProcessGroup::CountingProcessGroup(c10::intrusive_ptr<c10d::ProcessGroup> inner,
                                           std::unique_ptr<ShmAllReduce> shm,
                                           std::unique_ptr<ShmPointToPoint> p2p,
                                           std::unique_ptr<HierarchicalAllReduce> hierarchical)
    : c10d::ProcessGroup(inner->getRank(), inner->getSize()),
      inner_(std::move(inner)),
      shm_(std::move(shm)),
      p2p_(std::move(p2p)),
      hierarchical_(std::move(hierarchical)) {
  TORCH_CHECK(!(shm_ && hierarchical_), "one all-reduce transport per group");
  nccl_ = compat::CarriesOverNccl(*inner_, c10::DeviceType::CUDA);
  if (shm_) transport_ = "shared memory";
  if (hierarchical_) transport_ = hierarchical_->Describe();
}

CountingProcessGroup::~CountingProcessGroup() {
  p2p_.reset();
  hierarchical_.reset();  // its thread may still be running an operation
  for (const int fd : sockets_) ::close(fd);
}

void CountingProcessGroup::set_sockets(const std::vector<int>& fds) {
  // Duplicates of Gloo's descriptors, ours until the group goes: Gloo closes its own when a
  // connection fails, and that number may then name another socket (a store client's).
  for (const int fd : fds) {
    const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy >= 0) sockets_.push_back(copy);
  }
}

void CountingProcessGroup::Abandon() {
  // shutdown() ends the connection for every descriptor of it, Gloo's included; the peer reads
  // end-of-file, and so does this rank's own Gloo, which fails what waits on the pair.
  for (const int fd : sockets_) ::shutdown(fd, SHUT_RDWR);
  if (shm_) shm_->AbortPeers();
  if (p2p_) p2p_->AbandonPeers();
  if (hierarchical_) hierarchical_->AbortPeers();
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  // DDP's buffers before every forward (and the parameters at the start): through shared
  // memory when the group has it, a round trip through Gloo's threads otherwise.
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.numel() * t.element_size();
  const uint64_t token = RingBegin(CollectiveOp::kBroadcast, bytes, CollectiveState::kEnqueued);
  if (shm_ && tensors.size() == 1 && opts.rootRank == 0 && opts.rootTensor == 0 &&
      ShmAllReduce::SupportsBroadcast(tensors[0]))
    return Tracked(shm_->BroadcastFromRank0(tensors[0]), token);
  // Across hosts: rank 0's bytes cross the network once per host, not once per rank.
  if (hierarchical_ && tensors.size() == 1 && opts.rootRank == 0 && opts.rootTensor == 0 &&
      HierarchicalAllReduce::SupportsBroadcast(tensors[0]))
    return Tracked(hierarchical_->BroadcastFromRank0Async(tensors[0]), token);
  return Tracked(inner_->broadcast(tensors, opts), token);
}

void CountingProcessGroup::AttachRing(CollectiveRing* ring, std::string_view name) {
  ring_ = ring;
  ring_group_ = ring ? ring->Group(name) : -1;
}

uint64_t CountingProcessGroup::RingBegin(CollectiveOp op, int64_t bytes, CollectiveState state) {
  return ring_ ? ring_->Begin(ring_group_, op, bytes, state) : 0;
}

void CountingProcessGroup::RingDone(uint64_t token, bool ok) {
  if (ring_) ring_->Done(token, ok);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::Tracked(c10::intrusive_ptr<c10d::Work> work,
                                                             uint64_t token) {
  // One callback on the Work's future: it runs on the thread that completes the operation (at
  // once when it already has), which is when the ring says "done".
  if (token != 0) {
    CollectiveRing* ring = ring_;
    try {
      work->getFuture()->addCallback(
          [ring, token](c10::ivalue::Future& f) { ring->Done(token, !f.hasError()); });
    } catch (const c10::Error&) {
      // A Work without a future (none of the transports above): better no record than one that
      // never completes and reads as a hang.
      ring->Done(token);
    }
  }
  return work;
}

namespace {
// "all-reduce 1.5 MB" for the timeline.
std::string OpName(const char* op, int64_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%s %.2f MB", op, static_cast<double>(bytes) / (1 << 20));
  return text;
}
std::string AllreduceName(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.numel() * t.element_size();
  return OpName("all-reduce", bytes);
}

// Ends the timeline span `trace` when `work` completes.
void EndOnCompletion(const c10::intrusive_ptr<c10d::Work>& work, uint64_t trace) {
  if (trace != 0)
    work->getFuture()->addCallback(
        [trace](c10::ivalue::Future&) { Timeline::Get().EndAsync(trace); });
}

// A Work whose future completes, after `inner`'s did, with [output] once `finish` ran (on the
// thread that completed `inner`), or with inner's error (as a c10::Error) or finish's
// exception. wait() rethrows.
c10::intrusive_ptr<c10d::Work> Then(const c10::intrusive_ptr<c10d::Work>& inner, c10d::OpType type,
                                    at::Tensor output, std::function<void()> finish) {
  auto future = inner->getFuture()->then(
      [output, finish = std::move(finish)](c10::ivalue::Future& done) -> c10::IValue {
        if (done.hasError()) {
          // Gloo fails with its own exceptions (gloo::IoException); callers catch c10::Error.
          try {
            std::rethrow_exception(done.exception_ptr());
          } catch (const c10::Error&) {
            throw;
          } catch (const std::exception& e) {
            std::rethrow_exception(compat::ErrorPtr(e.what()));
          }
        }
        finish();
        return c10::IValue(std::vector<at::Tensor>{output});
      },
      c10::ListType::create(c10::TensorType::get()));
  return c10::make_intrusive<shm::FutureWork>(future, type);
}

// A Work already completed with [output] (an empty collective: nothing to exchange).
c10::intrusive_ptr<c10d::Work> Done(c10d::OpType type, const at::Tensor& output) {
  auto future = shm::TensorListFuture();
  shm::Complete(*future, Status::Ok(), output);
  return c10::make_intrusive<shm::FutureWork>(future, type);
}

// `t`'s bytes as the Gloo-supported type of its element width (Byte, Half, Int, Long), or `t`
// itself for other widths.
at::Tensor AsGlooBytes(const at::Tensor& t) {
  switch (t.element_size()) {
    case 1:
      return t.view(at::kByte);
    case 2:
      return t.view(at::kHalf);
    case 4:
      return t.view(at::kInt);
    case 8:
      return t.view(at::kLong);
    default:
      return t;
  }
}

// ShmAllReduce's failures complete the future with a c10::Error; this one is thrown at the call.
void CheckFlatArguments(const char* what, const at::Tensor& whole, const at::Tensor& part,
                        int world) {
  TORCH_CHECK(whole.defined() && part.defined() && whole.is_contiguous() && part.is_contiguous(),
              what, ": tensors must be defined and contiguous");
  TORCH_CHECK(whole.scalar_type() == part.scalar_type(), what, ": dtypes differ (",
              whole.scalar_type(), " vs ", part.scalar_type(), ")");
  TORCH_CHECK(whole.device() == part.device(), what, ": devices differ");
  TORCH_CHECK(whole.numel() == world * part.numel(), what, ": ", whole.numel(),
              " elements are not ", world, " ranks x ", part.numel());
}
}  // namespace

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  {
    MutexLock lock(&mu_);
    ++allreduce_count_;
    for (const at::Tensor& t : tensors) allreduce_bytes_ += t.numel() * t.element_size();
    launch_times_.push_back(Clock::now());
  }
  const uint64_t trace = Timeline::Get().BeginAsync("allreduce", AllreduceName(tensors));
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.numel() * t.element_size();
  const uint64_t token = RingBegin(CollectiveOp::kAllReduce, bytes, CollectiveState::kEnqueued);
  c10::intrusive_ptr<c10d::Work> work;
  if (shm_ && ShmAllReduce::Supports(tensors, opts))
    work = shm_->AllReduceAsync(tensors[0]);
  else if (hierarchical_ && HierarchicalAllReduce::Supports(tensors, opts))
    work = hierarchical_->AllReduceAsync(tensors[0]);
  else
    work = inner_->allreduce(tensors, opts);
  EndOnCompletion(work, trace);
  return Tracked(work, token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::ReduceScatterFlat(const at::Tensor& input,
                                                                       const at::Tensor& output) {
  CheckFlatArguments("ReduceScatterFlat", input, output, getSize());
  const int64_t bytes = input.numel() * input.element_size();
  {
    MutexLock lock(&mu_);
    ++reduce_scatter_count_;
    reduce_scatter_bytes_ += bytes;
    launch_times_.push_back(Clock::now());
  }
  if (output.numel() == 0) return Done(c10d::OpType::REDUCE_SCATTER, output);
  const uint64_t token = RingBegin(CollectiveOp::kReduceScatter, bytes, CollectiveState::kEnqueued);
  const uint64_t trace =
      Timeline::Get().BeginAsync("reduce_scatter", OpName("reduce-scatter", bytes));
  c10::intrusive_ptr<c10d::Work> work;
  if (shm_ && shm_->SupportsReduceScatter(input, output)) {
    work = shm_->ReduceScatterAsync(input, output);
  } else if (nccl_ && input.is_cuda()) {
    // NCCL reduces into the output in place (output == input's own shard is its in-place form).
    at::Tensor in = input.view({-1});
    at::Tensor out = output.view({-1});
    work = inner_->_reduce_scatter_base(out, in, c10d::ReduceScatterOptions());
  } else if (hierarchical_ && HierarchicalAllReduce::Supports({input}, c10d::AllreduceOptions())) {
    // An all-reduce of the whole input in two levels, then this rank's shard copied out: the
    // same bits as the all-reduce (ZeRO is compared bit for bit with DDP). `input` is summed in
    // place, as on the Gloo path.
    const at::Tensor flat = input.view({-1});
    const at::Tensor shard = flat.narrow(0, getRank() * output.numel(), output.numel());
    const at::Tensor out = output.view({-1});
    work = Then(hierarchical_->AllReduceAsync(flat), c10d::OpType::REDUCE_SCATTER, output,
                [shard, out] { out.copy_(shard); });
  } else {
    // LibTorch 1.13's Gloo cannot add bfloat16: sum it in float (rounded once, at the copy).
    at::Tensor summed =
        input.scalar_type() == at::kBFloat16 ? input.view({-1}).to(at::kFloat) : input.view({-1});
    std::vector<at::Tensor> tensors = {summed};
    const at::Tensor shard = summed.narrow(0, getRank() * output.numel(), output.numel());
    const at::Tensor out = output.view({-1});
    work = Then(inner_->allreduce(tensors, c10d::AllreduceOptions()), c10d::OpType::REDUCE_SCATTER,
                output, [shard, out] { out.copy_(shard); });
  }
  EndOnCompletion(work, trace);
  return Tracked(work, token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::AllGatherFlat(const at::Tensor& input,
                                                                   const at::Tensor& output) {
  CheckFlatArguments("AllGatherFlat", output, input, getSize());
  const int64_t bytes = output.numel() * output.element_size();
  {
    MutexLock lock(&mu_);
    ++allgather_count_;
    allgather_bytes_ += bytes;
    allgather_launch_times_.push_back(Clock::now());
  }
  if (input.numel() == 0) return Done(c10d::OpType::ALLGATHER, output);
  const uint64_t token = RingBegin(CollectiveOp::kAllGather, bytes, CollectiveState::kEnqueued);
  const uint64_t trace = Timeline::Get().BeginAsync("allgather", OpName("all-gather", bytes));
  c10::intrusive_ptr<c10d::Work> work;
  if (shm_ && shm_->SupportsAllGather(input, output)) {
    work = shm_->AllGatherAsync(input, output);
  } else if (nccl_ && output.is_cuda()) {
    at::Tensor in = input.view({-1});
    at::Tensor out = output.view({-1});
    work = inner_->_allgather_base(out, in, c10d::AllgatherOptions());
  } else {
    // Gloo writes straight into views of `output`; the wrapper only turns its future's value
    // (a list of tensor lists) into [output]. Gloo copies bytes but accepts only some dtypes
    // (1.13's has no bfloat16 or bool): the tensors travel as an integer type of their width.
    const at::Tensor flat = AsGlooBytes(output.view({-1}));
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < getSize(); ++r)
      outputs[0].push_back(flat.narrow(0, r * input.numel(), input.numel()));
    std::vector<at::Tensor> inputs = {AsGlooBytes(input.view({-1}))};
    work = Then(inner_->allgather(outputs, inputs, c10d::AllgatherOptions()),
                c10d::OpType::ALLGATHER, output, [] {});
  }
  EndOnCompletion(work, trace);
  return Tracked(work, token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::AllToAllFlat(const at::Tensor& input,
                                                                  const at::Tensor& output) {
  TORCH_CHECK(
      input.defined() && output.defined() && input.is_contiguous() && output.is_contiguous(),
      "AllToAllFlat: tensors must be defined and contiguous");
  TORCH_CHECK(input.scalar_type() == output.scalar_type() && input.device() == output.device(),
              "AllToAllFlat: dtypes or devices differ");
  TORCH_CHECK(input.numel() == output.numel() && input.numel() % getSize() == 0,
              "AllToAllFlat: ", input.numel(), " and ", output.numel(),
              " elements are not equal blocks for ", getSize(), " ranks");
  const int64_t bytes = input.numel() * input.element_size();
  {
    MutexLock lock(&mu_);
    ++alltoall_count_;
    alltoall_bytes_ += bytes;
  }
  if (input.numel() == 0) return Done(c10d::OpType::ALLTOALL_BASE, output);
  const uint64_t token = RingBegin(CollectiveOp::kAllToAll, bytes, CollectiveState::kEnqueued);
  const uint64_t trace = Timeline::Get().BeginAsync("alltoall", OpName("all-to-all", bytes));
  // Equal blocks: empty split lists. Gloo moves bytes but takes only some dtypes (as above).
  std::vector<int64_t> equal;
  const bool nccl = nccl_ && output.is_cuda();
  at::Tensor in = nccl ? input.view({-1}) : AsGlooBytes(input.view({-1}));
  at::Tensor out = nccl ? output.view({-1}) : AsGlooBytes(output.view({-1}));
  c10::intrusive_ptr<c10d::Work> work =
      Then(inner_->alltoall_base(out, in, equal, equal, c10d::AllToAllOptions()),
           c10d::OpType::ALLTOALL_BASE, output, [] {});
  EndOnCompletion(work, trace);
  return Tracked(work, token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) {
  return AllGatherFlat(input, output);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  if (opts.reduceOp != c10d::ReduceOp::SUM)
    return inner_->_reduce_scatter_base(output, input, opts);
  return ReduceScatterFlat(input, output);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  {
    MutexLock lock(&mu_);
    ++allreduce_count_;
    for (const at::Tensor& t : tensors) allreduce_bytes_ += t.numel() * t.element_size();
    launch_times_.push_back(Clock::now());
  }
  int64_t bytes = 0;
  for (const at::Tensor& t : tensors) bytes += t.numel() * t.element_size();
  const uint64_t token = RingBegin(CollectiveOp::kAllReduce, bytes, CollectiveState::kEnqueued);
  return Tracked(inner_->allreduce_coalesced(tensors, opts), token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  int64_t bytes = 0;
  for (const auto& list : outputs)
    for (const at::Tensor& t : list) bytes += t.numel() * t.element_size();
  const uint64_t token = RingBegin(CollectiveOp::kAllGather, bytes, CollectiveState::kEnqueued);
  return Tracked(inner_->allgather(outputs, inputs, opts), token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::barrier(const c10d::BarrierOptions& opts) {
  const uint64_t token = RingBegin(CollectiveOp::kBarrier, 0, CollectiveState::kEnqueued);
  return Tracked(inner_->barrier(opts), token);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::send(std::vector<at::Tensor>& tensors,
                                                          int dst_rank, int tag) {
  if (p2p_ && ShmPointToPoint::Supports(tensors) && dst_rank != getRank() && dst_rank >= 0 &&
      dst_rank < getSize())
    return p2p_->Send(tensors[0], dst_rank, tag);
  if (!nccl_ && tensors.size() == 1 && tensors[0].is_cuda()) {
    // Gloo's send/recv hand the tensor's pointer to its transport, which reads host memory: a
    // CUDA tensor travels as a host copy (the Work keeps the copy alive until it is sent).
    std::vector<at::Tensor> host = {tensors[0].cpu()};
    return inner_->send(host, dst_rank, tag);
  }
  return inner_->send(tensors, dst_rank, tag);
}

c10::intrusive_ptr<c10d::Work> CountingProcessGroup::recv(std::vector<at::Tensor>& tensors,
                                                          int src_rank, int tag) {
  if (p2p_ && ShmPointToPoint::Supports(tensors) && src_rank != getRank() && src_rank >= 0 &&
      src_rank < getSize())
    return p2p_->Recv(tensors[0], src_rank, tag);
  if (!nccl_ && tensors.size() == 1 && tensors[0].is_cuda()) {
    // As in send: received into host memory, then copied to the device; complete on return.
    std::vector<at::Tensor> host = {
        at::empty_like(tensors[0], tensors[0].options().device(at::kCPU))};
    inner_->recv(host, src_rank, tag)->wait();
    tensors[0].copy_(host[0]);
    return Done(c10d::OpType::RECV, tensors[0]);
  }
  return inner_->recv(tensors, src_rank, tag);
}

void CountingProcessGroup::RecordAllreduce(int64_t bytes) {
  MutexLock lock(&mu_);
  ++allreduce_count_;
  ++recorded_count_;
  allreduce_bytes_ += bytes;
  launch_times_.push_back(Clock::now());
}

int64_t CountingProcessGroup::recorded_count() const {
  MutexLock lock(&mu_);
  return recorded_count_;
}

int64_t CountingProcessGroup::allreduce_count() const {
  MutexLock lock(&mu_);
  return allreduce_count_;
}

int64_t CountingProcessGroup::allreduce_bytes() const {
  MutexLock lock(&mu_);
  return allreduce_bytes_;
}

int64_t CountingProcessGroup::reduce_scatter_count() const {
  MutexLock lock(&mu_);
  return reduce_scatter_count_;
}

int64_t CountingProcessGroup::reduce_scatter_bytes() const {
  MutexLock lock(&mu_);
  return reduce_scatter_bytes_;
}

int64_t CountingProcessGroup::allgather_count() const {
  MutexLock lock(&mu_);
  return allgather_count_;
}

int64_t CountingProcessGroup::allgather_bytes() const {
  MutexLock lock(&mu_);
  return allgather_bytes_;
}

int64_t CountingProcessGroup::alltoall_count() const {
  MutexLock lock(&mu_);
  return alltoall_count_;
}

int64_t CountingProcessGroup::alltoall_bytes() const {
  MutexLock lock(&mu_);
  return alltoall_bytes_;
}

int64_t CountingProcessGroup::cross_host_count() const {
  return hierarchical_ ? hierarchical_->cross_host_count() : 0;
}

int64_t CountingProcessGroup::cross_host_bytes() const {
  return hierarchical_ ? hierarchical_->cross_host_bytes() : 0;
}

std::vector<CountingProcessGroup::Clock::time_point> CountingProcessGroup::TakeLaunchTimes() {
  MutexLock lock(&mu_);
  std::vector<Clock::time_point> out;
  out.swap(launch_times_);
  return out;
}

std::vector<CountingProcessGroup::Clock::time_point>
CountingProcessGroup::TakeAllgatherLaunchTimes() {
  MutexLock lock(&mu_);
  std::vector<Clock::time_point> out;
  out.swap(allgather_launch_times_);
  return out;
}

namespace {

std::shared_ptr<::gloo::transport::Device> GlooDevice(const GlooBinding& binding) {
  if (binding.from_environment)
    return c10d::ProcessGroupGloo::createDeviceForInterface(binding.interface);
  return c10d::ProcessGroupGloo::createDeviceForHostname(binding.address);
}

// "0.03 s".
std::string Seconds(std::chrono::steady_clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f s", std::chrono::duration<double>(d).count());
  return text;
}

// Whether a failure after `elapsed` of `timeout` was the deadline's: the library says so (c10d's
// store gives up up to a retry interval early), or the time is up. A refused connection, a
// signal, end it sooner and are not.
bool TimedOut(const std::string& error, std::chrono::steady_clock::duration elapsed,
              std::chrono::milliseconds timeout) {
  const std::string text = ToLower(error);
  return text.find("timed out") != std::string::npos || text.find("timeout") != std::string::npos ||
         elapsed >= timeout * 9 / 10;
}

// What to do when the group failed in a job whose MASTER_ADDR is not loopback and this rank
// was told to bind loopback (GLOO_SOCKET_IFNAME=lo), or Gloo's error names a loopback peer
// address ("connect [127.0.0.1]:41234: Connection refused", LibTorch 1.13; 2.6's Gloo names no
// address): that Gloo listens on loopback on its own host, which no other host reaches. ""
// otherwise.
std::string LoopbackPeerHint(const std::string& error, const GlooBinding& binding,
                             const std::string& master_addr) {
  if (IsLoopbackHost(master_addr)) return "";
  if (binding.from_environment && IsLoopbackHost(binding.address))
    return " (GLOO_SOCKET_IFNAME=" + binding.interface +
           " is loopback, out of the other hosts' reach: unset it, or name the interface that "
           "reaches them, on every host)";
  if (error.find("[127.") == std::string::npos && error.find("[::1]") == std::string::npos)
    return "";
  return " (a peer announced a loopback address: its Gloo listens on loopback, as PyTorch's "
         "does where GLOO_SOCKET_IFNAME is unset and the host's name resolves to loopback or "
         "nothing; set GLOO_SOCKET_IFNAME on that host to the interface that reaches this one)";
}

}  // namespace

std::string GlooBinding::Describe() const {
  if (from_environment)
    return "interface " + interface + " (" + address + ") from GLOO_SOCKET_IFNAME";
  return address + (interface.empty() ? "" : " on " + interface) + ", " + why;
}

StatusOr<GlooBinding> ChooseGlooBinding(const std::string& master_addr) {
  GlooBinding b;
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && *ifname) {
    // The user's choice wins, but a name this host lacks fails here, naming it, instead of
    // deep in Gloo ("Unable to find address for: ...").
    const std::vector<InterfaceAddress> interfaces = ListInterfaceAddresses();
    if (!HasInterface(interfaces, ifname)) {
      std::string hint;
      if (!IsLoopbackHost(master_addr)) {
        StatusOr<Route> route = RouteTo(master_addr);
        if (route.ok() && !route->interface.empty())
          hint =
              "; unset it to use " + route->interface + ", the route to MASTER_ADDR " + master_addr;
      }
      return Status::InvalidConfig(std::string("GLOO_SOCKET_IFNAME=") + ifname +
                                   " names no interface of this host (" + Hostname() +
                                   " has: " + InterfaceNames(interfaces) + ")" + hint);
    }
    b.from_environment = true;
    b.interface = ifname;
    b.address = AddressOf(interfaces, ifname);
    b.why = "GLOO_SOCKET_IFNAME";
    return b;
  }
  if (IsLoopbackHost(master_addr)) {
    // Every rank is on this host (the rendezvous hands out a loopback MASTER_ADDR only then).
    b.address = "127.0.0.1";
    b.interface = InterfaceHolding(ListInterfaceAddresses(), b.address);
    b.why = "MASTER_ADDR " + master_addr + " being loopback";
    return b;
  }
  // Not the address this host's name resolves to (Gloo's default, which stock hosts map to
  // loopback or nothing): the one the other hosts reach, as they reached MASTER_ADDR.
  StatusOr<Route> route = RouteTo(master_addr);
  if (!route.ok())
    return Status::IoError("cannot find the local address that reaches MASTER_ADDR " + master_addr +
                           " for Gloo to bind: " + route.status().message() +
                           " (set GLOO_SOCKET_IFNAME to the interface to use)");
  b.address = route->address;
  b.interface = route->interface;
  b.why = "the route to MASTER_ADDR " + master_addr;
  return b;
}

namespace {

// Where this rank's CUDA tensors travel, as its Platform decided (the CPU: none).
void SetCudaTransport(const DistEnv& env, compat::GroupOptions* options) {
  StatusOr<Platform> platform = Platform::Create(env, "no", PlatformFacts::Read());
  if (!platform.ok() || !platform->is_cuda()) return;
  options->cuda_device = platform->cuda_device();
  options->cuda_over_gloo = platform->backend() == CollectiveBackend::kGloo;
}

// The port of an IPv4 or IPv6 socket address; -1 for another family.
int PortOf(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET)
    return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  if (address.ss_family == AF_INET6)
    return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
  return -1;
}

// This process's connected sockets, sorted, but for the store's: those with `store_port` at
// either end (a client's, or the server's side of one when this rank hosts the store, whose
// thread may accept a peer's client at any time).
std::vector<int> ConnectedSockets(int store_port) {
  std::vector<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return fds;
  while (const dirent* e = ::readdir(dir)) {
    long long fd = -1;
    if (!ParseInt64(e->d_name, &fd) || fd == ::dirfd(dir)) continue;
    struct stat st {};
    if (::fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    int listening = 0;
    socklen_t len = sizeof(listening);
    if (::getsockopt(static_cast<int>(fd), SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 ||
        listening)
      continue;
    sockaddr_storage peer{}, local{};
    socklen_t peer_len = sizeof(peer), local_len = sizeof(local);
    if (::getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 ||
        ::getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0)
      continue;
    if (PortOf(peer) == store_port || PortOf(local) == store_port) continue;
    fds.push_back(static_cast<int>(fd));
  }
  ::closedir(dir);
  std::sort(fds.begin(), fds.end());
  return fds;
}

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> NewGroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                int rank, int size, const DistEnv& env,
                                                std::chrono::milliseconds timeout,
                                                const GlooBinding& binding) {
  compat::GroupOptions options;
  options.timeout = timeout;
  options.collective_timeout = env.collective_timeout;
  options.gloo_device = GlooDevice(binding);
  // Gloo's worker threads run the collectives: 2 as PyTorch, or LAUNCH_GLOO_THREADS.
  options.gloo_threads = env.tuning.gloo_threads;
  SetCudaTransport(env, &options);
  return compat::NewProcessGroup(store, rank, size, options);
}

namespace {

// Whether a connection to `address`:`port` is accepted and kept for `hold` (not reset or closed
// meanwhile).
bool ConnectionHolds(const std::string& address, int port, std::chrono::milliseconds hold) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST;
  addrinfo* found = nullptr;
  if (::getaddrinfo(address.c_str(), std::to_string(port).c_str(), &hints, &found) != 0)
    return false;
  const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool held = false;
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
    pollfd p{fd, POLLRDHUP, 0};
    held = ::poll(&p, 1, static_cast<int>(hold.count())) == 0;
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return held;
}

}  // namespace

Status AwaitStoreHost(const DistEnv& env, std::chrono::milliseconds timeout) {
  const std::vector<std::string> addresses = ResolveHost(env.master_addr);
  if (addresses.empty())
    return Status::IoError("MASTER_ADDR " + env.master_addr + " resolves to nothing");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ConnectionHolds(addresses.front(), env.master_port, std::chrono::milliseconds(100))) {
    if (std::chrono::steady_clock::now() >= deadline)
      return Status::Timeout("no store at " + env.master_addr + ":" +
                             std::to_string(env.master_port) + " within " +
                             std::to_string(timeout.count() / 1000) + " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return Status::Ok();
}

StatusOr<c10::intrusive_ptr<c10d::Store>> ConnectStore(const DistEnv& env, bool host,
                                                       std::chrono::milliseconds timeout) {
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const auto started = std::chrono::steady_clock::now();
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(env.master_port);
    opts.isServer = host;
    opts.numWorkers = env.world_size;
    // Waiting for workers happens in the Gloo rendezvous, under the same timeout; the
    // constructor only has to connect.
    opts.waitWorkers = false;
    opts.timeout = timeout;
    return c10::intrusive_ptr<c10d::Store>(compat::NewTcpStore(env.master_addr, opts));
  } catch (const std::exception& e) {
    const std::string why = compat::ErrorText(e);
    if (host)
      return Status::IoError("rank " + std::to_string(env.rank) +
                             " could not host the process-group store at " + where +
                             " (is the port in use?): " + why);
    const std::string head =
        "rank " + std::to_string(env.rank) + " could not reach the process-group store at " + where;
    const std::string seconds = std::to_string(timeout.count() / 1000) + " s";
    // A signal ends the wait sooner (the agent stopping this rank): not a timeout.
    const auto elapsed = std::chrono::steady_clock::now() - started;
    if (!TimedOut(why, elapsed, timeout))
      return Status::IoError(head + ": failed after " + Seconds(elapsed) + " (of its " + seconds +
                             " timeout): " + why);
    return Status::Timeout(head + " within " + seconds +
                           " (is MASTER_ADDR right and rank 0 running?): " + why);
  }
}

StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateGroupOver(
    const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, int rank, int size,
    const DistEnv& env, std::chrono::milliseconds timeout) {
  const std::string seconds = std::to_string(timeout.count() / 1000) + " s";
  const std::string tag = "/" + std::to_string(env.restart_count) + "/" + name;
  const std::string what = "rank " + std::to_string(env.rank) + ": Gloo process group '" + name +
                           "' of " + std::to_string(size) + " ranks via store " + env.master_addr +
                           ":" + std::to_string(env.master_port);
  StatusOr<GlooBinding> binding = ChooseGlooBinding(env.master_addr);
  if (!binding.ok()) return binding.status().WithContext(what);
  // Gloo, and NCCL for CUDA tensors where LibTorch has it.
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  const auto started = std::chrono::steady_clock::now();
  // The sockets that appear while the group forms are its connections (Gloo's pairs, the
  // leaders' across hosts), for Abandon: but for the store's, nothing else of this process
  // opens sockets while the group forms.
  const std::vector<int> sockets_before = ConnectedSockets(env.master_port);
  try {
    // A prefix per group and restart keeps keys of an earlier attempt from confusing this one.
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("launch_pg" + tag, store);
    group = NewGroup(prefixed, rank, size, env, timeout, *binding);
  } catch (const std::exception& e) {
    const auto elapsed = std::chrono::steady_clock::now() - started;
    const std::string where = what + ", this rank on " + binding->Describe();
    // Gloo throws at once when a peer's address refuses the connection; only a failure at the
    // deadline is the deadline's.
    const std::string why = compat::ErrorText(e);
    const std::string hint = LoopbackPeerHint(why, *binding, env.master_addr);
    if (TimedOut(why, elapsed, timeout))
      return Status::Timeout(where + ", did not form within " + seconds + ": " + why + hint);
    return Status::IoError(where + ", failed after " + Seconds(elapsed) + " (of its " + seconds +
                           " timeout): " + why + hint);
  }
  // After Gloo formed, so every rank is known to reach the store. Its own prefix per group and
  // restart, like Gloo's: a restarted job builds a fresh segment.
  auto shm_store = c10::make_intrusive<c10d::PrefixStore>("launch_shm" + tag, store);
  // The transports' operations wait for a peer as long as Gloo's collectives do.
  const std::chrono::milliseconds collective_timeout =
      env.collective_timeout.count() > 0 ? env.collective_timeout : timeout;
  ShmAllReduceOptions shm_options;
  shm_options.timeout = collective_timeout;
  LAUNCH_ASSIGN_OR_RETURN(
      ShmSetup shm,
      ShmAllReduce::Create(*shm_store, rank, size, env.tuning.shm_allreduce, shm_options));
  std::unique_ptr<ShmPointToPoint> p2p;
  if (shm.shm) {
    ShmPointToPointOptions p2p_options;
    p2p_options.timeout = collective_timeout;
    p2p = std::make_unique<ShmPointToPoint>(shm_store, rank, size, shm.shm->pids(), p2p_options);
  }
  // Ranks on several hosts: shared memory inside each, Gloo between the hosts' leaders. Its own
  // prefix per group and restart, like the others.
  std::unique_ptr<HierarchicalAllReduce> hierarchical;
  std::string why_not = shm.reason;
  if (!shm.shm && !shm.hosts.empty()) {
    auto hier_store = c10::make_intrusive<c10d::PrefixStore>("launch_hier" + tag, store);
    LeaderGroupFactory leaders = [&](const c10::intrusive_ptr<c10d::Store>& s, int r, int n) {
      return NewGroup(s, r, n, env, timeout, *binding);
    };
    LAUNCH_ASSIGN_OR_RETURN(
        HierarchicalSetup setup,
        HierarchicalAllReduce::Create(hier_store, rank, shm.hosts, leaders, shm_options));
    hierarchical = std::move(setup.hierarchical);
    if (!hierarchical && setup.reason != why_not) why_not += "; not hierarchical: " + setup.reason;
  }
  auto pg = c10::make_intrusive<CountingProcessGroup>(group, std::move(shm.shm), std::move(p2p),
                                                      std::move(hierarchical));
  std::vector<int> sockets;
  const std::vector<int> sockets_after = ConnectedSockets(env.master_port);
  std::set_difference(sockets_after.begin(), sockets_after.end(), sockets_before.begin(),
                      sockets_before.end(), std::back_inserter(sockets));
  pg->set_sockets(sockets);
  // Hang forensics when the agent asked for them (LAUNCH_COLLECTIVE_RING): every group of this
  // process records into the one ring, each under its own name.
  pg->AttachRing(CollectiveRing::ForProcess(env.rank), name);
  // Where Gloo binds is part of the line: across hosts it is what a user checks first.
  if (pg->hierarchical())
    pg->set_allreduce_transport(pg->hierarchical()->Describe() + " (this rank on " +
                                binding->Describe() + ")");
  else if (!pg->shm())
    pg->set_allreduce_transport("Gloo (" + why_not + "; this rank on " + binding->Describe() + ")");
  return pg;
}

StatusOr<c10::intrusive_ptr<CountingProcessGroup>> CreateProcessGroup(
    const DistEnv& env, std::chrono::milliseconds timeout) {
  LAUNCH_ASSIGN_OR_RETURN(auto store,
                          ConnectStore(env, env.rank == 0 && !env.use_agent_store, timeout));
  return CreateGroupOver(store, "world", env.rank, env.world_size, env, timeout);
}

void AllReduceFlat(c10d::ProcessGroup& pg, const std::vector<at::Tensor>& tensors,
                   int64_t divisor) {
  std::vector<std::pair<c10::ScalarType, std::vector<size_t>>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == tensors[i].scalar_type(); });
    if (it == groups.end()) {
      groups.push_back({tensors[i].scalar_type(), {}});
      it = groups.end() - 1;
    }
    it->second.push_back(i);
  }
  at::NoGradGuard no_grad;
  for (const auto& [dtype, members] : groups) {
    std::vector<at::Tensor> parts;
    for (size_t i : members) parts.push_back(tensors[i].detach().reshape({-1}));
    std::vector<at::Tensor> flat = {at::cat(parts)};
    pg.allreduce(flat, c10d::AllreduceOptions())->wait();
    if (divisor != 1) flat[0].div_(divisor);
    int64_t offset = 0;
    for (size_t i : members) {
      const int64_t n = tensors[i].numel();
      tensors[i].detach().copy_(flat[0].narrow(0, offset, n).view_as(tensors[i]));
      offset += n;
    }
  }
}

void BroadcastFromRank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                        std::vector<at::Tensor> tensors, int root) {
  if (tensors.empty()) return;
  // One buffer of up to 250 MB per call: a model's parameters usually go in one broadcast.
  constexpr size_t kBucketBytes = 250u << 20;
  at::NoGradGuard no_grad;
  for (auto& t : tensors) t = t.detach();
  c10d::broadcast_coalesced(pg, tensors, kBucketBytes, root);
}

}  // namespace launch::trainer
