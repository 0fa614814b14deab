#pragma once

// Checkpoint files (LibTorch archives, each written atomically and streamed to its file as it is
// serialised: base/files.h AtomicFileWriter; read back from the file, not from a copy in memory).
// A checkpoint is a folder of them, committed as a whole by Accelerator::SaveState (accelerator.h):
// model files with parameters, buffers and optimizer state, and one file per rank with the loop
// position and that rank's RNG state.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "trainer_runtime/model/model.h"

namespace launch::trainer {

struct TrainState {
  int64_t step = 0;            // optimizer steps done
  int64_t epoch = 0;           // data-loader position of the next micro-batch ...
  int64_t batch_in_epoch = 0;  // ... (epoch, batch within the epoch, counted from epoch_start)
  int64_t samples_seen = 0;    // per rank
  int64_t world_size = 1;      // the world that wrote it (data positions depend on it)
  // Written since checkpoints survive a change of world size (sampler.h); a checkpoint from
  // before has data_world 0, and a resume at another world size then skips to the next epoch.
  int64_t data_world = 0;           // data-parallel ranks that wrote it (world_size but pipeline)
  int64_t epoch_start = 0;          // global position of the epoch's batch 0 (0 unless taken over)
  int64_t epoch_offset = 0;         // global samples of `epoch` consumed: the next batch's position
  int64_t samples_seen_global = 0;  // samples taken by all data-parallel ranks, all runs
  int64_t origin_data_world = 0;    // data-parallel world the run started with (0: data_world)
  int64_t origin_batch_size = 0;    // its per-rank batch size (0: unknown, from before it was kept)
  // A program's LR-schedule anchor (Accelerator::ScheduleAnchor): step -1 = none.
  int64_t anchor_step = -1;
  double anchor_position = 0;
  double anchor_slope = 1;
  // mixed_precision fp16's loss scaler (model/loss_scaler.h): its scale (0: none recorded),
  // clean steps since its last change, and the steps it skipped.
  double loss_scale = 0;
  int64_t scale_growth_tracker = 0;
  int64_t skipped_steps = 0;
};

// The model file of a checkpoint: parameters ("param/<name>"), buffers ("buffer/<name>") and
// the optimizer's state. Written by one rank per distinct model state (Accelerator::SaveState
// decides which). IoError with the path on failure.
Status SaveModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer);
// Restores what SaveModelState wrote. The model must have the same parameter names and shapes
// (InvalidConfig naming the first mismatch).
Status LoadModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer);
// The same file from tensors by name: `params` in Model::NamedParameters order, the optimizer's
// settings (its parameter groups' options) and, when `optimizer_state`, its state.
Status SaveModelTensors(const std::string& path, const NamedTensors& params,
                        const NamedTensors& buffers, torch::optim::Optimizer& optimizer,
                        bool optimizer_state);

// A model folder of a checkpoint that any layout can read: `dir`/model.pt holds the parameters,
// buffers and the optimizer's settings, and the optimizer's state is in pieces (below: one file,
// zero_rank0.pt, a whole piece per parameter, and the index zero_index.pt with the parameters'
// names), so that ZeRO at any world size and another tensor or pipeline layout (state/reshard.h)
// re-cut it. An optimizer of another type than the five, or one holding a tensor that is not a
// trained parameter, keeps its state in model.pt (the
// folder then re-cuts only where the layout keeps every parameter whole). IoError naming the
// file.
Status SaveModelFolder(const std::string& dir, const Model& model,
                       torch::optim::Optimizer& optimizer);

// --- In-place recovery: a live peer's state, in memory (Accelerator, "In-place recovery") ------
// Parameters, buffers, optimizer state and `state` (the loop position; no RNG state: in-place
// recovery derives each micro-batch's stream from (seed, rank, step)) as the bytes of one
// LibTorch archive, the same keys as the model file. IoError when LibTorch cannot serialise.
StatusOr<std::string> SerializeReplicaState(const Model& model, torch::optim::Optimizer& optimizer,
                                            const TrainState& state);
// Restores what SerializeReplicaState wrote into `model` (parameters; buffers only when
// `buffers`) and `optimizer`, and returns its TrainState. InvalidConfig naming the first
// tensor whose shape differs (another model).
StatusOr<TrainState> RestoreReplicaState(const std::string& bytes, const Model& model,
                                         torch::optim::Optimizer& optimizer, bool buffers);

// --- In-place recovery from snapshots (Accelerator, recover_snapshot_every) --------------------
// What a rank holds of the run's state, in memory: the strategy writes its tensors (and
// optimizers) into an archive, `state` is added, and the bytes are kept here and by a peer.
// The model file's keys (WriteModelKeys throws c10::Error; ReadModelKeys names `what` and the
// first key it cannot restore, as ReadModel does).
void WriteModelKeys(torch::serialize::OutputArchive& archive, const Model& model,
                    torch::optim::Optimizer& optimizer);
Status ReadModelKeys(torch::serialize::InputArchive& archive, const std::string& what,
                     const Model& model, torch::optim::Optimizer& optimizer);
// `write`'s keys and `state` as the bytes of one archive, handed to `sink` as LibTorch writes
// them (OutputArchive::save_to's contract: returns the bytes it took; fewer fails), or
// returned whole. IoError when LibTorch (or the sink) cannot.
Status SerializeImageTo(const std::function<size_t(const void*, size_t)>& sink,
                        const std::function<void(torch::serialize::OutputArchive&)>& write,
                        const TrainState& state);
StatusOr<std::string> SerializeImage(
    const std::function<void(torch::serialize::OutputArchive&)>& write, const TrainState& state);
// Hands `read` the archive in `bytes` and returns its TrainState. IoError naming `what`.
StatusOr<TrainState> RestoreImage(
    std::string_view bytes, const std::string& what,
    const std::function<Status(torch::serialize::InputArchive&)>& read);

// --- Optimizer state in pieces (ZeRO's shards), independent of how it was cut -------------
//
// A ZeRO rank's optimizer steps pieces of the trained parameters (parallel/zero.h). A checkpoint
// keeps, per rank, each piece's element range and its state tensors by name (as torch::optim's
// OptimizerParamState subclasses name them: Adam/AdamW step, exp_avg, exp_avg_sq,
// max_exp_avg_sq; SGD momentum_buffer; RMSprop step, square_avg, momentum_buffer, grad_avg;
// Adagrad step, sum), and rank 0 an index of every rank's ranges. Any other cut (another world
// size, stage or unit size, or whole parameters in one process) is assembled from them.
// Optimizer state is elementwise in all five optimizers, which is what makes this exact.

// One parameter's optimizer state: the step count (-1: the type keeps none) and the defined
// state tensors by name, flattened.
struct FlatState {
  int64_t step = -1;
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
};

// Elements [begin, end) of trained parameter `param` (its index in Model::Parameters()),
// flattened.
struct PieceRange {
  int64_t param = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

// A piece an optimizer steps: `tensor` is one of the optimizer's parameters and holds the
// elements of `range` in order (a ZeRO segment, or a whole parameter).
struct ParamPiece {
  PieceRange range;
  torch::Tensor tensor;
};

// Rank `rank`'s shard file in checkpoint folder `dir`: dir/zero_rank<rank>.pt.
std::string ShardFile(const std::string& dir, int64_t rank);
// Writes rank `rank`'s shard file into checkpoint folder `dir`: the range of each of `pieces`
// and `optimizer`'s state of it (nothing for a piece that has none, e.g. before the first
// step). Streamed: the archive refers to the optimizer's own tensors. IoError naming the file;
// InvalidConfig for an optimizer other than the five above.
Status SaveShardedOptimizerState(const std::string& dir, int rank,
                                 torch::optim::Optimizer& optimizer,
                                 const std::vector<ParamPiece>& pieces);
// Writes the folder's index (zero_index.pt; one rank, once): the ranges that each of the
// ranks.size() shard files holds, `layout` (how the shards were cut, for messages) and `names`,
// the trained parameters' names (Model::NamedParameters, whose order the ranges' `param` counts).
Status SaveShardIndex(const std::string& dir, const std::vector<std::vector<PieceRange>>& ranks,
                      const torch::Tensor& layout, const std::vector<std::string>& names);
// Whether `dir` holds a sharded optimizer state (its index).
bool HasShardedOptimizerState(const std::string& dir);
// The parameter names in `dir`'s index. InvalidConfig when the index predates them.
StatusOr<std::vector<std::string>> ShardIndexNames(const std::string& dir);
// The optimizer state of each trained parameter of folder `dir`, whole (flat), assembled from
// its pieces; `params` are tensors shaped as the folder's parameters (index order), nullopt
// where a parameter has none. Errors as LoadShardedOptimizerState's.
StatusOr<std::vector<std::optional<FlatState>>> ReadParamStates(
    const std::string& dir, const std::vector<torch::Tensor>& params);
// Writes `states` (one per trained parameter, as ReadParamStates gives them) as one shard file
// with a whole piece per parameter, and its index naming `names`.
Status SaveParamStates(const std::string& dir, const std::vector<std::string>& names,
                       const std::vector<torch::Tensor>& params,
                       const std::vector<std::optional<FlatState>>& states);

// What LoadShardedOptimizerState found.
struct ShardedLoad {
  int64_t written_by = 0;  // shard files in the checkpoint
  int64_t files_read = 0;  // of them, those that met this optimizer's pieces
  bool same_cut = false;   // the pieces are exactly those of one shard file
  torch::Tensor layout;    // as SaveShardIndex got it
};
// Sets `optimizer`'s state of each of `pieces` from the sharded state in `dir`: reads the index,
// then each shard file whose ranges meet `pieces`, one at a time (no more than one in memory),
// copying the overlapping elements of each state tensor into new tensors shaped as the piece.
// A piece the checkpoint has no state for keeps none. Errors (InvalidConfig, naming the file):
// a piece only partly covered, or covered by pieces whose step counts differ; a state tensor
// this optimizer's type does not have; an unreadable file (IoError).
StatusOr<ShardedLoad> LoadShardedOptimizerState(const std::string& dir,
                                                torch::optim::Optimizer& optimizer,
                                                const std::vector<ParamPiece>& pieces);
// The same from state in memory: sets `to`'s state of `pieces` from `from`'s state of
// `from_pieces` (e.g. an unsharded optimizer read from model.pt, `from_pieces` its whole
// parameters). Both optimizers of one type.
Status ReshardOptimizerState(torch::optim::Optimizer& from,
                             const std::vector<ParamPiece>& from_pieces,
                             torch::optim::Optimizer& to, const std::vector<ParamPiece>& pieces);
// The pieces of an unsharded optimizer over `model`: each parameter it holds, whole.
// InvalidConfig when it holds a tensor that is not a trained parameter of `model`.
StatusOr<std::vector<ParamPiece>> WholeParamPieces(const Model& model,
                                                   torch::optim::Optimizer& optimizer);

// A shard file from before the index existed: an optimizer saved whole with `layout`, which
// must equal this run's (InvalidConfig naming both otherwise). IoError naming the path.
Status LoadOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout);

// A file of named tensors that belongs to a strategy rather than to the model (Local SGD's
// outer state: local_sgd.h). Written atomically; IoError naming the path. Loading fills each
// of `tensors` (which must be defined, of the same shapes) from the file: NotFound when the
// file does not exist, InvalidConfig naming the first name that is missing or differs.
Status SaveNamedTensors(const std::string& path,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors);
Status LoadNamedTensors(const std::string& path,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors);

// Any archive, for state the checkpoint does not know the shape of (the user state of
// Accelerator::RegisterForCheckpointing): written atomically (IoError naming the path); read
// from the file without a copy in memory (NotFound when it does not exist, IoError when it is
// unreadable).
Status WriteArchive(torch::serialize::OutputArchive& archive, const std::string& path);
StatusOr<std::unique_ptr<torch::serialize::InputArchive>> ReadArchive(const std::string& path);

// The per-rank file: the loop position and this process's CPU generator state (each rank
// draws its own dropout masks, so each restores its own). Files written before a field existed
// read back with that field's default.
Status SaveRankState(const std::string& path, const TrainState& state);
// Reads it back; restores the default CPU generator when `restore_rng`.
StatusOr<TrainState> LoadRankState(const std::string& path, bool restore_rng);

}  // namespace launch::trainer
