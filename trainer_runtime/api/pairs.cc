#include "trainer_runtime/api/accelerator.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "base/environment.h"
#include "base/exit_status.h"
#include "base/files.h"
#include "base/strings.h"
#include "config/train_keys.h"
#include "trainer_runtime/api/accelerator_internal.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/comm/recovery.h"
#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/layout.h"
#include "trainer_runtime/parallel/pipeline_engine.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/loop_util.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {

// --- Several models --------------------------------------------------------------------------

Status Accelerator::PrepareAnother(std::shared_ptr<torch::nn::Module> module,
                                   std::shared_ptr<torch::optim::Optimizer> optimizer) {
  // dp's replicas run one module's forward on threads (ForwardBackward): there is no place for
  // a second model's.
  if (options_.parallel.mode == config::ParallelMode::kDp)
    return Status::InvalidConfig(
        "Prepare: a second model needs train.parallel.mode ddp, zero, none or Local SGD; dp "
        "runs one model's replicas");
  for (const Pair& pair : pairs_)
    if (pair.module.get() == module.get())
      return Status::InvalidConfig("Prepare: this module was prepared already");
  // Recovery re-forms the group and hands one model's state to the replacement.
  if (recover_)
    return Status::InvalidConfig(
        "Prepare: in-place recovery (launch --recover in_place) supports one prepared model; "
        "with several, run with --recover restart");
  Pair pair;
  pair.module = std::move(module);
  if (!device_.is_cpu()) pair.module->to(device_);
  pair.model = std::make_shared<Model>(pair.module);
  pair.optimizer = std::move(optimizer);
  if (pair.model->NamedParameters().empty())
    return Status::InvalidConfig("Prepare: model " + std::to_string(pairs_.size()) +
                                 " has no parameters that require grad");
  LAUNCH_ASSIGN_OR_RETURN(pair.owned, CreateStrategy(options_, pair.model.get(),
                                                     pair.optimizer.get(), data_pg_, env_.tuning));
  pair.strategy = pair.owned.get();
  pair.strategy->Setup();  // its own broadcast and reducer
  pair.strategy->TakeStepStats();
  RecordBaseLearningRates(pair);
  pairs_.push_back(std::move(pair));
  return Status::Ok();
}

Accelerator::Pair& Accelerator::PairOf(const torch::nn::Module& model, const char* call) {
  for (Pair& pair : pairs_)
    if (pair.module.get() == &model) return pair;
  LAUNCH_CHECK(false, std::string(call) +
                          ": the module was not prepared (pass the module given to Prepare, "
                          "e.g. *net for a TORCH_MODULE holder)");
  return pairs_.front();  // not reached
}

std::vector<Accelerator::Pair*> Accelerator::PairsReachedBy(const torch::Tensor& loss) {
  // The leaves a backward from `loss` accumulates into are the variables of the AccumulateGrad
  // nodes its graph reaches; Reducer::prepare_for_backward walks the same graph for
  // find_unused_parameters.
  std::unordered_map<const c10::TensorImpl*, size_t> owner;
  for (size_t i = 0; i < pairs_.size(); ++i)
    for (const torch::Tensor& p : pairs_[i].model->Parameters())
      owner.emplace(p.unsafeGetTensorImpl(), i);
  std::vector<char> reached(pairs_.size(), 0);
  std::vector<torch::autograd::Node*> todo;
  std::unordered_set<torch::autograd::Node*> seen;
  if (loss.grad_fn()) todo.push_back(loss.grad_fn().get());
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      auto it = owner.find(acc->variable.unsafeGetTensorImpl());
      if (it != owner.end()) reached[it->second] = 1;
    }
    for (const torch::autograd::Edge& edge : node->next_edges())
      if (edge.function) todo.push_back(edge.function.get());
  }
  // Ranks whose losses reach different models would all-reduce different reducers' buckets
  // and wait for each other forever: compare first (a sum of 0/1 per model).
  auto count = torch::zeros({static_cast<int64_t>(pairs_.size())}, torch::kDouble);
  for (size_t i = 0; i < pairs_.size(); ++i) count[static_cast<int64_t>(i)] = reached[i];
  AllReduceSum(count);
  std::vector<Pair*> out;
  for (size_t i = 0; i < pairs_.size(); ++i) {
    const double ranks = count[static_cast<int64_t>(i)].item<double>();
    LAUNCH_CHECK(ranks == 0 || ranks == world_size(),
                 "Backward: the loss reaches model " + std::to_string(i) + " on " +
                     std::to_string(static_cast<int>(ranks)) + " of " +
                     std::to_string(world_size()) + " ranks (rank " + std::to_string(rank()) +
                     ": " + (reached[i] ? "reached" : "not reached") +
                     "); every rank's loss must go through the same models");
    if (reached[i]) out.push_back(&pairs_[i]);
  }
  return out;
}

bool Accelerator::Step(const torch::nn::Module& model) {
  LAUNCH_CHECK(prepared_);
  Pair& pair = PairOf(model, "Step(model)");
  if (in_micro_) EndMicroBatch();
  if (!window_closes_ || pair.unsynced || pair.stepped) return false;
  StepPairs({&pair});
  return true;
}

void Accelerator::ZeroGrad(const torch::nn::Module& model) {
  for (auto& p : PairOf(model, "ZeroGrad(model)").model->Parameters())
    if (p.grad().defined()) p.mutable_grad().zero_();
}

Accelerator::NoSyncScope Accelerator::NoSync(const torch::nn::Module& model) {
  return NoSyncScope(&PairOf(model, "NoSync(model)").no_sync);
}

Accelerator::MainFirstScope::MainFirstScope(Accelerator* accel, bool first)
    : accel_(accel), first_(first) {
  if (!first_) accel_->Barrier();  // waits for the first ones to leave their scope
}

Accelerator::MainFirstScope::~MainFirstScope() {
  if (!accel_ || !first_) return;
  try {
    accel_->Barrier();  // lets the others in
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train: rank %d: MainProcessFirst: the barrier failed: %s\n",
                 accel_->rank(), e.what());
  }
}

Accelerator::MainFirstScope Accelerator::MainProcessFirst() {
  return MainFirstScope(this, IsMainProcess());
}

Accelerator::MainFirstScope Accelerator::LocalMainProcessFirst() {
  return MainFirstScope(this, IsLocalMainProcess());
}

void Accelerator::SetSeed(uint64_t seed, bool device_specific) {
  // at::manual_seed seeds the CPU generator and every CUDA device's.
  torch::manual_seed(device_specific ? seed + static_cast<uint64_t>(rank()) : seed);
}

std::string Accelerator::PairDir(const std::string& step_dir, size_t i) const {
  std::string dir = i == 0 ? step_dir : step_dir + "/pair" + std::to_string(i);
  // Each tensor shard keeps its own parameters and optimizer state (a pipeline engine adds
  // its stage's folder itself).
  if (layout_->degree(Axis::kTensor) > 1 && !options_.parallel.pipelined())
    dir += "/" + layout_->ShardName();
  return dir;
}

Status Accelerator::SaveUserState(const std::string& step_dir) const {
  if (user_state_.empty()) return Status::Ok();
  const std::string path = step_dir + "/user_rank" + std::to_string(rank()) + ".pt";
  torch::serialize::OutputArchive archive;
  try {
    // Kinds, in registration order: what LoadUserState compares.
    std::vector<int64_t> kinds;
    for (const UserState& u : user_state_) kinds.push_back(u.module ? 1 : 0);
    archive.write("kinds", torch::tensor(kinds, torch::kLong));
    for (size_t i = 0; i < user_state_.size(); ++i) {
      torch::serialize::OutputArchive object;
      user_state_[i].save(object);
      archive.write("object" + std::to_string(i), object);
    }
  } catch (const c10::Error& e) {
    return Status::IoError("serialising the RegisterForCheckpointing state into " + path + ": " +
                           e.what_without_backtrace());
  }
  return WriteArchive(archive, path);
}

Status Accelerator::LoadUserState(const std::string& step_dir) {
  if (user_state_.empty()) return Status::Ok();
  std::string path = step_dir + "/user_rank" + std::to_string(rank()) + ".pt";
  if (!FileExists(path)) path = step_dir + "/user_rank0.pt";  // fewer ranks wrote it
  auto kind_name = [](int64_t module) { return module ? "module" : "object"; };
  std::string mine;
  for (const UserState& u : user_state_)
    mine += std::string(mine.empty() ? "" : ", ") + kind_name(u.module);
  StatusOr<std::unique_ptr<torch::serialize::InputArchive>> archive = ReadArchive(path);
  if (!archive.ok() && archive.status().code() == Status::Code::kNotFound)
    return Status::InvalidConfig("the checkpoint in " + step_dir +
                                 " holds no RegisterForCheckpointing state; this program "
                                 "registered " +
                                 std::to_string(user_state_.size()) + " (" + mine + ")");
  if (!archive.ok()) return archive.status();
  try {
    torch::Tensor kinds;
    (*archive)->read("kinds", kinds);
    std::string theirs;
    for (int64_t i = 0; i < kinds.numel(); ++i)
      theirs += std::string(i ? ", " : "") + kind_name(kinds[i].item<int64_t>());
    if (theirs != mine)
      return Status::InvalidConfig(
          path + ": the checkpoint holds " + std::to_string(kinds.numel()) +
          " RegisterForCheckpointing objects (" + theirs + "), this program registered " +
          std::to_string(user_state_.size()) + " (" + mine +
          "); registration order is their identity");
  } catch (const c10::Error& e) {
    return Status::IoError(path + ": unreadable: " + e.what_without_backtrace());
  }
  for (size_t i = 0; i < user_state_.size(); ++i) {
    try {
      torch::serialize::InputArchive object;
      (*archive)->read("object" + std::to_string(i), object);
      user_state_[i].load(object);
    } catch (const c10::Error& e) {
      return Status::InvalidConfig(path + ": RegisterForCheckpointing object " + std::to_string(i) +
                                   " (" + kind_name(user_state_[i].module) +
                                   ") does not load: " + e.what_without_backtrace());
    }
  }
  return Status::Ok();
}

}  // namespace launch::trainer
