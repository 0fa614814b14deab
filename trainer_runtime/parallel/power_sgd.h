#pragma once

// PowerSGD (Vogels et al. 2019) as PyTorch's powerSGD_hook computes it, for DDP's buckets
// (`parallel.comm_hook: power_sgd`, accelerate's DDPCommunicationHookType.POWER_SGD): each
// gradient of n x m elements (its first dimension by the rest) that is worth it is sent as two
// rank-r factors, P (n x r) and Q (m x r), instead of n x m numbers:
//
//   P = M Q; all-reduce P (sum); orthogonalise P's columns; Q = M^T P; all-reduce Q, / W;
//   M ~ P Q^T.
//
// Vectors, and matrices where (n + m) r x min_compression_rate >= n m, are all-reduced whole
// (averaged). With error feedback each rank adds to its next gradient what compression lost of
// this one (its own error, kept per rank); with warm start each step's Q starts from the last
// one's. Before start_powerSGD_iter synchronised steps, buckets go through `before` (the plain
// average). The first Qs are drawn from LibTorch's CPU generator seeded with the next number of
// numpy.random.RandomState(random_seed).randint(10^9), per bucket, as PyTorch draws them: with
// the same buckets and seed the results equal PyTorch's bit for bit (tested against it).
//
// The state is kept per parameter, not per bucket (PyTorch's keys), so it survives a change of
// bucket layout (a resumed run's first step has the layout of a run's first step, and the
// rebuilt one after it): a checkpoint holds each rank's error and the factors (`Save`), and a
// resumed run continues bit-identical (warm start; without it the Qs drawn per bucket and step
// follow the layout). A lost rank's error is gone with it: PowerSGD is not recovered in place.
//
// The bucket's work after P = M Q (the three all-reduces and the products between them) runs
// on one thread per hook, bucket after bucket in the order the reducer hands them over, so
// every rank issues the collectives in one order while backward goes on.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <torch/serialize/archive.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include "base/status.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"

namespace launch::trainer {

class PowerSgd {
 public:
  // `params`: the model's trained parameters, whose gradients the buckets hold.
  PowerSgd(const config::PowerSgdConfig& cfg, std::vector<at::Tensor> params);
  ~PowerSgd();
  PowerSgd(const PowerSgd&) = delete;
  PowerSgd& operator=(const PowerSgd&) = delete;

  // A hook for a reducer over `pg` (one per reducer; the state is this object's and outlives
  // it). `before` handles the buckets of the first start_powerSGD_iter synchronised steps.
  std::unique_ptr<c10d::CommHookInterface> Hook(c10::intrusive_ptr<CountingProcessGroup> pg,
                                                std::unique_ptr<c10d::CommHookInterface> before);

  // Synchronised steps seen (PowerSGDState.iter).
  int64_t iter() const;
  // Gradient elements of the compressed steps before and after compression
  // (PowerSGDState.compression_stats' totals).
  int64_t numel_before() const;
  int64_t numel_after() const;

  // This rank's state (the step count, the generator's position, each parameter's error and
  // Q). Load: `with_error` false takes another rank's file (a rank the checkpoint did not have:
  // the factors are every rank's alike, the error is not), starting this rank's error at zero.
  void Save(torch::serialize::OutputArchive& archive) const;
  Status Load(torch::serialize::InputArchive& archive, bool with_error);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Exposed for tests: PyTorch's _orthogonalize of a batch of matrices [b, n, r] in place
// (Gram-Schmidt for r <= 2 or half types, else a reduced QR's Q).
void OrthogonalizePowerSgd(at::Tensor& matrices, double epsilon);
// numpy.random.RandomState's legacy randint(0, high) (masked rejection over 32-bit outputs of
// MT19937) for 0 < high <= 2^32, which numpy seeds as std::mt19937 is seeded. `draws` counts the
// generator's outputs consumed.
int64_t NumpyLegacyRandint(std::mt19937& mt, int64_t high, int64_t* draws);

}  // namespace launch::trainer
