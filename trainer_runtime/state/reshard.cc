#include "trainer_runtime/state/reshard.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "base/files.h"
#include "base/strings.h"
#include "trainer_runtime/model/tensor_parallel.h"
#include "trainer_runtime/state/checkpoint.h"

namespace launch::trainer {
namespace {

// "stage<s>", "tensor<t>" or "stage<s>_tensor<t>" (ParallelLayout::ShardName).
bool ParseShardName(const std::string& name, int* stage, int* tensor) {
  *stage = 0;
  *tensor = 0;
  bool any = false;
  for (const std::string& part : Split(name, '_')) {
    long long n = 0;
    if (StartsWith(part, "stage") && ParseInt64(part.substr(5), &n) && n >= 0) {
      *stage = static_cast<int>(n);
    } else if (StartsWith(part, "tensor") && ParseInt64(part.substr(6), &n) && n >= 0) {
      *tensor = static_cast<int>(n);
    } else {
      return false;
    }
    any = true;
  }
  return any;
}

// One folder's model as read for the re-cut.
struct Source {
  ShardFolder folder;
  std::unique_ptr<torch::serialize::InputArchive> model;  // its model.pt (buffers are read late)
  std::map<std::string, size_t> index;                    // parameter name -> position
  std::vector<torch::Tensor> params;
  std::vector<std::optional<FlatState>> states;
};

StatusOr<Source> ReadSource(const ShardFolder& folder) {
  Source s;
  s.folder = folder;
  if (!HasShardedOptimizerState(folder.path))
    return Status::InvalidConfig(
        "the checkpoint folder " + folder.path +
        " keeps its optimizer state in model.pt (written before checkpoints could be re-cut, "
        "with an optimizer other than SGD, Adam, AdamW, RMSprop or Adagrad, or by replicas that "
        "differ: Local SGD, `none`), so it can be resumed only with the layout that wrote it");
  LAUNCH_ASSIGN_OR_RETURN(std::vector<std::string> names, ShardIndexNames(folder.path));
  LAUNCH_ASSIGN_OR_RETURN(s.model, ReadArchive(folder.path + "/model.pt"));
  try {
    for (size_t i = 0; i < names.size(); ++i) {
      torch::Tensor p;
      s.model->read("param/" + names[i], p);
      s.index[names[i]] = i;
      s.params.push_back(p);
    }
  } catch (const c10::Error& e) {
    return Status::InvalidConfig(folder.path + "/model.pt does not hold the parameters its index " +
                                 "names: " + e.what_without_backtrace());
  }
  LAUNCH_ASSIGN_OR_RETURN(s.states, ReadParamStates(folder.path, s.params));
  return s;
}

}  // namespace

std::vector<ShardFolder> ShardFoldersOf(const std::string& dir) {
  std::vector<ShardFolder> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    ShardFolder f;
    if (!entry.is_directory(ec) ||
        !ParseShardName(entry.path().filename().string(), &f.stage, &f.tensor))
      continue;
    f.path = entry.path().string();
    out.push_back(f);
  }
  std::sort(out.begin(), out.end(), [](const ShardFolder& a, const ShardFolder& b) {
    return std::make_pair(a.stage, a.tensor) < std::make_pair(b.stage, b.tensor);
  });
  if (out.empty()) out.push_back({dir, 0, 0});
  return out;
}

bool CutAs(const std::vector<ShardFolder>& folders, int stages, int tensor) {
  std::set<std::pair<int, int>> have, want;
  for (const ShardFolder& f : folders) have.insert({f.stage, f.tensor});
  for (int s = 0; s < stages; ++s)
    for (int t = 0; t < tensor; ++t) want.insert({s, t});
  return have == want;
}

std::string DescribeCut(const std::vector<ShardFolder>& folders) {
  int stages = 0, tensor = 0;
  for (const ShardFolder& f : folders) {
    stages = std::max(stages, f.stage + 1);
    tensor = std::max(tensor, f.tensor + 1);
  }
  std::string out;
  if (tensor > 1) out = "tensor " + std::to_string(tensor);
  if (stages > 1)
    out += (out.empty() ? "" : " x ") + std::string("stages ") + std::to_string(stages);
  return out.empty() ? "the whole model" : out;
}

Status WriteRecutFolder(const std::vector<ShardFolder>& folders, Model& model,
                        torch::optim::Optimizer& optimizer, int tensor_size, int tensor_rank,
                        const std::string& to) {
  std::vector<Source> sources;
  int old_tensor = 1;
  for (const ShardFolder& f : folders) {
    LAUNCH_ASSIGN_OR_RETURN(Source s, ReadSource(f));
    old_tensor = std::max(old_tensor, f.tensor + 1);
    sources.push_back(std::move(s));
  }
  const std::map<std::string, TensorSplit> splits = TensorSplits(model.module());
  torch::NoGradGuard no_grad;
  NamedTensors params;
  std::vector<std::string> names;
  std::vector<torch::Tensor> tensors;
  std::vector<std::optional<FlatState>> states;
  for (const auto& [name, live] : model.NamedParameters()) {
    // The folder holding each of the old shards of `name` (the first stage's, should two
    // stages hold it).
    std::vector<const Source*> shard(static_cast<size_t>(old_tensor), nullptr);
    for (const Source& s : sources)
      if (s.index.count(name) && !shard[static_cast<size_t>(s.folder.tensor)])
        shard[static_cast<size_t>(s.folder.tensor)] = &s;
    const auto found = splits.find(name);
    const TensorSplit split = found == splits.end() ? TensorSplit{} : found->second;
    std::vector<const Source*> used;
    for (const Source* s : shard)
      if (s && (split.split() || used.empty())) used.push_back(s);
    if (used.empty() || (split.split() && used.size() != shard.size()))
      return Status::InvalidConfig(
          "the checkpoint (" + DescribeCut(folders) + ") holds no parameter " + name +
          (used.empty() ? "" : " in every tensor shard") + " (was it written by another model?)");
    auto recut = [&](const std::vector<torch::Tensor>& parts) {
      return CutShard(JoinShards(parts, split), split, tensor_size, tensor_rank);
    };
    std::vector<torch::Tensor> parts;
    std::vector<const FlatState*> part_states;
    for (const Source* s : used) {
      const size_t i = s->index.at(name);
      parts.push_back(s->params[i]);
      if (s->states[i]) part_states.push_back(&*s->states[i]);
    }
    torch::Tensor mine;
    std::optional<FlatState> state;
    try {
      mine = recut(parts);
      if (!part_states.empty() && part_states.size() != used.size())
        return Status::InvalidConfig("the checkpoint (" + DescribeCut(folders) +
                                     ") has optimizer state for some shards of " + name +
                                     " but not for all");
      if (!part_states.empty()) {
        FlatState joined;
        joined.step = part_states.front()->step;
        for (size_t k = 0; k < part_states.front()->tensors.size(); ++k) {
          const std::string& key = part_states.front()->tensors[k].first;
          std::vector<torch::Tensor> pieces;
          for (size_t j = 0; j < part_states.size(); ++j) {
            if (part_states[j]->step != joined.step || part_states[j]->tensors.size() <= k ||
                part_states[j]->tensors[k].first != key)
              return Status::InvalidConfig("the checkpoint's shards of " + name +
                                           " hold different optimizer state (steps or kinds)");
            pieces.push_back(part_states[j]->tensors[k].second.view(parts[j].sizes()));
          }
          joined.tensors.emplace_back(key, recut(pieces).reshape({-1}));
        }
        state = std::move(joined);
      }
    } catch (const c10::Error& e) {
      return Status::InvalidConfig(
          "the checkpoint's " + name + " (" + DescribeCut(folders) +
          ") does not re-cut for this model: " + e.what_without_backtrace());
    }
    if (!mine.sizes().equals(live.sizes()))
      return Status::InvalidConfig("the checkpoint's " + name + " (" + DescribeCut(folders) +
                                   ") re-cuts to shape " + c10::str(mine.sizes()) +
                                   " but this model's is " + c10::str(live.sizes()) +
                                   " (was it written by another model?)");
    params.emplace_back(name, mine);
    names.push_back(name);
    tensors.push_back(mine);
    states.push_back(std::move(state));
  }
  NamedTensors buffers;
  for (const auto& [name, live] : model.NamedBuffers()) {
    torch::Tensor b;
    bool found = false;
    try {
      for (Source& s : sources)
        if ((found = s.model->try_read("buffer/" + name, b))) break;
    } catch (const c10::Error& e) {
      return Status::IoError("reading buffer " + name +
                             " of the checkpoint: " + e.what_without_backtrace());
    }
    if (!found)
      return Status::InvalidConfig("the checkpoint (" + DescribeCut(folders) +
                                   ") holds no buffer " + name +
                                   " (was it written by another model?)");
    buffers.emplace_back(name, b);
  }
  LAUNCH_RETURN_IF_ERROR(MakeDirs(to));
  LAUNCH_RETURN_IF_ERROR(SaveModelTensors(to + "/model.pt", params, buffers, optimizer,
                                          /*optimizer_state=*/false));
  return SaveParamStates(to, names, tensors, states);
}

}  // namespace launch::trainer
