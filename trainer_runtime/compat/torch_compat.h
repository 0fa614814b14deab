#pragma once

// The one place where the LibTorch versions the trainer builds against differ: Debian 12's 1.13
// and 2.x (Debian 13's 2.6, pytorch.org's and pip's LibTorch). Code elsewhere in
// trainer_runtime calls these and never tests TORCH_VERSION_* itself.
//
// What changed between them, as far as the trainer sees it:
//   - c10::Error's (message, backtrace) constructor: the backtrace was a string in 1.13 and is a
//     lazily computed value since 2.0. MakeError builds one without a backtrace in both.
//   - ProcessGroupGloo was a c10d::ProcessGroup in 1.13. Since 2.0 it is a c10d::Backend that a
//     c10d::ProcessGroup dispatches to by the tensors' device; NewProcessGroup registers it for
//     CPU tensors (and ProcessGroupNCCL for CUDA tensors where LibTorch has it), the way
//     torch.distributed does for backend="cpu:gloo,cuda:nccl".
//   - TCPStore's server runs on libuv by default since 2.4, and Debian's LibTorch 2.6 is built
//     without it (constructing one fails). NewTcpStore keeps the server 1.13 had.
//   - c10d::Reducer's constructor: 2.x after 2.6 dropped the per-bucket size limits and added
//     arguments (2.11: a list of bucket caps). NewReducer calls whichever this LibTorch has,
//     chosen by what the constructor accepts, not by version number.
//   - CPU autocast's accessors take the device type since 2.4 (the CPU-named ones are
//     deprecated and warn at run time); the Cpu* functions below hide which.
//   - torch::optim::Optimizer::state() is keyed by the parameter's TensorImpl address printed
//     as a string in 1.13 (c10::guts::to_string, gone since) and by the address itself in 2.x.
//     FindParamState and SetParamState build the key this LibTorch's map has, chosen by its
//     key type, not by version number.
//   - The fused Adam and AdamW kernels (at::_fused_adam_, at::_fused_adamw_): 1.13 declares only
//     a CUDA _fused_adam_ prototype and no AdamW; 2.0 has both for CUDA, 2.4 adds CPU kernels.
//     FusedAdamStep is compiled where both are declared (2.x); HasFusedAdam asks the
//     dispatcher whether both have a kernel for a device type, not the version number.
//
// Internal to trainer_runtime (includes LibTorch).

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace c10d {
class Reducer;
}  // namespace c10d

namespace gloo::transport {
class Device;
}  // namespace gloo::transport

namespace launch::trainer::compat {

// The LibTorch the trainer was compiled against, e.g. "2.6.0".
std::string LibTorchVersion();
// The file of the LibTorch library this process loaded (libtorch_cpu.so's path, as the dynamic
// loader resolved it), or "" when the loader cannot say.
std::string LoadedLibTorchPath();

// A c10::Error whose msg() is `message` and whose what() is `message` with no backtrace or
// source location (1.13 appends a newline).
c10::Error MakeError(std::string message);
// The same as an exception_ptr, for Future::setError.
std::exception_ptr ErrorPtr(std::string message);
// What `e` says, for a message: a c10::Error without the C++ backtrace 1.13 appends to what().
std::string ErrorText(const std::exception& e);

// A TCPStore client (and server, when `options.isServer`) at `host`, on the classic server.
c10::intrusive_ptr<c10d::TCPStore> NewTcpStore(const std::string& host,
                                               c10d::TCPStoreOptions options);

// PyTorch DDP's reducer over `group`: `buckets` and `bucket_limits` as
// c10d::compute_bucket_assignment_by_size returns them, no sparse gradients.
std::unique_ptr<c10d::Reducer> NewReducer(
    std::vector<at::Tensor> params, std::vector<std::vector<size_t>> buckets,
    const std::vector<size_t>& bucket_limits, c10::intrusive_ptr<c10d::ProcessGroup> group,
    int64_t bucket_bytes_cap, bool find_unused_parameters, bool gradient_as_bucket_view,
    std::unordered_map<size_t, std::string> param_names, int64_t first_bucket_bytes_cap);

// This thread's autocast state for one device type, CPU or CUDA (torch.autocast(device_type)).
// Setting CUDA's on a CPU-only LibTorch only records it: no CUDA operator runs there.
bool AutocastEnabled(c10::DeviceType device);
at::ScalarType AutocastDtype(c10::DeviceType device);
void SetAutocast(c10::DeviceType device, bool enabled, at::ScalarType dtype);

// True when this LibTorch was built with ProcessGroupNCCL (a CUDA LibTorch); NewProcessGroup
// then also serves CUDA tensors through NCCL.
bool HasNccl();

// Whether `group` carries tensors of `device` type over NCCL (false where no backend serves it).
bool CarriesOverNccl(c10d::ProcessGroup& group, c10::DeviceType device);

struct GroupOptions {
  std::chrono::milliseconds timeout{300000};  // how long the group waits to form
  // How long each collective waits for a peer; 0: `timeout`.
  std::chrono::milliseconds collective_timeout{0};
  std::shared_ptr<::gloo::transport::Device> gloo_device;
  int gloo_threads = 2;
  // The CUDA device this rank computes on (Platform::cuda_device), or -1 on the CPU.
  int cuda_device = -1;
  // With cuda_device >= 0: CUDA tensors travel over Gloo instead of NCCL (Platform's backend:
  // ranks sharing one GPU, which NCCL refuses).
  bool cuda_over_gloo = false;
};

// A process group of `size` ranks over `store`: Gloo for CPU tensors and, where HasNccl() and
// `options.cuda_device` >= 0, NCCL for CUDA tensors (Gloo for them with cuda_over_gloo; Gloo
// carries CUDA tensors on LibTorch 1.13, which has no NCCL here). Blocks until every rank has
// joined (Gloo's rendezvous through the store); throws what the backend throws when they do not.
c10::intrusive_ptr<c10d::ProcessGroup> NewProcessGroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int size,
                                                       const GroupOptions& options);

// The state `optimizer` keeps for `param` (one of its parameters), or null when it has none (not
// stepped yet).
torch::optim::OptimizerParamState* FindParamState(torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& param);
// Replaces the state `optimizer` keeps for `param` with `state` (of the optimizer's own
// OptimizerParamState subclass, or its step casts fail).
void SetParamState(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   std::unique_ptr<torch::optim::OptimizerParamState> state);

// Whether operator `op` ("aten::_amp_update_scale_") is declared and has a kernel for tensors of
// `device` in this LibTorch (asked of the dispatcher, not of the version number).
bool HasKernel(const char* op, c10::DeviceType device);

// torch.norm(t, dim=dim, keepdim=keepdim) as this LibTorch's Python computes it (its 2-norm
// along `dim`): 1.13 calls frobenius_norm, 2.x linalg.vector_norm. The same bits as Python's.
at::Tensor TorchNormAlong(const at::Tensor& t, int64_t dim, bool keepdim);

// Whether this LibTorch steps Adam and AdamW with fused kernels for tensors of `device` (both
// at::_fused_adam_ and at::_fused_adamw_ declared and registered for it).
bool HasFusedAdam(c10::DeviceType device);

// One fused Adam (`decoupled_weight_decay` false: weight_decay * param joins the gradient) or
// AdamW (true: the parameter shrinks by lr * weight_decay) step, elementwise over parallel
// lists; `max_exp_avg_sqs` is empty unless `amsgrad`; `state_steps` are float32 scalars on the
// tensors' device holding each tensor's step count after this step (the kernels read them).
// REQUIRES: HasFusedAdam for the tensors' device; one device and dtype in all lists.
void FusedAdamStep(bool decoupled_weight_decay, at::TensorList params, at::TensorList grads,
                   at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                   at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,
                   double beta1, double beta2, double weight_decay, double eps, bool amsgrad);

}  // namespace launch::trainer::compat
