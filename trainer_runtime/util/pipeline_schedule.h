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
//
// Two more schedules are built here and checked by simulation (SimulatePipeline), not yet run
// by the pipeline engine, which runs GPipe and 1F1B:
//   Interleaved 1F1B (Megatron's virtual stages): each rank holds v chunks of the model, rank
//          p's chunk c being stage c*P + p of v*P; the bubble shrinks to (P-1)/(v*M+P-1).
//   ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): each backward split into the
//          input's gradient (what the previous stage waits for) and the weights' gradients
//          (which nothing waits for); the weight passes fill the idle time, leaving a third of
//          1F1B's (P-1 passes instead of 3(P-1) when the three kinds take equal time), with
//          1F1B's peak memory (P micro-batches held, on every stage).

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

struct PipeOp {
  // kBackward: the whole backward of the micro-batch through the chunk. A zero-bubble schedule
  // splits it: kBackwardInput (the gradient of the chunk's input, sent back) then, later,
  // kBackwardWeight (the gradients of its parameters).
  enum class Kind { kForward, kBackward, kBackwardInput, kBackwardWeight };
  Kind kind = Kind::kForward;
  int micro = 0;  // micro-batch index in 0..M-1
  // Which of this rank's model chunks runs the op: 0 while every rank holds one chunk (GPipe,
  // 1F1B); interleaved schedules give each rank several (Megatron's virtual stages).
  int chunk = 0;

  bool operator==(const PipeOp& o) const {
    return kind == o.kind && micro == o.micro && chunk == o.chunk;
  }
};

// Operations of `stage` (0-based) for one optimizer step of `microbatches` micro-batches, any
// schedule (`virtual_stages`: interleaved 1F1B's chunks per rank, below).
// REQUIRES: 0 <= stage < stages, microbatches >= 1, and the conditions of the builders below.
std::vector<PipeOp> BuildPipelineSchedule(config::PipelineSchedule schedule, int stages, int stage,
                                          int microbatches, int virtual_stages = 1);

// The messages a schedule sends between two ranks, in order, for one kind of traffic: what
// `ranks[from]` sends to `to` (activations forward, input gradients back) as (chunk, micro) of
// the receiving op. Both transports match messages in order per (sender, receiver, tag), so a
// schedule is runnable only if each receiver posts its receives in the order they are sent
// (the engine checks activations at run time by their headers; ReceiveOrderMatches proves it
// for every schedule in the unit tests).
// true when every rank receives, from each sender and of each kind, in the order it is sent.
bool ReceiveOrderMatches(const std::vector<std::vector<PipeOp>>& ranks, int virtual_stages,
                         std::string* mismatch);

// Interleaved 1F1B on rank `stage` of `stages` (P), each rank holding `virtual_stages` (v)
// chunks: forwards go through the chunks in groups of P micro-batches (micro-batches 0..P-1 on
// chunk 0, the same on chunk 1, ..., then P..2P-1), backwards the same with the chunks in
// reverse; 2*(P-1-stage) + (v-1)*P forwards warm up, then one forward and one backward
// alternate, then the backwards left. REQUIRES: microbatches a multiple of stages (Megatron's
// condition, which keeps the groups whole), virtual_stages >= 1.
std::vector<PipeOp> BuildInterleavedSchedule(int stages, int stage, int microbatches,
                                             int virtual_stages);

// ZB-H1 on `stage` of `stages`: 1F1B's order of forwards and input gradients, each weight pass
// `stage` input gradients after its own (the rest at the end). With equal pass times and
// M >= P the step takes 3M + P - 1 passes (1F1B: 3(M + P - 1)).
std::vector<PipeOp> BuildZeroBubbleSchedule(int stages, int stage, int microbatches);

// The time each kind of operation takes (one chunk, one micro-batch), for SimulatePipeline.
struct PipeCosts {
  double forward = 1;
  double backward = 2;  // kBackward: both gradients
  double backward_input = 1;
  double backward_weight = 1;
};

// What SimulatePipeline found.
struct PipeRun {
  bool completed = false;
  std::string stuck;    // when not: each unfinished stage's next operation
  double makespan = 0;  // time from the first operation to the last
  double bubble = 0;    // idle fraction: 1 - busy time / (ranks x makespan)
};

// Runs every rank's operations (ranks[p], `virtual_stages` chunks per rank as above) with
// blocking receives and asynchronous sends: an operation starts when its rank is free and its
// inputs exist (a forward: the previous stage's forward of the micro-batch; an input gradient,
// whole or split: this stage's forward and the next stage's input gradient; a weight pass: this
// stage's input gradient). Deadlock (no rank can go on) ends it with completed = false.
PipeRun SimulatePipeline(const std::vector<std::vector<PipeOp>>& ranks, int virtual_stages,
                         const PipeCosts& costs);

// The most micro-batches whose forward ran and whose backward (its weight pass, when split) did
// not yet, over `ops` (with several chunks: chunk activations).
int PeakLiveMicrobatches(const std::vector<PipeOp>& ops);

// "F0 F1 B0 F2 B1 B2" (for logs and test messages); a split backward is I (input) and W
// (weights), a chunk other than 0 is written after '@': "F4@1".
std::string ScheduleToString(const std::vector<PipeOp>& ops);

// The idle fraction of `schedule` when every chunk's passes take equal time (a backward twice a
// forward, its halves one each): (P-1)/(M+P-1) for GPipe and 1F1B, (P-1)/(v*M+P-1) for
// interleaved 1F1B, (P-1)/(3M+P-1) for ZB-H1 (M >= P).
double TheoreticalBubble(int stages, int microbatches,
                         config::PipelineSchedule schedule = config::PipelineSchedule::k1F1B,
                         int virtual_stages = 1);

// How many layers each stage gets. `explicit_partition` (train.parallel.partition) wins when
// non-empty; else consecutive layers are balanced by `layer_costs` (parameter counts) by
// minimising the largest stage (every stage gets at least one layer). InvalidConfig, naming the
// keys, when there are more stages than layers, or the explicit partition has the wrong length,
// a non-positive entry, or does not sum to the number of layers.
// With `virtual_stages` above 1 the model is cut into stages x virtual_stages chunks the same way
// (interleaved 1F1B: rank s holds chunks s, s + stages, ...).
StatusOr<std::vector<int64_t>> PartitionLayers(const std::vector<int64_t>& layer_costs, int stages,
                                               const std::vector<int64_t>& explicit_partition,
                                               int virtual_stages = 1);

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
