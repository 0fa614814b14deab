#pragma once

// Pipeline-parallel schedules and partitions as plain arithmetic (no LibTorch), so both are
// unit-testable without processes.
//
// A schedule is, for one stage, the ordered list of operations it runs in one optimizer step:
// Forward(m) receives micro-batch m's activation from the previous stage (or reads the inputs
// on the first stage), runs the stage and sends its output on (or computes the loss on the
// last stage); Backward(m) receives the gradient of that output (or starts from the loss),
// back-propagates through the stage and sends the input gradient back.
//
//   GPipe: F0 F1 ... F(M-1) B0 B1 ... B(M-1)        all M activations alive at once.
//   1F1B:  warm-up of min(P-1-s, M) forwards on stage s, then alternate one forward and one
//          backward (steady state), then the remaining backwards (cool-down). At most P-s
//          micro-batches are alive on stage s (<= P), whatever M is.
//
// Every stage runs its list in order with blocking receives and asynchronous sends; both
// schedules are deadlock-free under that rule (each receive waits only for an operation that
// appears earlier in the sender's list).
//
// The idle ("bubble") fraction of either schedule with equal per-stage work is
// (P-1)/(M+P-1).

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

struct PipeOp {
  enum class Kind { kForward, kBackward };
  Kind kind = Kind::kForward;
  int micro = 0;  // micro-batch index in 0..M-1
  // Which of this rank's model chunks runs the op: 0 while every rank holds one chunk (GPipe,
  // 1F1B); interleaved schedules give each rank several (Megatron's virtual stages).
  int chunk = 0;

  bool operator==(const PipeOp& o) const {
    return kind == o.kind && micro == o.micro && chunk == o.chunk;
  }
};

// Operations of `stage` (0-based) for one optimizer step of `microbatches` micro-batches.
// REQUIRES: 0 <= stage < stages, microbatches >= 1.
std::vector<PipeOp> BuildPipelineSchedule(config::PipelineSchedule schedule, int stages, int stage,
                                          int microbatches);

// The most micro-batches whose forward ran and whose backward did not yet, over `ops`.
int PeakLiveMicrobatches(const std::vector<PipeOp>& ops);

// "F0 F1 B0 F2 B1 B2" (for logs and test messages).
std::string ScheduleToString(const std::vector<PipeOp>& ops);

// (P-1)/(M+P-1).
double TheoreticalBubble(int stages, int microbatches);

// How many layers each stage gets. `explicit_partition` (train.parallel.partition) wins when
// non-empty; else consecutive layers are balanced by `layer_costs` (parameter counts) by
// minimising the largest stage (every stage gets at least one layer). InvalidConfig, naming the
// keys, when there are more stages than layers, or the explicit partition has the wrong length,
// a non-positive entry, or does not sum to the number of layers.
StatusOr<std::vector<int64_t>> PartitionLayers(const std::vector<int64_t>& layer_costs, int stages,
                                               const std::vector<int64_t>& explicit_partition);

// Splits `batch` rows into `chunks` consecutive, non-empty chunks whose sizes differ by at most
// one (the first batch % chunks chunks get the extra row). Returns (offset, rows) per chunk.
// REQUIRES: 1 <= chunks <= batch.
std::vector<std::pair<int64_t, int64_t>> SplitRows(int64_t batch, int64_t chunks);

// SplitRows' precondition checked against the rows a batch really has (the loader's batch
// size, which may differ from train.batch_size): InvalidArgument naming `key` (the setting that
// asks for `chunks` chunks: "train.parallel.microbatches", "train.parallel.replicas") and both
// numbers when batch < chunks, so no chunk is ever empty.
Status CheckRowsFor(int64_t batch, int64_t chunks, const std::string& key);

}  // namespace launch::trainer
