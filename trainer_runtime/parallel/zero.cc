#include "trainer_runtime/parallel/zero.h"

#include <c10/core/DeviceGuard.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/files.h"
#include "trainer_runtime/model/activation_checkpoint.h"
#include "trainer_runtime/model/fused_adam.h"
#include "trainer_runtime/model/shard_unit.h"
#include "trainer_runtime/state/checkpoint.h"
#include "trainer_runtime/util/timeline.h"

namespace launch::trainer {
namespace {

using torch::optim::Optimizer;
using torch::optim::OptimizerParamGroup;

// An optimizer of the same type as `like`, over `groups` (each with its own options).
StatusOr<std::unique_ptr<Optimizer>> OptimizerLike(const Optimizer& like,
                                                   std::vector<OptimizerParamGroup> groups) {
  namespace o = torch::optim;
  // Adam and AdamW also keep the implementation they step with (for loop, foreach, fused).
  if (AdamImplementationOf(like)) return AdamLike(like, std::move(groups));
  if (dynamic_cast<const o::SGD*>(&like))
    return std::unique_ptr<Optimizer>(std::make_unique<o::SGD>(
        std::move(groups), static_cast<const o::SGDOptions&>(like.defaults())));
  if (dynamic_cast<const o::RMSprop*>(&like))
    return std::unique_ptr<Optimizer>(std::make_unique<o::RMSprop>(
        std::move(groups), static_cast<const o::RMSpropOptions&>(like.defaults())));
  if (dynamic_cast<const o::Adagrad*>(&like))
    return std::unique_ptr<Optimizer>(std::make_unique<o::Adagrad>(
        std::move(groups), static_cast<const o::AdagradOptions&>(like.defaults())));
  return Status::InvalidConfig(
      "train.parallel.mode zero steps each rank's shard with an optimizer of the prepared "
      "one's type and options; it knows torch::optim's SGD, Adam, AdamW, RMSprop and Adagrad, "
      "not this one");
}

// One flat buffer of parameters, padded to a multiple of the world size.
struct Unit {
  std::vector<size_t> params;   // indices into ZeroStrategy::params_, in buffer order
  std::vector<int64_t> offset;  // of each, in the buffer
  int64_t numel = 0;            // parameters' elements (without padding)
  int64_t padded = 0;           // a multiple of the world size
  int64_t shard = 0;            // padded / world
  at::Tensor flat_param;        // [padded]; the parameters are views into it
  at::Tensor flat_grad;         // stage 1: [padded], the gradients are aliases into it
  at::Tensor bucket;            // stage 2: this micro-batch's gradients until reduced
  // [shard]: this rank's slice of the averaged gradients. Stage 1 (without sync_each_batch):
  // a view of flat_grad's own slice, where the reduce-scatter leaves it; otherwise its own
  // buffer, accumulating each micro-batch's result.
  at::Tensor shard_grad;
  int64_t done = 0;  // parameters whose gradient is accumulated this backward
  c10::intrusive_ptr<c10d::Work> work;
  // Stage 3, a module's unit (shard_unit.h): between uses flat_param's storage is released and
  // shard_param ([shard]) holds this rank's slice, which its optimizer steps.
  const torch::nn::Module* module = nullptr;
  at::Tensor shard_param;
  bool whole = true;                      // flat_param holds the parameters
  c10::intrusive_ptr<c10d::Work> gather;  // an all-gather into flat_param not waited for
  bool sharded() const { return module != nullptr; }
};

class ZeroStrategy : public ParallelStrategy, public UnitGatherer {
 public:
  ZeroStrategy(const config::TrainConfig& cfg, Model* model, Optimizer* user,
               c10::intrusive_ptr<CountingProcessGroup> pg)
      : stage_(cfg.parallel.zero_stage),
        unit_cap_bytes_(static_cast<size_t>(cfg.parallel.bucket_cap_mb * (1 << 20))),
        sync_each_batch_(cfg.sync_each_batch),
        user_(user) {
    model_ = model;
    SetGroup(std::move(pg));
  }
  ~ZeroStrategy() override {
    if (installed_) SetUnitGatherer(nullptr);
  }

  const char* Name() const override { return "zero"; }
  bool ReplicasEqual() const override { return true; }

  // Checks what Setup relies on; called by the factory.
  Status Check() const {
    const auto params = model_->Parameters();
    for (const auto& p : params) {
      if (p.device() != params.front().device())
        return Status::InvalidConfig(
            "train.parallel.mode zero needs every trained parameter on one device; the model "
            "has parameters on " +
            params.front().device().str() + " and " + p.device().str());
      if (p.scalar_type() != params.front().scalar_type())
        return Status::InvalidConfig(
            "train.parallel.mode zero needs every trained parameter of one dtype; the model "
            "mixes " +
            std::string(c10::toString(params.front().scalar_type())) + " and " +
            c10::toString(p.scalar_type()));
    }
    std::unordered_map<const void*, std::string> name_of;
    for (const auto& [name, p] : model_->NamedParameters()) name_of[p.unsafeGetTensorImpl()] = name;
    std::unordered_map<const void*, bool> listed;
    for (const auto& group : user_->param_groups())
      for (const auto& p : group.params()) {
        auto it = name_of.find(p.unsafeGetTensorImpl());
        if (it == name_of.end())
          return Status::InvalidConfig(
              "train.parallel.mode zero: the optimizer holds a tensor that is not a trained "
              "parameter of the prepared model");
        // Its shard would be stepped twice, with one state: list each tensor once.
        if (!listed.emplace(p.unsafeGetTensorImpl(), true).second)
          return Status::InvalidConfig(
              "train.parallel.mode zero: the optimizer holds parameter '" + it->second +
              "' twice (Module::parameters() lists a tied tensor once per module that "
              "registered it); give the optimizer each tensor once, as "
              "Accelerator::parameters() lists them");
      }
    return Status::Ok();
  }

  void Setup() override {
    BroadcastModel(pg_, model_);
    Build();
  }

  // Each rank's shard of the optimizer state (and in stage 3 of the parameters) exists nowhere
  // else: recovered from snapshots.
  bool RecoversFromSnapshots() const override { return true; }

  void Reform(c10::intrusive_ptr<CountingProcessGroup> pg) override {
    SetGroup(std::move(pg));
    previous_forward_synced_ = true;  // the next forward broadcasts buffers, as the first does
    if (units_.empty()) {
      Build();  // a replacement: LoadImage fills what Setup's broadcast would have
      return;
    }
    // A survivor: nothing of the abandoned step stays; its collectives were the broken group's.
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.clear();
    next_launch_ = 0;
    // Stage 3's prefetch order comes back with the snapshot (LoadImage).
    for (Unit& unit : units_) {
      unit.work.reset();
      unit.gather.reset();
      unit.done = 0;
      unit.bucket = at::Tensor();
      if (unit.flat_grad.defined()) unit.flat_grad.zero_();
      if (!ShardGradIsView()) unit.shard_grad.zero_();
      if (unit.sharded() && unit.whole && !keep_whole_) {
        ReleaseStorage(unit.flat_param);
        unit.whole = false;
      }
    }
    if (stage_ >= 2)
      for (auto& p : params_) p.mutable_grad() = at::Tensor();
  }

  // Units by index: this rank's slice of each (the rest of an unsharded unit is the other
  // ranks' slices, gathered again by LoadImage); the buffers; the shard optimizer.
  void SaveImage(torch::serialize::OutputArchive& archive, Optimizer&) override {
    std::lock_guard<std::mutex> lock(mu_);
    // A copy: an archive keeps a view's whole storage.
    for (size_t u = 0; u < units_.size(); ++u)
      archive.write("zero/unit" + std::to_string(u), OwnSlice(units_[u]).clone());
    for (auto& [name, b] : model_->NamedBuffers()) archive.write("buffer/" + name, b.detach());
    torch::serialize::OutputArchive opt;
    shard_optimizer_->save(opt);
    archive.write("zero/optimizer", opt);
    // Stage 3 prefetches along the order the forward before ran its units: the replacement
    // must issue the gathers the others do.
    archive.write("zero/recording", IndexTensor(recording_));
    archive.write("zero/order", IndexTensor(order_));
  }

  Status LoadImage(torch::serialize::InputArchive& archive, Optimizer&) override {
    std::string key;
    try {
      torch::NoGradGuard no_grad;
      auto restore = [&](const std::string& name, const at::Tensor& dst) {
        key = name;
        at::Tensor src;
        archive.read(name, src);
        TORCH_CHECK(src.sizes().equals(dst.sizes()), "shape ", src.sizes(), " where ", dst.sizes(),
                    " was expected");
        dst.detach().copy_(src);
      };
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t u = 0; u < units_.size(); ++u)
        restore("zero/unit" + std::to_string(u), OwnSlice(units_[u]));
      // The unsharded units whole again, from every rank's slice (as Step ends). COLLECTIVE:
      // every rank loads its image at the same point of RollBack.
      std::vector<c10::intrusive_ptr<c10d::Work>> gathers;
      for (auto& unit : units_)
        if (!unit.sharded())
          gathers.push_back(pg_->AllGatherFlat(
              unit.flat_param.narrow(0, rank() * unit.shard, unit.shard), unit.flat_param));
      for (auto& work : gathers) work->wait();
      for (auto& [name, b] : model_->NamedBuffers()) restore("buffer/" + name, b);
      key = "zero/optimizer";
      torch::serialize::InputArchive opt;
      archive.read(key, opt);
      shard_optimizer_->state().clear();  // as the image has it, none included (strategy.cc)
      shard_optimizer_->load(opt);
      key = "zero/order";
      recording_ = ReadIndices(archive, "zero/recording");
      order_ = ReadIndices(archive, "zero/order");
    } catch (const c10::Error& e) {
      return Status::InvalidConfig("this rank's snapshot: cannot restore " + key + ": " +
                                   e.what_without_backtrace());
    }
    return Status::Ok();
  }

  static at::Tensor IndexTensor(const std::vector<size_t>& v) {
    std::vector<int64_t> values(v.begin(), v.end());
    return torch::tensor(values, torch::kLong).reshape({static_cast<int64_t>(values.size())});
  }
  static std::vector<size_t> ReadIndices(torch::serialize::InputArchive& archive,
                                         const std::string& key) {
    at::Tensor t;
    archive.read(key, t);
    std::vector<size_t> out;
    for (int64_t i = 0; i < t.numel(); ++i)
      out.push_back(static_cast<size_t>(t[i].item<int64_t>()));
    return out;
  }

  // Setup less the broadcast: the units, the shard optimizer and the gradient hooks.
  void Build() {
    params_ = model_->Parameters();
    BuildUnits();
    BuildShardOptimizer();
    if (stage_ >= 3) SetupUnits();
    if (stage_ >= 2) {
      // Each parameter's gradient leaves as soon as it is accumulated (AfterAccumulate).
      for (auto& p : params_) p.mutable_grad() = at::Tensor();
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
      accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
          [this, i](const torch::autograd::variable_list& outputs,
                    const torch::autograd::variable_list&) {
            AfterAccumulate(i);
            return outputs;
          }));
      // The parameter holds its accumulator weakly; the hooks live as long as we hold it.
      accumulators_.push_back(std::move(accumulator));
    }
  }

  bool SyncGradients(bool window_closes) const override {
    // Stage 2 keeps no whole gradient across micro-batches: every one is reduced.
    return stage_ >= 2 || window_closes || sync_each_batch_;
  }

  void BeforeForward(bool sync) override {
    // Rank 0's buffers before a forward that follows a synchronised one, as ddp.
    if (previous_forward_synced_) SyncBuffers();
    previous_forward_synced_ = sync;
    // The units the last forward ran, in order: this one prefetches along them.
    std::lock_guard<std::mutex> lock(mu_);
    if (!recording_.empty()) order_ = std::move(recording_);
    recording_.clear();
  }

  void SyncBuffers() override { BroadcastBuffers(); }

  void BeforeBackward(const torch::Tensor&, bool sync) override {
    if (stage_ == 1) RepointGradients();
    std::lock_guard<std::mutex> lock(mu_);
    sync_ = sync;
    next_launch_ = 0;
    for (auto& u : units_) u.done = 0;
  }

  void AfterBackward(bool sync) override {
    if (!sync) return;
    auto start = Clock::now();
    {
      Timeline::Scope span("zero", "reduce-scatter: the rest");
      // Units whose parameters got no gradient this time (unused) still go, in order: every
      // rank issues the same sequence.
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t u = 0; u < units_.size(); ++u) {
        if (units_[u].sharded() && units_[u].done < Size(u)) IntoBucket(u);
        units_[u].done = Size(u);
      }
      LaunchReady();
    }
    while (!in_flight_.empty()) CollectOldest();
    // Units that got no gradient (or were prefetched and not used) go back to their shards.
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].sharded() && !keep_whole_) Release(u);
    stats_.blocking_comm_ms += MsSince(start);
  }

  bool AveragesGradients() const override { return true; }

  double ClipGradNorm(double max_norm) override {
    const double norm = std::sqrt(GradNormSquared());
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1) ScaleGradients(coef);
    return norm;
  }

  double GradNormSquared() override {
    // Every element of every gradient is in exactly one rank's shard (padding is zero), so the
    // squares summed over the shards and the ranks are the whole gradient's.
    if (!tensor_group_) {
      auto squares = torch::zeros({1}, params_.front().options().dtype(torch::kDouble));
      for (auto& u : units_) squares += u.shard_grad.to(torch::kDouble).pow(2).sum();
      AllReduceSum(pg_, squares);
      return squares.item<double>();
    }
    // Split over a tensor group too (strategy.h: SetTensorGroup): [0] the squares of tensor
    // shards, summed over the tensor group as well, [1] those of replicated parameters, which
    // every rank of it holds alike: counted once.
    auto squares = torch::zeros({2}, torch::kDouble);
    for (size_t i = 0; i < params_.size(); ++i) {
      const Unit& unit = units_[unit_of_param_[i]];
      const int64_t begin = offset_in_unit_[i], end = begin + params_[i].numel();
      const int64_t lo = std::max(begin, rank() * unit.shard);
      const int64_t hi = std::min(end, (rank() + 1) * unit.shard);
      if (lo >= hi) continue;
      squares[i < split_.size() && split_[i] ? 0 : 1] +=
          unit.shard_grad.narrow(0, lo - rank() * unit.shard, hi - lo)
              .to(torch::kDouble)
              .pow(2)
              .sum()
              .cpu();
    }
    AllReduceSum(pg_, squares);
    torch::Tensor shards = squares.narrow(0, 0, 1).clone();
    tensor_group_->AllReduceSum(shards);
    return shards.item<double>() + squares[1].item<double>();
  }

  void ScaleGradients(double coef) override {
    for (auto& u : units_) u.shard_grad.mul_(coef);
  }

  void DropGradients() override {
    // The whole gradients (stage 1; the shard's among them when it is a view) and the shard's.
    for (auto& u : units_) {
      if (u.flat_grad.defined()) u.flat_grad.zero_();
      if (!ShardGradIsView()) u.shard_grad.zero_();
    }
  }

  void Step(Optimizer& user) override {
    // The user's groups carry the learning rate a schedule set.
    for (size_t g = 0; g < group_of_shard_group_.size(); ++g)
      shard_optimizer_->param_groups()[g].options().set_lr(
          user.param_groups()[group_of_shard_group_[g]].options().get_lr());
    {
      torch::NoGradGuard no_grad;
      shard_optimizer_->step();
    }
    DropGradients();  // the whole (stage 1; the shard among them when a view) and the shard's
    auto start = Clock::now();
    Timeline::Scope span("zero", "all-gather parameters");
    // In place: this rank's slice of each unit is the input.
    // Stage 3's module units stay sharded until their next forward gathers them.
    std::vector<c10::intrusive_ptr<c10d::Work>> gathers;
    for (auto& u : units_)
      if (!u.sharded())
        gathers.push_back(
            pg_->AllGatherFlat(u.flat_param.narrow(0, rank() * u.shard, u.shard), u.flat_param));
    for (auto& work : gathers) work->wait();
    stats_.blocking_comm_ms += MsSince(start);
  }

  void Finish(int64_t) override {
    // Training is over: the model is whole again for whatever reads it next (the final model
    // file, an evaluation, the program's own use), as FSDP's summon_full_params.
    GatherAll();
    keep_whole_ = true;
  }
  int64_t num_buckets() const override { return static_cast<int64_t>(units_.size()); }

  // --- Stage 3: module units gathered around their use (UnitGatherer) -------------------------
  bool IsUnit(const torch::nn::Module& module) const override {
    return unit_of_module_.count(&module) > 0;
  }

  void BeforeUnitForward(const torch::nn::Module& module) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t u = unit_of_module_.at(&module);
    auto start = Clock::now();
    Gather(u);
    Wait(u);
    stats_.blocking_comm_ms += MsSince(start);
    // Training forwards are recorded (not evaluation, not a checkpointed block's recomputation
    // in backward); the next unit of the last forward is fetched while this one runs.
    if (!torch::GradMode::is_enabled() || RecomputingForCheckpoint() ||
        recording_.size() >= 4 * units_.size())
      return;
    recording_.push_back(u);
    const size_t at = recording_.size() - 1;
    if (at + 1 < order_.size() && order_[at] == u) Gather(order_[at + 1]);
  }

  void AfterUnitForward(const torch::nn::Module& module, const torch::Tensor& output) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t u = unit_of_module_.at(&module);
    if (keep_whole_) return;
    const bool backward_follows =
        torch::GradMode::is_enabled() && output.defined() && output.requires_grad();
    // The forward's last unit is the first backward needs: it stays (FSDP keeps it too).
    const bool last = backward_follows && !recording_.empty() && recording_.back() == u &&
                      recording_.size() == order_.size() && order_.back() == u;
    if (!last) Release(u);
    if (backward_follows)
      output.register_hook([this, u](const torch::Tensor&) { BeforeUnitBackward(u); });
  }

  StateBytes MemoryBytes(const Optimizer&) const override {
    StateBytes out;
    auto bytes = [](const at::Tensor& t) {
      return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
    };
    for (const auto& u : units_) {
      // At rest: a stage-3 module unit holds its shard only.
      out.parameters += u.sharded() ? bytes(u.shard_param) : bytes(u.flat_param);
      out.gradients += bytes(u.flat_grad) + (ShardGradIsView() ? 0 : bytes(u.shard_grad));
    }
    out.optimizer = OptimizerStateBytes(*shard_optimizer_);
    return out;
  }

  Status SaveModelState(const std::string& dir, Optimizer& optimizer) override {
    // Parameters and buffers are every rank's (rank 0's model.pt); the user's optimizer is
    // never stepped, so it carries no state there. The state is in the shard files, each piece with
    // the element range of its parameter (checkpoint.h), and rank 0's index of them.
    // Stage 3: model.pt holds whole parameters, gathered for the save and released after it.
    GatherAll();
    Status saved =
        rank() == 0 ? trainer::SaveModelState(dir + "/model.pt", *model_, optimizer) : Status::Ok();
    if (!keep_whole_) ReleaseAll();
    LAUNCH_RETURN_IF_ERROR(saved);
    if (rank() == 0) {
      std::vector<std::vector<PieceRange>> ranks;
      for (int q = 0; q < world(); ++q) ranks.push_back(RangesOfRank(q));
      std::vector<std::string> names;
      for (const auto& [name, p] : model_->NamedParameters()) names.push_back(name);
      LAUNCH_RETURN_IF_ERROR(SaveShardIndex(dir, ranks, LayoutTensor(), names));
    }
    return SaveShardedOptimizerState(dir, rank(), *shard_optimizer_, pieces_);
  }

  void BeginSnapshot() override { GatherAll(); }
  void EndSnapshot() override {
    if (!keep_whole_) ReleaseAll();
  }

  Status LoadModelState(const std::string& dir, Optimizer& optimizer, int64_t written_by) override {
    // model.pt as the default reads it, but a sharded state is not gathered into `optimizer`:
    // this rank takes only its pieces of it.
    // Stage 3: the module units are made whole (no gather: the file has them), and each rank
    // keeps its slice.
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& unit : units_)
        if (unit.sharded() && !unit.whole) {
          AllocateStorage(unit.flat_param);
          unit.flat_param.zero_();
          unit.whole = true;
        }
    }
    Status loaded = trainer::LoadModelState(dir + "/model.pt", *model_, optimizer);
    {
      torch::NoGradGuard no_grad;
      for (auto& unit : units_)
        if (unit.sharded())
          unit.shard_param.copy_(unit.flat_param.narrow(0, rank() * unit.shard, unit.shard));
    }
    if (!keep_whole_) ReleaseAll();
    LAUNCH_RETURN_IF_ERROR(loaded);
    if (HasShardedOptimizerState(dir)) {
      LAUNCH_ASSIGN_OR_RETURN(ShardedLoad load,
                              LoadShardedOptimizerState(dir, *shard_optimizer_, pieces_));
      if (rank() == 0 && (load.written_by != world() || !load.same_cut))
        std::fprintf(stderr,
                     "train: ZeRO optimizer state recut: written as %s, read as %s (world, "
                     "stage, unit sizes); rank 0 read %lld of the %lld shard files\n",
                     LayoutText(load.layout).c_str(), LayoutText(LayoutTensor()).c_str(),
                     static_cast<long long>(load.files_read),
                     static_cast<long long>(load.written_by));
      return Status::Ok();
    }
    if (FileExists(ShardFile(dir, 0))) {
      // Written before the shards had an index: an optimizer saved whole per rank.
      if (written_by != world())
        return Status::InvalidConfig(
            "the checkpoint in " + dir + " holds ZeRO optimizer state sharded over " +
            std::to_string(written_by) + " ranks in the format before shards could be recut; " +
            "resume it with " + std::to_string(written_by) + " ranks (its next checkpoint can " +
            "then be resumed at any world size)");
      return LoadOptimizerState(ShardFile(dir, rank()), *shard_optimizer_, LayoutTensor());
    }
    // No shards: an unsharded run (one process, ddp) from before its state was in pieces left
    // the whole state in model.pt, now in `optimizer`.
    // This rank takes its pieces, and the whole copy goes.
    LAUNCH_ASSIGN_OR_RETURN(std::vector<ParamPiece> whole, WholeParamPieces(*model_, optimizer));
    LAUNCH_RETURN_IF_ERROR(ReshardOptimizerState(optimizer, whole, *shard_optimizer_, pieces_));
    optimizer.state().clear();
    return Status::Ok();
  }

 private:
  // The element ranges of the parameters that rank q's optimizer steps (what BuildShardOptimizer
  // cuts for this rank), in the user's group order.
  std::vector<PieceRange> RangesOfRank(int q) const {
    std::unordered_map<const void*, size_t> param_index;
    for (size_t i = 0; i < params_.size(); ++i) param_index[params_[i].unsafeGetTensorImpl()] = i;
    std::vector<PieceRange> ranges;
    for (const auto& group : user_->param_groups())
      for (const auto& p : group.params()) {
        const size_t i = param_index.at(p.unsafeGetTensorImpl());
        const Unit& unit = units_[unit_of_param_[i]];
        const int64_t begin = offset_in_unit_[i], end = begin + params_[i].numel();
        const int64_t lo = std::max(begin, q * unit.shard);
        const int64_t hi = std::min(end, (q + 1) * unit.shard);
        if (lo < hi) ranges.push_back({static_cast<int64_t>(i), lo - begin, hi - begin});
      }
    return ranges;
  }

  // "[2, 1, 4160, 4160]" of a layout tensor.
  static std::string LayoutText(const at::Tensor& layout) {
    std::string out = "[";
    const at::Tensor flat = layout.to(torch::kLong).reshape({-1});
    for (int64_t i = 0; i < flat.numel(); ++i)
      out += (i ? ", " : "") + std::to_string(flat[i].item<int64_t>());
    return out + "]";
  }

  // What the shards' layout depends on: the world, the stage and each unit's size.
  at::Tensor LayoutTensor() const {
    std::vector<int64_t> v = {world(), stage_};
    for (const auto& u : units_) v.push_back(u.numel);
    return torch::tensor(v, torch::kLong);
  }

  int64_t Size(size_t u) const { return static_cast<int64_t>(units_[u].params.size()); }

  // Stage 3: the model's outermost ShardUnit modules and, for each, the indices into params_ of
  // the trained parameters only it uses, in descending order (the order backward produces
  // them). A parameter also reached from another unit or from outside every unit is left to the
  // root. Units in descending order of their last parameter: about the reverse of forward.
  std::vector<std::pair<const torch::nn::Module*, std::vector<size_t>>> ModuleUnits() const {
    std::vector<std::pair<std::string, const torch::nn::Module*>> units;
    for (const auto& item : model_->module().named_modules("", /*include_self=*/false)) {
      if (dynamic_cast<const ShardUnit*>(item.value().get()) == nullptr) continue;
      bool inner = false;
      for (const auto& [name, m] : units) inner = inner || item.key().rfind(name + ".", 0) == 0;
      if (!inner) units.emplace_back(item.key(), item.value().get());
    }
    std::unordered_map<const void*, size_t> index;
    for (size_t i = 0; i < params_.size(); ++i) index[params_[i].unsafeGetTensorImpl()] = i;
    // Each parameter's owner: the unit its every occurrence lies in, or -1 (the root).
    constexpr int kUnset = -2, kRoot = -1;
    std::vector<int> owner(params_.size(), kUnset);
    for (const auto& item : model_->module().named_parameters(/*recurse=*/true)) {
      auto it = index.find(item.value().unsafeGetTensorImpl());
      if (it == index.end()) continue;  // frozen: stays whole
      int here = kRoot;
      for (size_t u = 0; u < units.size(); ++u)
        if (item.key().rfind(units[u].first + ".", 0) == 0) here = static_cast<int>(u);
      int& o = owner[it->second];
      o = (o == kUnset || o == here) ? here : kRoot;
    }
    std::vector<std::pair<const torch::nn::Module*, std::vector<size_t>>> out;
    for (size_t u = 0; u < units.size(); ++u) {
      std::vector<size_t> mine;
      for (size_t k = params_.size(); k-- > 0;)
        if (owner[k] == static_cast<int>(u)) mine.push_back(k);
      if (!mine.empty()) out.emplace_back(units[u].second, std::move(mine));
    }
    return out;
  }

  void BuildUnits() {
    torch::NoGradGuard no_grad;
    const int64_t element = params_.front().element_size();
    std::vector<bool> in_module_unit(params_.size(), false);
    if (stage_ >= 3)
      for (auto& [module, params] : ModuleUnits()) {
        Unit unit;
        unit.module = module;
        for (size_t k : params) {
          in_module_unit[k] = true;
          unit.params.push_back(k);
          unit.offset.push_back(unit.numel);
          unit.numel += params_[k].numel();
        }
        units_.push_back(std::move(unit));
      }
    // The rest by size, backwards: the order backward produces gradients in, so unit 0 is ready
    // first.
    Unit current;
    auto close = [&] {
      if (current.params.empty()) return;
      units_.push_back(std::move(current));
      current = Unit();
    };
    for (size_t k = params_.size(); k-- > 0;) {
      if (in_module_unit[k]) continue;
      const int64_t n = params_[k].numel();
      if (!current.params.empty() &&
          static_cast<size_t>((current.numel + n) * element) > unit_cap_bytes_)
        close();
      current.params.push_back(k);
      current.offset.push_back(current.numel);
      current.numel += n;
    }
    close();
    // Reduce-scatters go in unit order: about the order of backward (by each unit's last
    // parameter), so a unit rarely waits for one before it.
    std::stable_sort(units_.begin(), units_.end(), [](const Unit& a, const Unit& b) {
      return a.params.front() > b.params.front();
    });
    unit_of_param_.assign(params_.size(), 0);
    const auto options = params_.front().options();
    for (size_t u = 0; u < units_.size(); ++u) {
      Unit& unit = units_[u];
      unit.padded = (unit.numel + world() - 1) / world() * world();
      unit.shard = unit.padded / world();
      unit.flat_param = torch::zeros({unit.padded}, options);
      if (stage_ == 1) unit.flat_grad = torch::zeros({unit.padded}, options);
      unit.shard_grad = ShardGradIsView()
                            ? unit.flat_grad.narrow(0, rank() * unit.shard, unit.shard)
                            : torch::zeros({unit.shard}, options);
      for (size_t j = 0; j < unit.params.size(); ++j) {
        at::Tensor& p = params_[unit.params[j]];
        unit_of_param_[unit.params[j]] = u;
        at::Tensor view = unit.flat_param.narrow(0, unit.offset[j], p.numel()).view(p.sizes());
        view.copy_(p);
        p.set_data(view);
        if (stage_ == 1) p.mutable_grad() = GradAlias(unit, j);
      }
      if (unit.sharded()) {
        unit.shard_param = unit.flat_param.narrow(0, rank() * unit.shard, unit.shard).clone();
        unit_of_module_[unit.module] = u;
      }
    }
    offset_in_unit_.assign(params_.size(), 0);
    for (const Unit& unit : units_)
      for (size_t j = 0; j < unit.params.size(); ++j)
        offset_in_unit_[unit.params[j]] = unit.offset[j];
  }

  // Stage 1: parameter j of `unit`'s gradient as its place in flat_grad, the same memory but not
  // an autograd view (a view would make a ported loop's optimizer.zero_grad() abort: it
  // detach_()es every gradient; ddp.cc's UnviewGradients says more).
  at::Tensor GradAlias(const Unit& unit, size_t j) const {
    const at::Tensor& p = params_[unit.params[j]];
    const at::Tensor region = unit.flat_grad.narrow(0, unit.offset[j], p.numel());
    return at::empty({0}, region.options())
        .set_(region.storage(), region.storage_offset(), p.sizes());
  }

  // Stage 1, before a backward: a gradient the user set to none (optimizer.zero_grad() in
  // LibTorch 2) or replaced is pointed back at flat_grad, which the reduction reads: as zeros
  // when it was none, with its values when it was replaced.
  void RepointGradients() {
    torch::NoGradGuard no_grad;
    for (Unit& unit : units_) {
      for (size_t j = 0; j < unit.params.size(); ++j) {
        at::Tensor& grad = params_[unit.params[j]].mutable_grad();
        if (grad.defined() && grad.is_alias_of(unit.flat_grad)) continue;
        at::Tensor alias = GradAlias(unit, j);
        if (grad.defined()) {
          alias.copy_(grad);
        } else {
          alias.zero_();
        }
        grad = alias;
      }
    }
  }

  // This rank's slice of unit u's parameters: what its optimizer steps.
  at::Tensor OwnSlice(Unit& unit) {
    return unit.sharded() ? unit.shard_param
                          : unit.flat_param.narrow(0, rank() * unit.shard, unit.shard);
  }

  void BuildShardOptimizer() {
    std::unordered_map<const void*, size_t> param_index;
    for (size_t i = 0; i < params_.size(); ++i) param_index[params_[i].unsafeGetTensorImpl()] = i;
    std::vector<OptimizerParamGroup> groups;
    const auto& user_groups = user_->param_groups();
    for (size_t g = 0; g < user_groups.size(); ++g) {
      std::vector<at::Tensor> segments;
      for (const auto& p : user_groups[g].params()) {
        const size_t i = param_index.at(p.unsafeGetTensorImpl());
        Unit& unit = units_[unit_of_param_[i]];
        // The parameter's range in the unit, met with this rank's slice.
        const int64_t begin = offset_in_unit_[i], end = begin + params_[i].numel();
        const int64_t lo = std::max(begin, rank() * unit.shard);
        const int64_t hi = std::min(end, (rank() + 1) * unit.shard);
        if (lo >= hi) continue;
        at::Tensor segment = OwnSlice(unit).narrow(0, lo - rank() * unit.shard, hi - lo);
        segment.mutable_grad() = unit.shard_grad.narrow(0, lo - rank() * unit.shard, hi - lo);
        segments.push_back(segment);
        pieces_.push_back({{static_cast<int64_t>(i), lo - begin, hi - begin}, segment});
      }
      if (segments.empty()) continue;
      groups.emplace_back(std::move(segments), user_groups[g].options().clone());
      group_of_shard_group_.push_back(g);
    }
    if (groups.empty()) {
      // This rank's slices hold only padding: an optimizer over nothing still steps.
      unit_pad_ = torch::zeros({1}, params_.front().options());
      groups.emplace_back(std::vector<at::Tensor>{unit_pad_},
                          user_groups.front().options().clone());
      group_of_shard_group_.push_back(0);
    }
    shard_optimizer_ = OptimizerLike(*user_, std::move(groups)).value();
  }

  // Runs on the autograd thread after parameter i's gradient was accumulated.
  void AfterAccumulate(size_t i) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!sync_ && stage_ == 1) return;  // no_sync: gradients accumulate in place
    const size_t u = unit_of_param_[i];
    Unit& unit = units_[u];
    if (stage_ >= 2 && !unit.sharded()) {
      at::Tensor& grad = params_[i].mutable_grad();
      if (!unit.bucket.defined()) unit.bucket = torch::zeros({unit.padded}, grad.options());
      unit.bucket.narrow(0, offset_in_unit_[i], grad.numel()).copy_(grad.reshape({-1}));
      grad = at::Tensor();  // the whole gradient goes now; its unit's bucket has it
    }
    ++unit.done;
    if (unit.sharded() && unit.done == Size(u)) IntoBucket(u);
    LaunchReady();
  }

  // Stage 3, a module unit whose backward is over (every gradient in, or backward ended): its
  // parameters go first, then its gradients, kept whole until now, move into its bucket. A unit
  // holds either its parameters and gradients or its gradients and bucket, never all three (its
  // largest moment: one layer's parameters and gradient, not those and its bucket).
  // REQUIRES: mu_ held.
  void IntoBucket(size_t u) {
    Unit& unit = units_[u];
    if (!keep_whole_) Release(u);
    for (size_t j = 0; j < unit.params.size(); ++j) {
      at::Tensor& grad = params_[unit.params[j]].mutable_grad();
      if (!grad.defined()) continue;
      if (!unit.bucket.defined()) unit.bucket = torch::zeros({unit.padded}, grad.options());
      unit.bucket.narrow(0, unit.offset[j], grad.numel()).copy_(grad.reshape({-1}));
      grad = at::Tensor();
    }
  }

  // Launches, in unit order, every unit whose parameters are all done. REQUIRES: mu_ held.
  void LaunchReady() {
    while (next_launch_ < units_.size() && units_[next_launch_].done == Size(next_launch_)) {
      Unit& unit = units_[next_launch_++];
      at::Tensor input = stage_ == 1 ? unit.flat_grad : unit.bucket;
      if (!input.defined())
        input = unit.bucket = torch::zeros({unit.padded}, unit.flat_param.options());
      // Averaged as DDP averages (ddp.cc), so that the results are its bit for bit: each
      // rank's share divided by W before the sum, on every backward alike (a multiplication
      // by 1/W on the first one only, as c10d's reducer does by default, rounds differently
      // for W = 3 and made a resumed job differ from the undisturbed one).
      input.div_(world());
      // In place: the sum lands in this rank's own slice of the input.
      unit.work = pg_->ReduceScatterFlat(input, input.narrow(0, rank() * unit.shard, unit.shard));
      in_flight_.push_back(&unit);
      // Stage 2 holds one unit's bucket in flight beyond the one filling: the gradients of one
      // unit at a time, not of the whole model, outlive their parameters' backward (two in
      // flight cost a third of the saving on the benchmark's MLP and no speed).
      while (stage_ >= 2 && in_flight_.size() > kMaxInFlight) CollectOldest();
    }
  }

  // Waits for the oldest launched unit's reduce-scatter and takes its result into the shard's
  // gradient: in stage 1 it is already there (the shard's gradient is the own slice); otherwise
  // it is added (the shard's gradient is zero after a step, so then it is the result exactly)
  // and the unit's bucket, or whole gradients (sync_each_batch), start again from zero.
  // REQUIRES: mu_ held or backward finished.
  void CollectOldest() {
    Unit& unit = *in_flight_.front();
    in_flight_.pop_front();
    unit.work->wait();
    unit.work.reset();
    if (ShardGradIsView()) return;
    if (stage_ >= 2) {
      unit.shard_grad.add_(unit.bucket.narrow(0, rank() * unit.shard, unit.shard));
      unit.bucket = at::Tensor();
    } else {
      unit.shard_grad.add_(unit.flat_grad.narrow(0, rank() * unit.shard, unit.shard));
      unit.flat_grad.zero_();
    }
  }

  bool ShardGradIsView() const { return stage_ == 1 && !sync_each_batch_; }

  // Stage 3's start: module units go to their shards, and ShardedForward comes here.
  void SetupUnits() {
    int64_t in_units = 0, total = 0, units = 0;
    for (const auto& p : params_) total += p.numel();
    for (size_t u = 0; u < units_.size(); ++u)
      if (units_[u].sharded()) {
        ++units;
        in_units += units_[u].numel;
        Release(u);
      }
    SetUnitGatherer(this);
    installed_ = true;
    if (rank() != 0) return;
    if (units == 0) {
      std::printf(
          "train: ZeRO stage 3: the model has no ShardUnit modules (model/shard_unit.h), so its "
          "parameters stay whole on every rank and only gradients and optimizer state are "
          "sharded (as stage 2)\n");
    } else {
      std::printf(
          "train: ZeRO stage 3: %lld units (ShardUnit modules) hold %lld of the %lld trained "
          "parameters, sharded over %d ranks; the other %lld stay whole on every rank\n",
          static_cast<long long>(units), static_cast<long long>(in_units),
          static_cast<long long>(total), world(), static_cast<long long>(total - in_units));
    }
    std::fflush(stdout);
  }

  // A module unit's parameters whole: storage back and an all-gather of the shards into it,
  // launched (Wait finishes it). No-op when whole or on its way. REQUIRES: mu_ held or no
  // backward running.
  void Gather(size_t u) {
    Unit& unit = units_[u];
    if (!unit.sharded() || unit.whole) return;
    AllocateStorage(unit.flat_param);
    unit.whole = true;
    unit.gather = pg_->AllGatherFlat(unit.shard_param, unit.flat_param);
  }
  void Wait(size_t u) {
    Unit& unit = units_[u];
    if (!unit.gather) return;
    unit.gather->wait();
    unit.gather.reset();
  }
  // The unit's flat buffer gives its memory back; its parameters keep their shapes but hold no
  // data until the next Gather (FSDP frees storage the same way: every view of the buffer,
  // those autograd saved included, sees the data again once it is gathered).
  void Release(size_t u) {
    Unit& unit = units_[u];
    if (!unit.sharded() || !unit.whole) return;
    Wait(u);
    ReleaseStorage(unit.flat_param);
    unit.whole = false;
  }
  void GatherAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t u = 0; u < units_.size(); ++u) Gather(u);
    for (size_t u = 0; u < units_.size(); ++u) Wait(u);
  }
  void ReleaseAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t u = 0; u < units_.size(); ++u) Release(u);
  }

  // The gradient of unit u's output arrived: backward is about to use its parameters. The unit
  // that ran before it in forward is fetched meanwhile, unless its backward is done.
  void BeforeUnitBackward(size_t u) {
    std::lock_guard<std::mutex> lock(mu_);
    auto start = Clock::now();
    Gather(u);
    Wait(u);
    stats_.blocking_comm_ms += MsSince(start);
    for (size_t at = recording_.size(); at-- > 1;)
      if (recording_[at] == u) {
        const size_t before = recording_[at - 1];
        if (units_[before].done == 0) Gather(before);
        break;
      }
  }

  static void AllocateStorage(const at::Tensor& flat) {
    c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
    const size_t bytes = static_cast<size_t>(flat.numel()) * flat.element_size();
    // A CUDA allocator allocates on the current device: make it the buffer's.
    const c10::DeviceGuard on(flat.device());
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
    storage->set_nbytes(bytes);
  }
  static void ReleaseStorage(const at::Tensor& flat) {
    c10::StorageImpl* storage = flat.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, storage->device()));
    storage->set_nbytes(0);
  }

  const int stage_;
  const size_t unit_cap_bytes_;
  const bool sync_each_batch_;
  Optimizer* user_;
  std::vector<at::Tensor> params_;
  std::vector<Unit> units_;
  std::vector<size_t> unit_of_param_;
  std::vector<int64_t> offset_in_unit_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::unique_ptr<Optimizer> shard_optimizer_;
  std::vector<ParamPiece> pieces_;  // its parameters: where in the model each segment lies
  std::vector<size_t> group_of_shard_group_;  // shard group -> the user's group it copies
  at::Tensor unit_pad_;  // the stand-in parameter of a shard optimizer over padding only
  bool sync_ = true;
  bool previous_forward_synced_ = true;  // the first forward broadcasts, as ddp's does
  std::mutex mu_;                        // the autograd engine may run the hooks on its own thread
  size_t next_launch_ = 0;               // guarded by mu_
  std::deque<Unit*> in_flight_;          // launched, not collected, oldest first; guarded by mu_
  static constexpr size_t kMaxInFlight = 1;
  // Stage 3.
  std::unordered_map<const torch::nn::Module*, size_t> unit_of_module_;
  std::vector<size_t> recording_;  // module units in the order this forward ran them; mu_
  std::vector<size_t> order_;      // the same of the forward before; mu_
  bool keep_whole_ = false;        // after Finish: gathered for good
  bool installed_ = false;         // this is the UnitGatherer
};

}  // namespace

StatusOr<std::unique_ptr<ParallelStrategy>> CreateZeroStrategy(
    const config::TrainConfig& cfg, Model* model, torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<CountingProcessGroup> pg) {
  auto zero = std::make_unique<ZeroStrategy>(cfg, model, optimizer, std::move(pg));
  LAUNCH_RETURN_IF_ERROR(zero->Check());
  // The shard optimizer's type must be known before Setup builds it.
  LAUNCH_RETURN_IF_ERROR(OptimizerLike(*optimizer, {}).status());
  return std::unique_ptr<ParallelStrategy>(std::move(zero));
}

Status ZeroSupports(const Platform& platform) {
  // Shards, buckets and gathers live on the parameters' device; on CUDA they travel over NCCL
  // (reduce-scatter, all-gather) or Gloo (CountingProcessGroup's flat collectives).
  return platform.CheckAutocast();
}

}  // namespace launch::trainer
