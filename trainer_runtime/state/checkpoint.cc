#include "trainer_runtime/state/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "base/files.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/state/file_sums.h"

namespace launch::trainer {
namespace {

// "meta" holds the integer fields in this order. Fields are only ever appended: an older file
// has a shorter tensor, and the fields it lacks keep their defaults. "schedule": the doubles.
std::array<int64_t*, 14> IntFields(TrainState& s) {
  return {&s.step,
          &s.epoch,
          &s.batch_in_epoch,
          &s.samples_seen,
          &s.world_size,
          &s.data_world,
          &s.epoch_start,
          &s.epoch_offset,
          &s.samples_seen_global,
          &s.origin_data_world,
          &s.anchor_step,
          &s.origin_batch_size,
          &s.scale_growth_tracker,
          &s.skipped_steps};
}

torch::Tensor MetaTensor(TrainState s) {
  std::vector<int64_t> values;
  for (int64_t* field : IntFields(s)) values.push_back(*field);
  return torch::tensor(values, torch::kLong);
}

torch::Tensor ScheduleTensor(const TrainState& s) {
  return torch::tensor({s.anchor_position, s.anchor_slope, s.loss_scale}, torch::kDouble);
}

TrainState FromMeta(const torch::Tensor& meta, const torch::Tensor& schedule) {
  TrainState s;
  const auto fields = IntFields(s);
  auto a = meta.accessor<int64_t, 1>();
  const size_t n = std::min(static_cast<size_t>(a.size(0)), fields.size());
  for (size_t i = 0; i < n; ++i) *fields[i] = a[static_cast<int64_t>(i)];
  if (schedule.defined() && schedule.numel() >= 2) {
    auto d = schedule.accessor<double, 1>();
    s.anchor_position = d[0];
    s.anchor_slope = d[1];
    if (schedule.numel() >= 3) s.loss_scale = d[2];
  }
  return s;
}

// Reads the archive from the file itself (tensors are read record by record into their own
// storage): no copy of the whole file in memory.
StatusOr<std::unique_ptr<torch::serialize::InputArchive>> Open(const std::string& path) {
  // What ReadFile said for a missing file, which callers tell apart from a damaged one.
  if (::access(path.c_str(), R_OK) != 0)
    return Status::NotFound("cannot open '" + path + "': " + std::strerror(errno));
  auto archive = std::make_unique<torch::serialize::InputArchive>();
  try {
    archive->load_from(path);
  } catch (const c10::Error& e) {
    return Status::IoError("checkpoint '" + path +
                           "' is unreadable: " + e.what_without_backtrace());
  }
  return archive;
}

// "[1, 2, 3]" of an integer tensor.
std::string List(const torch::Tensor& t) {
  std::string out = "[";
  const torch::Tensor flat = t.to(torch::kLong).reshape({-1});
  for (int64_t i = 0; i < flat.numel(); ++i)
    out += (i ? ", " : "") + std::to_string(flat[i].item<int64_t>());
  return out + "]";
}

// Streams `archive` into the temp file of an atomic write (base/files.h AtomicFileWriter): the
// file never exists in memory as a whole. A write error is kept by the writer and reported by
// Commit; LibTorch's zip writer is told every write worked, because 1.13's writer, told
// otherwise, throws again from its destructor while the first exception unwinds
// (std::terminate).
// The bytes are hashed as they pass (file_sums.h: a recording writer lists the file).
Status SaveArchive(torch::serialize::OutputArchive& archive, const std::string& path) {
  AtomicFileWriter file(path);
  Sha256 sha;
  try {
    archive.save_to([&file, &sha](const void* bytes, size_t size) -> size_t {
      const std::string_view piece(static_cast<const char*>(bytes), size);
      file.Append(piece);
      sha.Update(piece);
      return size;
    });
  } catch (const c10::Error& e) {
    return Status::IoError("writing checkpoint " + path + ": " + e.what_without_backtrace());
  }
  LAUNCH_RETURN_IF_ERROR(file.Commit().WithContext("checkpoint"));
  RecordWrittenFile(path, sha.HexDigest());
  return Status::Ok();
}

namespace optim = torch::optim;

// Every state tensor name of the five optimizers (a shard file holds those of its type).
constexpr std::array<const char*, 7> kStateNames = {
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "sum"};

// Calls on_tensor(name, tensor&) for each state tensor of `s`, an OptimizerParamState of one of
// the five optimizers, and returns its step counter (null for SGD, which keeps none). *known is
// false for any other type.
template <typename F>
int64_t* VisitState(optim::OptimizerParamState& s, bool* known, F&& on_tensor) {
  *known = true;
  if (auto* a = dynamic_cast<optim::AdamWParamState*>(&s)) {
    on_tensor("exp_avg", a->exp_avg());
    on_tensor("exp_avg_sq", a->exp_avg_sq());
    on_tensor("max_exp_avg_sq", a->max_exp_avg_sq());
    return &a->step();
  }
  if (auto* a = dynamic_cast<optim::AdamParamState*>(&s)) {
    on_tensor("exp_avg", a->exp_avg());
    on_tensor("exp_avg_sq", a->exp_avg_sq());
    on_tensor("max_exp_avg_sq", a->max_exp_avg_sq());
    return &a->step();
  }
  if (auto* a = dynamic_cast<optim::SGDParamState*>(&s)) {
    on_tensor("momentum_buffer", a->momentum_buffer());
    return nullptr;
  }
  if (auto* a = dynamic_cast<optim::RMSpropParamState*>(&s)) {
    on_tensor("square_avg", a->square_avg());
    on_tensor("momentum_buffer", a->momentum_buffer());
    on_tensor("grad_avg", a->grad_avg());
    return &a->step();
  }
  if (auto* a = dynamic_cast<optim::AdagradParamState*>(&s)) {
    on_tensor("sum", a->sum());
    return &a->step();
  }
  *known = false;
  return nullptr;
}

// An empty per-parameter state of `optimizer`'s type; null for a type other than the five.
std::unique_ptr<optim::OptimizerParamState> NewState(const optim::Optimizer& optimizer) {
  if (dynamic_cast<const optim::AdamW*>(&optimizer))
    return std::make_unique<optim::AdamWParamState>();
  if (dynamic_cast<const optim::Adam*>(&optimizer))
    return std::make_unique<optim::AdamParamState>();
  if (dynamic_cast<const optim::SGD*>(&optimizer)) return std::make_unique<optim::SGDParamState>();
  if (dynamic_cast<const optim::RMSprop*>(&optimizer))
    return std::make_unique<optim::RMSpropParamState>();
  if (dynamic_cast<const optim::Adagrad*>(&optimizer))
    return std::make_unique<optim::AdagradParamState>();
  return nullptr;
}

const char* const kUnknownOptimizer =
    "the optimizer's state is checkpointed in pieces for torch::optim's SGD, Adam, AdamW, "
    "RMSprop and Adagrad, not this one";

// `optimizer`'s state of `param`; nullopt when it has none. The tensors are the optimizer's own
// (views where they are contiguous, as they are when the optimizer made them).
StatusOr<std::optional<FlatState>> GetFlatState(optim::Optimizer& optimizer,
                                                const torch::Tensor& param) {
  optim::OptimizerParamState* state = compat::FindParamState(optimizer, param);
  if (!state) return std::optional<FlatState>();
  FlatState flat;
  bool known = false;
  const int64_t* step = VisitState(*state, &known, [&](const char* name, torch::Tensor& t) {
    if (t.defined()) flat.tensors.emplace_back(name, t.reshape({-1}));
  });
  if (!known) return Status::InvalidConfig(kUnknownOptimizer);
  if (step) flat.step = *step;
  return std::optional<FlatState>(std::move(flat));
}

bool Overlap(const PieceRange& a, const PieceRange& b, int64_t* lo, int64_t* hi) {
  if (a.param != b.param) return false;
  *lo = std::max(a.begin, b.begin);
  *hi = std::min(a.end, b.end);
  return *lo < *hi;
}

std::string Describe(const PieceRange& r) {
  return "parameter " + std::to_string(r.param) + " [" + std::to_string(r.begin) + ", " +
         std::to_string(r.end) + ")";
}

// Builds the state of `pieces` from states of other ranges of the same parameters: each Add
// copies the elements a source has in common with the pieces; Install checks that every piece
// with any state got all of it, and sets it.
class StateAssembler {
 public:
  explicit StateAssembler(const std::vector<ParamPiece>& pieces)
      : pieces_(pieces), targets_(pieces.size()) {
    for (size_t i = 0; i < pieces_.size(); ++i) by_param_[pieces_[i].range.param].push_back(i);
  }

  bool Meets(const PieceRange& r) const {
    auto it = by_param_.find(r.param);
    if (it == by_param_.end()) return false;
    int64_t lo = 0, hi = 0;
    for (size_t i : it->second)
      if (Overlap(r, pieces_[i].range, &lo, &hi)) return true;
    return false;
  }

  // `state` is that of range `r` (nullopt: none), read from `source` (for messages).
  Status Add(const PieceRange& r, const std::optional<FlatState>& state,
             const std::string& source) {
    auto it = by_param_.find(r.param);
    if (it == by_param_.end()) return Status::Ok();
    for (size_t i : it->second) {
      const PieceRange& mine = pieces_[i].range;
      int64_t lo = 0, hi = 0;
      if (!Overlap(r, mine, &lo, &hi)) continue;
      Target& t = targets_[i];
      if (!state) {
        t.unstated += hi - lo;
        continue;
      }
      t.stated += hi - lo;
      if (t.step_source.empty()) {
        t.step = state->step;
        t.step_source = source;
      } else if (t.step != state->step) {
        return Status::InvalidConfig("the optimizer state of " + Describe(mine) + " has step " +
                                     std::to_string(t.step) + " in " + t.step_source + " and " +
                                     std::to_string(state->step) + " in " + source +
                                     " (were these files written by one checkpoint?)");
      }
      for (const auto& [name, src] : state->tensors) {
        if (src.numel() != r.end - r.begin)
          return Status::InvalidConfig(source + ": state " + name + " of " + Describe(r) + " has " +
                                       std::to_string(src.numel()) + " elements");
        auto& [dst, covered] = t.tensors[name];
        if (!dst.defined())
          dst = torch::empty({mine.end - mine.begin}, pieces_[i].tensor.options());
        dst.narrow(0, lo - mine.begin, hi - lo).copy_(src.narrow(0, lo - r.begin, hi - lo));
        covered += hi - lo;
      }
    }
    return Status::Ok();
  }

  // Each piece's assembled state (nullopt: none); `from` names the source in messages.
  StatusOr<std::vector<std::optional<FlatState>>> Take(const std::string& from) {
    std::vector<std::optional<FlatState>> out(pieces_.size());
    for (size_t i = 0; i < pieces_.size(); ++i) {
      LAUNCH_RETURN_IF_ERROR(CheckCovered(i, from));
      Target& t = targets_[i];
      if (t.stated == 0) continue;
      FlatState& flat = out[i].emplace();
      flat.step = t.step;
      for (auto& [name, tensor_and_covered] : t.tensors)
        flat.tensors.emplace_back(name, std::move(tensor_and_covered.first));
      t.tensors.clear();
    }
    return out;
  }

  // Sets `optimizer`'s state of every piece that got any; `from` names the source in messages.
  Status Install(optim::Optimizer& optimizer, const std::string& from) {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      Target& t = targets_[i];
      const PieceRange& mine = pieces_[i].range;
      const int64_t n = mine.end - mine.begin;
      LAUNCH_RETURN_IF_ERROR(CheckCovered(i, from));
      if (t.stated == 0) continue;  // not stepped yet: it stays without state
      std::unique_ptr<optim::OptimizerParamState> state = NewState(optimizer);
      if (!state) return Status::InvalidConfig(kUnknownOptimizer);
      size_t used = 0;
      bool known = false;
      int64_t* step = VisitState(*state, &known, [&](const char* name, torch::Tensor& field) {
        auto it = t.tensors.find(name);
        if (it == t.tensors.end()) return;
        ++used;
        if (it->second.second == n) field = it->second.first.view(pieces_[i].tensor.sizes());
      });
      if (used != t.tensors.size() || (step == nullptr) != (t.step < 0)) {
        std::string names;
        for (const auto& [name, unused] : t.tensors) names += (names.empty() ? "" : ", ") + name;
        return Status::InvalidConfig(
            from + ": the optimizer state of " + Describe(mine) + " (" + names +
            (t.step < 0 ? "" : ", step") +
            ") is not this optimizer's (was it written with another optimizer type?)");
      }
      if (step) *step = t.step;
      t.tensors.clear();
      compat::SetParamState(optimizer, pieces_[i].tensor, std::move(state));
    }
    return Status::Ok();
  }

 private:
  // Every piece with any state has all of it, each state tensor whole.
  Status CheckCovered(size_t i, const std::string& from) const {
    const Target& t = targets_[i];
    const PieceRange& mine = pieces_[i].range;
    const int64_t n = mine.end - mine.begin;
    if (t.stated == 0) return Status::Ok();
    if (t.stated != n || t.unstated != 0)
      return Status::InvalidConfig(from + ": optimizer state covers " + std::to_string(t.stated) +
                                   " of the " + std::to_string(n) + " elements of " +
                                   Describe(mine) + " (were its files written by one checkpoint?)");
    for (const auto& [name, tensor_and_covered] : t.tensors)
      if (tensor_and_covered.second != n)
        return Status::InvalidConfig(from + ": optimizer state " + name + " covers " +
                                     std::to_string(tensor_and_covered.second) + " of the " +
                                     std::to_string(n) + " elements of " + Describe(mine));
    return Status::Ok();
  }

  struct Target {
    int64_t stated = 0;    // elements covered by sources with state
    int64_t unstated = 0;  // ... and without
    int64_t step = -1;
    std::string step_source;  // the first source with state
    std::map<std::string, std::pair<torch::Tensor, int64_t>> tensors;  // flat, elements copied
  };
  const std::vector<ParamPiece>& pieces_;
  std::vector<Target> targets_;
  std::unordered_map<int64_t, std::vector<size_t>> by_param_;
};

std::string IndexFile(const std::string& dir) { return dir + "/zero_index.pt"; }

torch::Tensor RangesTensor(const std::vector<PieceRange>& ranges) {
  auto t = torch::empty({static_cast<int64_t>(ranges.size()), 3}, torch::kLong);
  auto a = t.accessor<int64_t, 2>();
  for (size_t i = 0; i < ranges.size(); ++i) {
    a[i][0] = ranges[i].param;
    a[i][1] = ranges[i].begin;
    a[i][2] = ranges[i].end;
  }
  return t;
}

std::vector<PieceRange> RangesOf(const torch::Tensor& t) {
  std::vector<PieceRange> out;
  auto a = t.accessor<int64_t, 2>();
  for (int64_t i = 0; i < t.size(0); ++i) out.push_back({a[i][0], a[i][1], a[i][2]});
  return out;
}

}  // namespace

namespace {

// The model file's keys: parameters, buffers and the optimizer's settings and (when
// `optimizer_state`) state. The archive refers to the tensors; nothing is copied until it is
// written. Throws c10::Error.
void WriteModel(torch::serialize::OutputArchive& archive, const NamedTensors& params,
                const NamedTensors& buffers, torch::optim::Optimizer& optimizer,
                bool optimizer_state) {
  for (auto& [name, p] : params) archive.write("param/" + name, p.detach());
  for (auto& [name, b] : buffers) archive.write("buffer/" + name, b.detach());
  torch::serialize::OutputArchive opt;
  if (optimizer_state) {
    optimizer.save(opt);
  } else {
    // The settings alone: the state is set aside while they are serialised (nothing in `opt`
    // refers to it), and put back.
    std::remove_reference_t<decltype(optimizer.state())> state;
    std::swap(state, optimizer.state());
    try {
      optimizer.save(opt);
    } catch (...) {
      std::swap(state, optimizer.state());
      throw;
    }
    std::swap(state, optimizer.state());
  }
  archive.write("optimizer", opt);
}

void WriteModel(torch::serialize::OutputArchive& archive, const Model& model,
                torch::optim::Optimizer& optimizer) {
  WriteModel(archive, model.NamedParameters(), model.NamedBuffers(), optimizer, true);
}

// Restores WriteModel's keys from `archive` (`what` names it in errors: "checkpoint 'x.pt'").
Status ReadModel(torch::serialize::InputArchive& archive, const std::string& what,
                 const Model& model, torch::optim::Optimizer& optimizer, bool buffers) {
  std::string current = "param";
  try {
    torch::NoGradGuard no_grad;
    auto restore = [&](const std::string& key, const torch::Tensor& dst) -> Status {
      current = key;
      torch::Tensor src;
      archive.read(key, src);
      if (!src.sizes().equals(dst.sizes()))
        return Status::InvalidConfig(what + ": " + key + " has shape " + c10::str(src.sizes()) +
                                     " but the model has " + c10::str(dst.sizes()) +
                                     " (was it written by a different model?)");
      dst.detach().copy_(src);
      return Status::Ok();
    };
    for (auto& [name, p] : model.NamedParameters())
      LAUNCH_RETURN_IF_ERROR(restore("param/" + name, p));
    if (buffers)
      for (auto& [name, b] : model.NamedBuffers())
        LAUNCH_RETURN_IF_ERROR(restore("buffer/" + name, b));
    current = "optimizer";
    torch::serialize::InputArchive opt;
    archive.read("optimizer", opt);
    optimizer.load(opt);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::InvalidConfig(
        what + ": cannot restore " + current +
        " (was it written by a different model or optimizer?): " + e.what_without_backtrace());
  }
}

}  // namespace

Status SaveModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  try {
    WriteModel(archive, model, optimizer);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

Status SaveModelTensors(const std::string& path, const NamedTensors& params,
                        const NamedTensors& buffers, torch::optim::Optimizer& optimizer,
                        bool optimizer_state) {
  torch::serialize::OutputArchive archive;
  try {
    WriteModel(archive, params, buffers, optimizer, optimizer_state);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

Status SaveModelFolder(const std::string& dir, const Model& model,
                       torch::optim::Optimizer& optimizer) {
  // In pieces when the optimizer's type is known and it holds trained parameters only (one
  // holding a frozen tensor keeps its state in model.pt, as before).
  StatusOr<std::vector<ParamPiece>> pieces = WholeParamPieces(model, optimizer);
  const bool in_pieces = NewState(optimizer) != nullptr && pieces.ok();
  const NamedTensors params = model.NamedParameters();
  LAUNCH_RETURN_IF_ERROR(SaveModelTensors(dir + "/model.pt", params, model.NamedBuffers(),
                                          optimizer, /*optimizer_state=*/!in_pieces));
  if (!in_pieces) return Status::Ok();
  std::vector<PieceRange> ranges;
  for (const ParamPiece& p : *pieces) ranges.push_back(p.range);
  std::vector<std::string> names;
  for (const auto& [name, p] : params) names.push_back(name);
  LAUNCH_RETURN_IF_ERROR(SaveShardIndex(dir, {ranges}, torch::tensor({int64_t{1}}), names));
  return SaveShardedOptimizerState(dir, 0, optimizer, *pieces);
}

Status LoadModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  return ReadModel(*archive, "checkpoint '" + path + "'", model, optimizer, /*buffers=*/true);
}

void WriteModelKeys(torch::serialize::OutputArchive& archive, const Model& model,
                    torch::optim::Optimizer& optimizer) {
  WriteModel(archive, model, optimizer);
}

Status ReadModelKeys(torch::serialize::InputArchive& archive, const std::string& what,
                     const Model& model, torch::optim::Optimizer& optimizer) {
  return ReadModel(archive, what, model, optimizer, /*buffers=*/true);
}

Status SerializeImageTo(const std::function<size_t(const void*, size_t)>& sink,
                        const std::function<void(torch::serialize::OutputArchive&)>& write,
                        const TrainState& state) {
  try {
    torch::serialize::OutputArchive archive;
    write(archive);
    archive.write("meta", MetaTensor(state));
    archive.write("schedule", ScheduleTensor(state));
    archive.save_to(sink);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::IoError(std::string("serialising this rank's state: ") +
                           e.what_without_backtrace());
  }
}

StatusOr<std::string> SerializeImage(
    const std::function<void(torch::serialize::OutputArchive&)>& write, const TrainState& state) {
  std::string bytes;
  LAUNCH_RETURN_IF_ERROR(SerializeImageTo(
      [&](const void* data, size_t n) {
        bytes.append(static_cast<const char*>(data), n);
        return n;
      },
      write, state));
  return bytes;
}

StatusOr<TrainState> RestoreImage(
    std::string_view bytes, const std::string& what,
    const std::function<Status(torch::serialize::InputArchive&)>& read) {
  torch::serialize::InputArchive archive;
  torch::Tensor meta, schedule;
  try {
    archive.load_from(bytes.data(), bytes.size());
    archive.read("meta", meta);
    archive.read("schedule", schedule);
  } catch (const c10::Error& e) {
    return Status::IoError("reading " + what + ": " + e.what_without_backtrace());
  }
  LAUNCH_RETURN_IF_ERROR(read(archive));
  return FromMeta(meta, schedule);
}

StatusOr<std::string> SerializeReplicaState(const Model& model, torch::optim::Optimizer& optimizer,
                                            const TrainState& state) {
  return SerializeImage(
      [&](torch::serialize::OutputArchive& archive) { WriteModel(archive, model, optimizer); },
      state);
}

StatusOr<TrainState> RestoreReplicaState(const std::string& bytes, const Model& model,
                                         torch::optim::Optimizer& optimizer, bool buffers) {
  const std::string what = "a peer's replica state";
  return RestoreImage(bytes, what, [&](torch::serialize::InputArchive& archive) {
    return ReadModel(archive, what, model, optimizer, buffers);
  });
}

std::string ShardFile(const std::string& dir, int64_t rank) {
  return dir + "/zero_rank" + std::to_string(rank) + ".pt";
}

namespace {

// One shard file: `ranges` and the state of each (nullopt: none). The archive refers to the
// states' tensors; they are copied as the file is written.
Status WritePieces(const std::string& path, const std::vector<PieceRange>& ranges,
                   const std::vector<std::optional<FlatState>>& states) {
  torch::serialize::OutputArchive archive;
  try {
    // Per piece: whether it has state, and its step count (-1: the type keeps none).
    auto stated = torch::zeros({static_cast<int64_t>(ranges.size()), 2}, torch::kLong);
    auto s = stated.accessor<int64_t, 2>();
    for (size_t i = 0; i < ranges.size(); ++i) {
      if (!states[i]) continue;
      s[i][0] = 1;
      s[i][1] = states[i]->step;
      for (const auto& [name, t] : states[i]->tensors)
        archive.write("piece" + std::to_string(i) + "/" + name, t);
    }
    archive.write("ranges", RangesTensor(ranges));
    archive.write("state", stated);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

}  // namespace

Status SaveShardedOptimizerState(const std::string& dir, int rank,
                                 torch::optim::Optimizer& optimizer,
                                 const std::vector<ParamPiece>& pieces) {
  std::vector<PieceRange> ranges;
  std::vector<std::optional<FlatState>> states;
  for (const ParamPiece& piece : pieces) {
    ranges.push_back(piece.range);
    LAUNCH_ASSIGN_OR_RETURN(std::optional<FlatState> state, GetFlatState(optimizer, piece.tensor));
    states.push_back(std::move(state));
  }
  return WritePieces(ShardFile(dir, rank), ranges, states);
}

Status SaveParamStates(const std::string& dir, const std::vector<std::string>& names,
                       const std::vector<torch::Tensor>& params,
                       const std::vector<std::optional<FlatState>>& states) {
  std::vector<PieceRange> ranges;
  for (size_t i = 0; i < params.size(); ++i)
    ranges.push_back({static_cast<int64_t>(i), 0, params[i].numel()});
  LAUNCH_RETURN_IF_ERROR(SaveShardIndex(dir, {ranges}, torch::tensor({int64_t{1}}), names));
  return WritePieces(ShardFile(dir, 0), ranges, states);
}

Status SaveShardIndex(const std::string& dir, const std::vector<std::vector<PieceRange>>& ranks,
                      const torch::Tensor& layout, const std::vector<std::string>& names) {
  const std::string path = IndexFile(dir);
  torch::serialize::OutputArchive archive;
  try {
    std::vector<PieceRange> all;
    std::vector<int64_t> owner;
    for (size_t r = 0; r < ranks.size(); ++r)
      for (const PieceRange& range : ranks[r]) {
        all.push_back(range);
        owner.push_back(static_cast<int64_t>(r));
      }
    archive.write("world", torch::tensor({static_cast<int64_t>(ranks.size())}, torch::kLong));
    archive.write("ranges", RangesTensor(all));
    archive.write("rank", torch::tensor(owner, torch::kLong));
    archive.write("layout", layout);
    c10::List<std::string> list;
    for (const std::string& name : names) list.push_back(name);
    archive.write("names", c10::IValue(list));
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

bool HasShardedOptimizerState(const std::string& dir) { return FileExists(IndexFile(dir)); }

StatusOr<std::vector<std::string>> ShardIndexNames(const std::string& dir) {
  const std::string path = IndexFile(dir);
  LAUNCH_ASSIGN_OR_RETURN(auto index, Open(path));
  c10::IValue names;
  try {
    if (!index->try_read("names", names) || !names.isList())
      return Status::InvalidConfig("checkpoint '" + path +
                                   "' does not name its parameters (it was written before "
                                   "checkpoints could be re-cut for another layout)");
    std::vector<std::string> out;
    for (const c10::IValue& name : names.toListRef()) out.push_back(name.toStringRef());
    return out;
  } catch (const c10::Error& e) {
    return Status::IoError("checkpoint '" + path +
                           "' is unreadable: " + e.what_without_backtrace());
  }
}

namespace {

// Reads `dir`'s index, then each shard file whose ranges meet the assembler's pieces into it.
StatusOr<ShardedLoad> ReadPieces(const std::string& dir, const std::vector<ParamPiece>& pieces,
                                 StateAssembler& assembler) {
  ShardedLoad load;
  std::vector<bool> needed;
  {
    const std::string path = IndexFile(dir);
    LAUNCH_ASSIGN_OR_RETURN(auto index, Open(path));
    try {
      torch::Tensor world, ranges, owner;
      index->read("world", world);
      index->read("ranges", ranges);
      index->read("rank", owner);
      index->read("layout", load.layout);
      load.written_by = world.item<int64_t>();
      needed.assign(static_cast<size_t>(load.written_by), false);
      // The cut is the same when one file holds exactly this optimizer's ranges.
      std::vector<std::vector<std::array<int64_t, 3>>> held(needed.size());
      const std::vector<PieceRange> all = RangesOf(ranges);
      auto o = owner.accessor<int64_t, 1>();
      for (size_t i = 0; i < all.size(); ++i) {
        const auto r = static_cast<size_t>(o[static_cast<int64_t>(i)]);
        if (r >= needed.size())
          return Status::IoError("checkpoint '" + path + "' names shard file " + std::to_string(r) +
                                 " of " + std::to_string(load.written_by));
        if (assembler.Meets(all[i])) needed[r] = true;
        held[r].push_back({all[i].param, all[i].begin, all[i].end});
      }
      std::vector<std::array<int64_t, 3>> mine;
      for (const ParamPiece& p : pieces)
        mine.push_back({p.range.param, p.range.begin, p.range.end});
      std::sort(mine.begin(), mine.end());
      for (auto& h : held) {
        std::sort(h.begin(), h.end());
        if (!mine.empty() && h == mine) load.same_cut = true;
      }
    } catch (const c10::Error& e) {
      return Status::IoError("checkpoint '" + path +
                             "' is unreadable: " + e.what_without_backtrace());
    }
  }
  // One file at a time: each is in memory only while its pieces are copied out.
  for (size_t r = 0; r < needed.size(); ++r) {
    if (!needed[r]) continue;
    const std::string path = ShardFile(dir, static_cast<int64_t>(r));
    LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
    ++load.files_read;
    try {
      torch::Tensor ranges, stated;
      archive->read("ranges", ranges);
      archive->read("state", stated);
      const std::vector<PieceRange> all = RangesOf(ranges);
      auto s = stated.accessor<int64_t, 2>();
      for (size_t i = 0; i < all.size(); ++i) {
        if (!assembler.Meets(all[i])) continue;
        std::optional<FlatState> state;
        const auto row = static_cast<int64_t>(i);
        if (s[row][0] != 0) {
          state.emplace();
          state->step = s[row][1];
          for (const char* name : kStateNames) {
            torch::Tensor t;
            if (archive->try_read("piece" + std::to_string(i) + "/" + name, t))
              state->tensors.emplace_back(name, t);
          }
        }
        LAUNCH_RETURN_IF_ERROR(assembler.Add(all[i], state, path));
      }
    } catch (const c10::Error& e) {
      return Status::IoError("checkpoint '" + path +
                             "' is unreadable: " + e.what_without_backtrace());
    }
  }
  return load;
}

}  // namespace

StatusOr<ShardedLoad> LoadShardedOptimizerState(const std::string& dir,
                                                torch::optim::Optimizer& optimizer,
                                                const std::vector<ParamPiece>& pieces) {
  StateAssembler assembler(pieces);
  LAUNCH_ASSIGN_OR_RETURN(ShardedLoad load, ReadPieces(dir, pieces, assembler));
  torch::NoGradGuard no_grad;
  LAUNCH_RETURN_IF_ERROR(assembler.Install(optimizer, "checkpoint " + dir));
  return load;
}

StatusOr<std::vector<std::optional<FlatState>>> ReadParamStates(
    const std::string& dir, const std::vector<torch::Tensor>& params) {
  std::vector<ParamPiece> pieces;
  for (size_t i = 0; i < params.size(); ++i)
    pieces.push_back({{static_cast<int64_t>(i), 0, params[i].numel()}, params[i]});
  StateAssembler assembler(pieces);
  LAUNCH_RETURN_IF_ERROR(ReadPieces(dir, pieces, assembler).status());
  torch::NoGradGuard no_grad;
  return assembler.Take("checkpoint " + dir);
}

Status ReshardOptimizerState(torch::optim::Optimizer& from,
                             const std::vector<ParamPiece>& from_pieces,
                             torch::optim::Optimizer& to, const std::vector<ParamPiece>& pieces) {
  StateAssembler assembler(pieces);
  torch::NoGradGuard no_grad;
  for (const ParamPiece& piece : from_pieces) {
    if (!assembler.Meets(piece.range)) continue;
    LAUNCH_ASSIGN_OR_RETURN(std::optional<FlatState> state, GetFlatState(from, piece.tensor));
    LAUNCH_RETURN_IF_ERROR(assembler.Add(piece.range, state, "the unsharded optimizer"));
  }
  return assembler.Install(to, "the unsharded optimizer");
}

StatusOr<std::vector<ParamPiece>> WholeParamPieces(const Model& model,
                                                   torch::optim::Optimizer& optimizer) {
  std::unordered_map<const void*, int64_t> index;
  const std::vector<torch::Tensor> params = model.Parameters();
  for (size_t i = 0; i < params.size(); ++i)
    index[params[i].unsafeGetTensorImpl()] = static_cast<int64_t>(i);
  std::vector<ParamPiece> pieces;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) {
      auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end())
        return Status::InvalidConfig(
            "the optimizer holds a tensor that is not a trained parameter of the model");
      pieces.push_back({{it->second, 0, p.numel()}, p});
    }
  return pieces;
}

Status LoadOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::Tensor written;
    archive->read("layout", written);
    if (!written.sizes().equals(layout.sizes()) || !written.equal(layout))
      return Status::InvalidConfig("checkpoint '" + path + "' was cut as " + List(written) +
                                   ", this run as " + List(layout) + " (world, stage, unit sizes)");
    torch::serialize::InputArchive opt;
    archive->read("optimizer", opt);
    optimizer.load(opt);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::InvalidConfig("checkpoint '" + path + "': cannot restore the optimizer state: " +
                                 e.what_without_backtrace());
  }
}

Status SaveNamedTensors(const std::string& path,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  torch::serialize::OutputArchive archive;
  try {
    for (const auto& [name, t] : tensors) archive.write(name, t);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

Status LoadNamedTensors(const std::string& path,
                        const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::NoGradGuard no_grad;
    for (const auto& [name, t] : tensors) {
      torch::Tensor saved;
      if (!archive->try_read(name, saved))
        return Status::InvalidConfig("'" + path + "' has no tensor '" + name + "'");
      if (!saved.sizes().equals(t.sizes()) || saved.scalar_type() != t.scalar_type())
        return Status::InvalidConfig("'" + path + "': tensor '" + name +
                                     "' has another shape or "
                                     "type than this model's");
      t.detach().copy_(saved);
    }
  } catch (const c10::Error& e) {
    return Status::IoError("'" + path + "' is unreadable: " + e.what_without_backtrace());
  }
  return Status::Ok();
}

Status SaveRankState(const std::string& path, const TrainState& state) {
  torch::serialize::OutputArchive archive;
  try {
    archive.write("meta", MetaTensor(state));
    archive.write("schedule", ScheduleTensor(state));
    archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

StatusOr<TrainState> LoadRankState(const std::string& path, bool restore_rng) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::Tensor meta, schedule;
    archive->read("meta", meta);
    if (!archive->try_read("schedule", schedule)) schedule = torch::Tensor();
    if (restore_rng) {
      torch::Tensor rng;
      archive->read("rng", rng);
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the state
      generator.set_state(rng);
    }
    return FromMeta(meta, schedule);
  } catch (const c10::Error& e) {
    return Status::IoError("checkpoint '" + path +
                           "' is incomplete: " + e.what_without_backtrace());
  }
}

Status WriteArchive(torch::serialize::OutputArchive& archive, const std::string& path) {
  return SaveArchive(archive, path);
}

StatusOr<std::unique_ptr<torch::serialize::InputArchive>> ReadArchive(const std::string& path) {
  return Open(path);
}

}  // namespace launch::trainer
