#pragma once

// Synchronised batch normalisation, as torch.nn.SyncBatchNorm: in training, a batch's
// statistics are those of the whole data-parallel batch (every replica's rows together), not of
// this replica's share. The forward all-reduces each channel's sum, sum of squares and element
// count over the group; the backward all-reduces the two gradient terms (sum of the output
// gradient, and of it times the centred input). With the gradients then averaged (ddp) or summed
// (dp) as usual, N replicas train exactly as one process on the global batch would, BatchNorm
// included. In evaluation (or without a group) it is BatchNorm: the running statistics, nothing
// communicated.
//
// Running statistics follow BatchNorm's rule with the global batch's mean and unbiased
// variance, so they stay equal on every replica. Parameter and buffer names are BatchNorm's
// (weight, bias, running_mean, running_var, num_batches_tracked): state dicts load into either,
// in C++ or in PyTorch.
//
// Use: build the model with SyncBatchNorm where BatchNorm would be, or convert a model whose
// BatchNorm modules are reached through its children (a Sequential, a module that looks its
// submodules up by name) with ConvertSyncBatchNorm, as PyTorch's convert_sync_batchnorm; then
// `train.parallel.sync_batchnorm: true` makes Accelerator::Prepare attach the group (ddp: the
// processes; dp: the replicas on their threads). A C++ member holder that points at the old
// BatchNorm is not redirected by a conversion (C++ has no attribute lookup): build those with
// SyncBatchNorm.
//
// Thread-safety: a module belongs to one replica (one thread). Collective: every member of the
// group runs the same sequence of training forwards and backwards through the same layers.

#include <memory>
#include <string>

#include <torch/torch.h>

#include "base/status.h"

namespace c10d {
class ProcessGroup;
}  // namespace c10d

namespace launch::trainer {

// The replicas whose batches one set of statistics covers. Held by the modules and by the
// autograd graph of a forward (so it lives until that forward's backward ran).
class BatchNormGroup : public torch::CustomClassHolder {
 public:
  // Sums `values` (a small float64 vector) over the members, in place. Every member calls it
  // the same number of times, in the same order. Throws c10::Error when a peer failed.
  virtual void AllReduceSum(torch::Tensor& values) = 0;
};

// The group of a process group's ranks (ddp): an all-reduce on `pg`, in the order of the
// gradient buckets' all-reduces (the same order on every rank, as PyTorch's SyncBatchNorm
// shares DDP's group). `pg` must outlive the group's use.
c10::intrusive_ptr<BatchNormGroup> ProcessBatchNormGroup(c10::intrusive_ptr<c10d::ProcessGroup> pg);

// The group of replicas on threads of this process (dp): one member handle per replica, all
// meeting in one rendezvous. SetActive(n) says how many (the first n) take part in the next
// forward and backward (and starts over after a Break). REQUIRES: the members' forwards run
// concurrently (one at a time they would wait for each other forever).
class ThreadBatchNormGroup {
 public:
  explicit ThreadBatchNormGroup(int members);
  ~ThreadBatchNormGroup();
  c10::intrusive_ptr<BatchNormGroup> member(int k) const;
  void SetActive(int n);
  // A member failed (threw) in this forward or backward: the members waiting in a rendezvous,
  // and any that reach one before the next SetActive, throw instead of waiting for it.
  void Break();

  struct Rendezvous;  // where the members meet (sync_batchnorm.cc)

 private:
  std::shared_ptr<Rendezvous> rendezvous_;
  std::vector<c10::intrusive_ptr<BatchNormGroup>> members_;
};

// BatchNorm over N x C x ... inputs (1d, 2d and 3d alike) whose training statistics are the
// group's. Options are BatchNorm's (momentum unset: the cumulative average, as PyTorch).
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  explicit SyncBatchNormImpl(int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& input);
  // The group whose batches the statistics cover; null (the default): this replica's batch
  // alone, which is BatchNorm.
  void set_group(c10::intrusive_ptr<BatchNormGroup> group) { group_ = std::move(group); }
  const c10::intrusive_ptr<BatchNormGroup>& group() const { return group_; }
  void pretty_print(std::ostream& stream) const override;

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  c10::intrusive_ptr<BatchNormGroup> group_;
};
TORCH_MODULE(SyncBatchNorm);

// PyTorch's convert_sync_batchnorm: every BatchNorm1d/2d/3d reached through `module`'s children
// (recursively, Sequentials included) becomes a SyncBatchNorm holding its options, parameters,
// buffers and training flag. Returns the module to use: `module` itself, converted in place,
// or a new one when `module` is itself a BatchNorm or a Sequential (a Sequential runs its own
// list, so it is rebuilt around the same other entries). `converted` (optional) receives how
// many were replaced.
std::shared_ptr<torch::nn::Module> ConvertSyncBatchNorm(std::shared_ptr<torch::nn::Module> module,
                                                        int* converted = nullptr);

// Sets `group` on every SyncBatchNorm of `module` (itself included); returns how many.
int SetBatchNormGroup(torch::nn::Module& module, const c10::intrusive_ptr<BatchNormGroup>& group);
// The same for `train.parallel.sync_batchnorm`: InvalidConfig naming the key when `module` has
// no SyncBatchNorm (the option would silently do nothing).
Status AttachBatchNormGroup(torch::nn::Module& module,
                            const c10::intrusive_ptr<BatchNormGroup>& group);

}  // namespace launch::trainer
