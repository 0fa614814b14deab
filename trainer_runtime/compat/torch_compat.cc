#include "trainer_runtime/compat/torch_compat.h"

#include <dlfcn.h>

#include <sstream>
#include <type_traits>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#if defined(USE_C10D_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace launch::trainer::compat {

std::string LibTorchVersion() { return TORCH_VERSION; }

std::string LoadedLibTorchPath() {
  // at::globalContext is defined in libtorch_cpu (not inline): the object holding it is the
  // library this process runs on, wherever RUNPATH or LD_LIBRARY_PATH found it.
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&at::globalContext), &info) == 0 || !info.dli_fname)
    return "";
  return info.dli_fname;
}

c10::Error MakeError(std::string message) {
#if TORCH_VERSION_MAJOR >= 2
  return c10::Error(std::move(message), /*backtrace=*/nullptr);
#else
  return c10::Error(std::move(message), /*backtrace=*/"");
#endif
}

std::exception_ptr ErrorPtr(std::string message) {
  return std::make_exception_ptr(MakeError(std::move(message)));
}

std::string ErrorText(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  return c10 ? c10->what_without_backtrace() : e.what();
}

c10::intrusive_ptr<c10d::TCPStore> NewTcpStore(const std::string& host,
                                               c10d::TCPStoreOptions options) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 2)
  options.useLibUV = false;
#endif
  return c10::make_intrusive<c10d::TCPStore>(host, options);
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
bool AutocastEnabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }
at::ScalarType AutocastDtype(c10::DeviceType device) {
  return at::autocast::get_autocast_dtype(device);
}
void SetAutocast(c10::DeviceType device, bool enabled, at::ScalarType dtype) {
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
}
#else
// Before 2.4 each device type had its own calls; CUDA's are the "gpu" ones.
bool AutocastEnabled(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled()
                                         : at::autocast::is_cpu_enabled();
}
at::ScalarType AutocastDtype(c10::DeviceType device) {
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                         : at::autocast::get_autocast_cpu_dtype();
}
void SetAutocast(c10::DeviceType device, bool enabled, at::ScalarType dtype) {
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
}
#endif

namespace {

using Params = std::vector<at::Tensor>;
using Buckets = std::vector<std::vector<size_t>>;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
using Names = std::unordered_map<size_t, std::string>;

// 1.13 to 2.6: per-bucket size limits after the bucket indices.
constexpr bool kReducerWithLimits =
    std::is_constructible_v<c10d::Reducer, Params, Buckets, const std::vector<size_t>&, Group,
                            std::vector<bool>, int64_t, bool, bool, Names, int64_t>;
// 2.11: no limits; skip_all_reduce_unused_params, use_python_reducer, bucket caps.
constexpr bool kReducerWithCapList =
    std::is_constructible_v<c10d::Reducer, Params, Buckets, Group, std::vector<bool>, int64_t, bool,
                            bool, Names, int64_t, bool, bool, std::vector<int64_t>>;
// In between: no limits; skip_all_reduce_unused_params, use_python_reducer.
constexpr bool kReducerWithFlags =
    std::is_constructible_v<c10d::Reducer, Params, Buckets, Group, std::vector<bool>, int64_t, bool,
                            bool, Names, int64_t, bool, bool>;
static_assert(kReducerWithLimits || kReducerWithCapList || kReducerWithFlags,
              "this LibTorch's c10d::Reducer constructor is not one torch_compat.cc knows");

}  // namespace

std::unique_ptr<c10d::Reducer> NewReducer(Params params, Buckets buckets,
                                          const std::vector<size_t>& bucket_limits, Group group,
                                          int64_t bucket_bytes_cap, bool find_unused_parameters,
                                          bool gradient_as_bucket_view, Names param_names,
                                          int64_t first_bucket_bytes_cap) {
  std::vector<bool> sparse(params.size(), false);
  if constexpr (kReducerWithLimits) {
    return std::make_unique<c10d::Reducer>(std::move(params), std::move(buckets), bucket_limits,
                                           std::move(group), std::move(sparse), bucket_bytes_cap,
                                           find_unused_parameters, gradient_as_bucket_view,
                                           std::move(param_names), first_bucket_bytes_cap);
  } else if constexpr (kReducerWithCapList) {
    return std::make_unique<c10d::Reducer>(
        std::move(params), std::move(buckets), std::move(group), std::move(sparse),
        bucket_bytes_cap, find_unused_parameters, gradient_as_bucket_view, std::move(param_names),
        first_bucket_bytes_cap,
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
        std::vector<int64_t>(bucket_limits.begin(), bucket_limits.end()));
  } else {
    return std::make_unique<c10d::Reducer>(
        std::move(params), std::move(buckets), std::move(group), std::move(sparse),
        bucket_bytes_cap, find_unused_parameters, gradient_as_bucket_view, std::move(param_names),
        first_bucket_bytes_cap,
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false);
  }
}

bool HasNccl() {
#if defined(USE_C10D_NCCL) && TORCH_VERSION_MAJOR >= 2
  return true;
#else
  return false;
#endif
}

bool CarriesOverNccl(c10d::ProcessGroup& group, c10::DeviceType device) {
#if TORCH_VERSION_MAJOR >= 2
  try {
    return group.getBackend(device)->getBackendName() == "nccl";
  } catch (const c10::Error&) {
    return false;  // no backend registered for that device type
  }
#else
  (void)device;
  return group.getBackendName() == "nccl";
#endif
}

namespace {

// gloo::Context keeps its timeouts in protected members, and its setter is not inline: a
// LibTorch that carries Gloo inside itself (pip's) exports none of Gloo's symbols. A class
// derived from it may name the members (pointers to members formed through it).
struct GlooContextAccess : ::gloo::Context {
  // Sets the timeout of the collectives that run on `context` from now on (gloo's algorithm
  // options start from it) and of its send/recv (the transport context's).
  static void SetTimeout(::gloo::Context& context, std::chrono::milliseconds timeout) {
    context.*(&GlooContextAccess::timeout_) = timeout;
    const std::shared_ptr<::gloo::transport::Context>& transport =
        context.*(&GlooContextAccess::transportContext_);
    if (transport) transport->setTimeout(timeout);
  }
};

// Gloo's group with one timeout for forming (the store's waits, the pairs' connections) and
// another for its collectives. c10d has one for both; its collectives take the timeout of the
// context they run on (1.13 through gloo's options, 2.x when no per-call timeout is given), so
// the contexts get the collectives' timeout once the group has formed.
class GlooGroup : public c10d::ProcessGroupGloo {
 public:
  GlooGroup(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
            c10::intrusive_ptr<Options> options, std::chrono::milliseconds collective_timeout)
      : ProcessGroupGloo(store, rank, size, std::move(options)) {
    for (const std::shared_ptr<::gloo::Context>& context : contexts_)
      GlooContextAccess::SetTimeout(*context, collective_timeout);
  }
};

}  // namespace

c10::intrusive_ptr<c10d::ProcessGroup> NewProcessGroup(const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int size,
                                                       const GroupOptions& options) {
  const std::chrono::milliseconds collective_timeout =
      options.collective_timeout.count() > 0 ? options.collective_timeout : options.timeout;
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  if (options.gloo_device) gloo_options->devices.push_back(options.gloo_device);
  gloo_options->threads = options.gloo_threads;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo =
      c10::make_intrusive<GlooGroup>(store, rank, size, gloo_options, collective_timeout);
#if TORCH_VERSION_MAJOR >= 2
  // torch.distributed's init_process_group(backend="cpu:gloo,cuda:nccl") in C++: one group
  // whose collectives dispatch on the tensors' device to the backend registered for it.
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
  if (options.cuda_device >= 0 && (options.cuda_over_gloo || !HasNccl()))
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, gloo);
#if defined(USE_C10D_NCCL)
  if (options.cuda_device >= 0 && !options.cuda_over_gloo) {
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = collective_timeout;
    // NCCL keys its own rendezvous off the store too; a prefix keeps it apart from Gloo's.
    auto nccl_store = c10::make_intrusive<c10d::PrefixStore>("nccl", store);
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(nccl_store, rank, size, nccl_options);
    group->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
  }
#endif
  return group;
#else
  return gloo;
#endif
}

namespace {

using StateMap = std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// The key of `param` in a state map keyed by `Key`: 1.13's c10::guts::to_string of the
// TensorImpl pointer is `ostream << pointer`, which the string branch repeats.
template <typename Key>
Key StateKey(const at::Tensor& param) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << param.unsafeGetTensorImpl();
    return text.str();
  } else {
    return param.unsafeGetTensorImpl();
  }
}

}  // namespace

torch::optim::OptimizerParamState* FindParamState(torch::optim::Optimizer& optimizer,
                                                  const at::Tensor& param) {
  auto& state = optimizer.state();
  auto it = state.find(StateKey<StateMap::key_type>(param));
  return it == state.end() ? nullptr : it->second.get();
}

void SetParamState(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                   std::unique_ptr<torch::optim::OptimizerParamState> state) {
  optimizer.state()[StateKey<StateMap::key_type>(param)] = std::move(state);
}

bool HasKernel(const char* op, c10::DeviceType device) {
  const c10::DispatchKey key = c10::computeDispatchKey(c10::nullopt, c10::nullopt, device);
  auto schema = c10::Dispatcher::singleton().findSchema({op, ""});
  return schema && schema->hasKernelForDispatchKey(key);
}

at::Tensor TorchNormAlong(const at::Tensor& t, int64_t dim, bool keepdim) {
  const std::vector<int64_t> dims = {dim};
#if TORCH_VERSION_MAJOR >= 2
  return at::linalg_vector_norm(t, 2, dims, keepdim);
#else
  return at::frobenius_norm(t, dims, keepdim);
#endif
}

bool HasFusedAdam(c10::DeviceType device) {
#if TORCH_VERSION_MAJOR >= 2
  return HasKernel("aten::_fused_adam_", device) && HasKernel("aten::_fused_adamw_", device);
#else
  (void)device;
  return false;  // no _fused_adamw_ at all; 1.13's _fused_adam_ is a CUDA-only prototype
#endif
}

void FusedAdamStep(bool decoupled_weight_decay, at::TensorList params, at::TensorList grads,
                   at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                   at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,
                   double beta1, double beta2, double weight_decay, double eps, bool amsgrad) {
#if TORCH_VERSION_MAJOR >= 2
  // grad_scale and found_inf unset: the gradients arrive as torch::optim's step takes them.
  if (decoupled_weight_decay) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                      beta2, weight_decay, eps, amsgrad, /*maximize=*/false);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1,
                     beta2, weight_decay, eps, amsgrad, /*maximize=*/false);
  }
#else
  throw MakeError("fused Adam kernels need LibTorch 2.0 or later; this is " + LibTorchVersion());
#endif
}

}  // namespace launch::trainer::compat
