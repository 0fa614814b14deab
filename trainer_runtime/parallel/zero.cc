#include "trainer_runtime/parallel/zero.h"

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
  if (dynamic_cast<const o::AdamW*>(&like))
    return std::unique_ptr<Optimizer>(std::make_unique<o::AdamW>(
        std::move(groups), static_cast<const o::AdamWOptions&>(like.defaults())));
  if (dynamic_cast<const o::Adam*>(&like))
    return std::unique_ptr<Optimizer>(std::make_unique<o::Adam>(
        std::move(groups), static_cast<const o::AdamOptions&>(like.defaults())));
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
  at::Tensor flat_grad;         // stage 1: [padded], the gradients are views into it
  at::Tensor bucket;            // stage 2: this micro-batch's gradients until reduced
  // [shard]: this rank's slice of the averaged gradients. Stage 1 (without sync_each_batch):
  // a view of flat_grad's own slice, where the reduce-scatter leaves it; otherwise its own
  // buffer, accumulating each micro-batch's result.
  at::Tensor shard_grad;
  int64_t done = 0;  // parameters whose gradient is accumulated this backward
  c10::intrusive_ptr<c10d::Work> work;
};

class ZeroStrategy : public ParallelStrategy {
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

  const char* Name() const override { return "zero"; }
  bool ReplicasEqual() const override { return true; }

  // Checks what Setup relies on; called by the factory.
  Status Check() const {
    const auto params = model_->Parameters();
    for (const auto& p : params) {
      if (!p.device().is_cpu())
        return Status::InvalidConfig("train.parallel.mode zero runs on the CPU");
      if (p.scalar_type() != params.front().scalar_type())
        return Status::InvalidConfig(
            "train.parallel.mode zero needs every trained parameter of one dtype; the model "
            "mixes " +
            std::string(c10::toString(params.front().scalar_type())) + " and " +
            c10::toString(p.scalar_type()));
    }
    std::unordered_map<const void*, bool> in_model;
    for (const auto& p : params) in_model[p.unsafeGetTensorImpl()] = true;
    for (const auto& group : user_->param_groups())
      for (const auto& p : group.params())
        if (!in_model.count(p.unsafeGetTensorImpl()))
          return Status::InvalidConfig(
              "train.parallel.mode zero: the optimizer holds a tensor that is not a trained "
              "parameter of the prepared model");
    return Status::Ok();
  }

  void Setup() override {
    BroadcastModel(pg_, model_);
    params_ = model_->Parameters();
    BuildUnits();
    BuildShardOptimizer();
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
  }

  void SyncBuffers() override { BroadcastBuffers(); }

  void BeforeBackward(const torch::Tensor&, bool sync) override {
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
      for (size_t u = 0; u < units_.size(); ++u) units_[u].done = Size(u);
      LaunchReady();
    }
    while (!in_flight_.empty()) CollectOldest();
    first_sync_ = false;
    stats_.blocking_comm_ms += MsSince(start);
  }

  double ClipGradNorm(double max_norm) override {
    // Every element of every gradient is in exactly one rank's shard (padding is zero), so the
    // squares summed over the shards and the ranks are the whole gradient's.
    auto squares = torch::zeros({1}, torch::kDouble);
    for (auto& u : units_) squares += u.shard_grad.to(torch::kDouble).pow(2).sum();
    AllReduceSum(pg_, squares);
    const double norm = std::sqrt(squares.item<double>());
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1)
      for (auto& u : units_) u.shard_grad.mul_(coef);
    return norm;
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
    // The whole gradients (stage 1; the shard's among them when it is a view) and the shard's.
    for (auto& u : units_) {
      if (u.flat_grad.defined()) u.flat_grad.zero_();
      if (!ShardGradIsView()) u.shard_grad.zero_();
    }
    auto start = Clock::now();
    Timeline::Scope span("zero", "all-gather parameters");
    // In place: this rank's slice of each unit is the input.
    std::vector<c10::intrusive_ptr<c10d::Work>> gathers;
    for (auto& u : units_)
      gathers.push_back(
          pg_->AllGatherFlat(u.flat_param.narrow(0, rank() * u.shard, u.shard), u.flat_param));
    for (auto& work : gathers) work->wait();
    stats_.blocking_comm_ms += MsSince(start);
  }

  void AfterOptimizerStep(int64_t) override {}
  void Finish(int64_t) override {}
  int64_t num_buckets() const override { return static_cast<int64_t>(units_.size()); }

  StateBytes MemoryBytes(const Optimizer&) const override {
    StateBytes out;
    auto bytes = [](const at::Tensor& t) {
      return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
    };
    for (const auto& u : units_) {
      out.parameters += bytes(u.flat_param);
      out.gradients += bytes(u.flat_grad) + (ShardGradIsView() ? 0 : bytes(u.shard_grad));
    }
    out.optimizer = OptimizerStateBytes(*shard_optimizer_);
    return out;
  }

  Status SaveModelState(const std::string& dir, Optimizer& optimizer) override {
    // Parameters and buffers are every rank's (ddp's model.pt); the user's optimizer is never
    // stepped, so it carries no state there. The state is in the shard files, each piece with
    // the element range of its parameter (checkpoint.h), and rank 0's index of them.
    LAUNCH_RETURN_IF_ERROR(ParallelStrategy::SaveModelState(dir, optimizer));
    if (rank() == 0) {
      std::vector<std::vector<PieceRange>> ranks;
      for (int q = 0; q < world(); ++q) ranks.push_back(RangesOfRank(q));
      LAUNCH_RETURN_IF_ERROR(SaveShardIndex(dir, ranks, LayoutTensor()));
    }
    return SaveShardedOptimizerState(dir, rank(), *shard_optimizer_, pieces_);
  }

  Status LoadModelState(const std::string& dir, Optimizer& optimizer, int64_t written_by) override {
    // model.pt as the default reads it, but a sharded state is not gathered into `optimizer`:
    // this rank takes only its pieces of it.
    LAUNCH_RETURN_IF_ERROR(trainer::LoadModelState(dir + "/model.pt", *model_, optimizer));
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
    // No shards: an unsharded run (one process, ddp) left the whole state in model.pt, now in
    // `optimizer`. This rank takes its pieces, and the whole copy goes.
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

  void BuildUnits() {
    torch::NoGradGuard no_grad;
    const int64_t element = params_.front().element_size();
    // Backwards: the order backward produces gradients in, so unit 0 is ready first.
    Unit current;
    auto close = [&] {
      if (current.params.empty()) return;
      units_.push_back(std::move(current));
      current = Unit();
    };
    for (size_t k = params_.size(); k-- > 0;) {
      const int64_t n = params_[k].numel();
      if (!current.params.empty() &&
          static_cast<size_t>((current.numel + n) * element) > unit_cap_bytes_)
        close();
      current.params.push_back(k);
      current.offset.push_back(current.numel);
      current.numel += n;
    }
    close();
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
        if (stage_ == 1)
          p.mutable_grad() = unit.flat_grad.narrow(0, unit.offset[j], p.numel()).view(p.sizes());
      }
    }
    offset_in_unit_.assign(params_.size(), 0);
    for (const Unit& unit : units_)
      for (size_t j = 0; j < unit.params.size(); ++j)
        offset_in_unit_[unit.params[j]] = unit.offset[j];
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
        at::Tensor segment = unit.flat_param.narrow(0, lo, hi - lo);
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
    Unit& unit = units_[unit_of_param_[i]];
    if (stage_ >= 2) {
      at::Tensor& grad = params_[i].mutable_grad();
      if (!unit.bucket.defined()) unit.bucket = torch::zeros({unit.padded}, grad.options());
      unit.bucket.narrow(0, offset_in_unit_[i], grad.numel()).copy_(grad.reshape({-1}));
      grad = at::Tensor();  // the whole gradient goes now; its unit's bucket has it
    }
    ++unit.done;
    LaunchReady();
  }

  // Launches, in unit order, every unit whose parameters are all done. REQUIRES: mu_ held.
  void LaunchReady() {
    while (next_launch_ < units_.size() && units_[next_launch_].done == Size(next_launch_)) {
      Unit& unit = units_[next_launch_++];
      at::Tensor input = stage_ == 1 ? unit.flat_grad : unit.bucket;
      if (!input.defined())
        input = unit.bucket = torch::zeros({unit.padded}, unit.flat_param.options());
      // Averaged as DDP's reducer averages, so that the results are its bit for bit: each
      // rank's share scaled before the sum, by 1/W on the first synchronised backward (where
      // the reducer copies fresh gradients into its buckets with a multiplication) and divided
      // by W afterwards (where the gradients are its bucket views, divided in place). For
      // W = 3 the two round differently.
      if (first_sync_) {
        input.mul_(1.0 / world());
      } else {
        input.div_(world());
      }
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
  at::Tensor unit_pad_ = torch::zeros({1});
  bool sync_ = true;
  bool first_sync_ = true;               // guarded by mu_ while backward runs
  bool previous_forward_synced_ = true;  // the first forward broadcasts, as ddp's does
  std::mutex mu_;                        // the autograd engine may run the hooks on its own thread
  size_t next_launch_ = 0;               // guarded by mu_
  std::deque<Unit*> in_flight_;          // launched, not collected, oldest first; guarded by mu_
  static constexpr size_t kMaxInFlight = 1;
};

}  // namespace

StatusOr<std::unique_ptr<ParallelStrategy>> CreateZeroStrategy(
    const config::TrainConfig& cfg, Model* model, torch::optim::Optimizer* optimizer,
    c10::intrusive_ptr<CountingProcessGroup> pg) {
  if (cfg.parallel.zero_stage >= 3)
    return Status::InvalidConfig(
        "train.parallel.zero_stage: 3 (sharded parameters) is not built yet; use 1 or 2");
  auto zero = std::make_unique<ZeroStrategy>(cfg, model, optimizer, std::move(pg));
  LAUNCH_RETURN_IF_ERROR(zero->Check());
  // The shard optimizer's type must be known before Setup builds it.
  LAUNCH_RETURN_IF_ERROR(OptimizerLike(*optimizer, {}).status());
  return std::unique_ptr<ParallelStrategy>(std::move(zero));
}

}  // namespace launch::trainer
