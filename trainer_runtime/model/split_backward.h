#pragma once

// A backward pass in two halves, for zero-bubble pipeline schedules (ZB-H1, pipeline_schedule.h):
// first the gradient of the stage's input, which the previous stage is waiting for, then, later,
// the gradients of its weights, which nothing waits for and which fill the pipeline's idle time.
//
// The split is made where the work is, in the Linear layers. While a WeightGradStore is active on
// the thread (WeightGradStore::Scope) and grad mode is on, SplitLinear records a graph node whose
// backward computes only dX = dY W and keeps (X, dY) in the store; every other layer (norms,
// embeddings, attention's products) and the Linear's bias back-propagate whole, in the first
// half. Flush() is the second half: dW = dY^T X, accumulated through autograd (a backward
// rooted at the parameters), so the parameters' gradient hooks, ddp's reducer and ZeRO's buckets,
// see them as from any backward pass. Without an active store SplitLinear is
// torch::nn::functional::linear, bit for bit: the built-in layers (tensor_parallel.h, the MLP's
// stages) call it always.
//
// The built-in layers need nothing else; a user's own layer joins by computing its Linear maths
// with SplitLinear. Under autocast the pipeline does not split (its Linear maths run in a lower
// precision than the store keeps): the store is then never active.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "base/mutex.h"

namespace launch::trainer {

class WeightGradStore : public torch::CustomClassHolder {
 public:
  // Makes `store` the active one on this thread for the Scope's life (the previous one after).
  class Scope {
   public:
    explicit Scope(WeightGradStore* store);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    WeightGradStore* previous_;
  };

  // The store Scope made active on this thread; null when none.
  static WeightGradStore* Active();

  // The second half: computes every recorded weight gradient and accumulates them into
  // the parameters' .grad through one autograd backward; empties the store. A no-op when empty.
  void Flush();
  bool empty() const;
  // Bytes of the inputs and output gradients held for Flush.
  int64_t bytes() const;

  // Called by SplitLinear's backward. Thread-safe (autograd may run it on its own threads).
  void Record(torch::Tensor input, torch::Tensor grad_output, torch::Tensor weight);

 private:
  struct Entry {
    torch::Tensor input, grad_output, weight;
  };
  mutable Mutex mu_;
  std::vector<Entry> entries_ GUARDED_BY(mu_);
};

// x W^T + b as torch::nn::functional::linear; while a WeightGradStore is active (above), its
// backward leaves W's gradient to the store's Flush (x W^T and + b are then two operations).
torch::Tensor SplitLinear(const torch::Tensor& input, const torch::Tensor& weight,
                          const torch::Tensor& bias = torch::Tensor());

}  // namespace launch::trainer
