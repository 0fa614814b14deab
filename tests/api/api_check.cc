// A user's program on the public API only (accelerator.h, pipeline_stages.h, sampler.h,
// shard_unit.h), for
// tests/api/test_api.py: trains a small model of its own on a torch::data dataset of its own in
// the mode given by flags, or (--reference) computes the same training with plain LibTorch in one
// process. Both write the final parameters as raw float32 to --out (rank R appends .R).
//
//   api_check --mode ddp|zero|local_sgd|dp|pipeline|none [--zero_stage 1|2|3] [--accum N]
//             [--sync_each_batch]
//             [--local_sgd K] [--schedule gpipe|1f1b] [--steps S] [--skew_init]
//             [--loader_batch B] [--own_backward] --out FILE
//   api_check --reference --world W [same flags] --out FILE
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "tests/api/check_util.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/sampler.h"
#include "trainer_runtime/model/pipeline_stages.h"
#include "trainer_runtime/model/shard_unit.h"

namespace {

using launch::trainer::Accelerator;
using launch::trainer::check::WriteFloats;

constexpr int64_t kSamples = 512, kFeatures = 6, kClasses = 3, kBatch = 8;
constexpr uint64_t kSeed = 5;

// The user's data: a torch::data::Dataset whose examples are stacked by the loader.
class Blobs : public torch::data::datasets::Dataset<Blobs> {
 public:
  Blobs() {
    auto gen = at::detail::createCPUGenerator(77);
    x_ = torch::randn({kSamples, kFeatures}, gen);
    y_ = torch::randint(0, kClasses, {kSamples}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  c10::optional<size_t> size() const override { return kSamples; }
  torch::Tensor x_, y_;
};

// A block of the user's own: a ZeRO stage-3 unit (shard_unit.h), whose parameters are gathered
// around its forward; plain fn(x) in every other mode.
struct BlockImpl : torch::nn::Module, launch::trainer::ShardUnit {
  BlockImpl(int64_t in, int64_t out, torch::Tensor shared_gain) {
    fc = register_module("fc", torch::nn::Linear(in, out));
    gain = register_parameter("gain", std::move(shared_gain));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return launch::trainer::ShardedForward(
        *this, [this](const torch::Tensor& h) { return torch::tanh(fc->forward(h)) * gain; }, x);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor gain;
};
TORCH_MODULE(Block);

// The user's model: two blocks that share (tie) one gain vector, a head, and a frozen
// embedding-like table that DDP must leave out.
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    torch::Tensor gain = torch::ones({16});
    block1 = register_module("block1", Block(kFeatures, 16, gain));
    block2 = register_module("block2", Block(16, 16, gain));
    fc2 = register_module("fc2", torch::nn::Linear(16, kClasses));
    frozen = register_parameter("frozen", torch::ones({kClasses}), /*requires_grad=*/false);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return fc2->forward(block2->forward(block1->forward(x))) + frozen;
  }
  Block block1{nullptr}, block2{nullptr};
  torch::nn::Linear fc2{nullptr};
  torch::Tensor frozen;
};
TORCH_MODULE(Net);

torch::nn::Sequential MakeSequential() {
  return torch::nn::Sequential(torch::nn::Linear(kFeatures, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, kClasses));
}

struct Flags {
  std::string mode = "ddp", schedule = "1f1b", out;
  // --die RANK:STEP: that rank's first worker SIGKILLs itself before the forward pass of step
  // STEP (in-place recovery; a replacement, LAUNCH_RECOVER_GENERATION > 0, does not).
  int die_rank = -1;
  int64_t die_step = 0;
  int zero_stage = 1;  // --mode zero
  int accum = 1, local_sgd = 0, steps = 12, world = 1;
  bool sync_each_batch = false, skew_init = false, reference = false;
  // Misuse the API as a ported loop might: a loader batch other than options.batch_size, and a
  // forward of its own followed by Backward(loss) instead of ForwardBackward.
  int64_t loader_batch = kBatch;
  bool own_backward = false;
};

// The trained parameters, each tensor once: Module::parameters() lists a tied tensor once per
// module that registered it, and an optimizer given it twice would step it twice.
std::vector<torch::Tensor> Trainable(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters())
    if (p.requires_grad() &&
        std::none_of(out.begin(), out.end(), [&](const torch::Tensor& q) { return q.is_same(p); }))
      out.push_back(p);
  return out;
}

// Plain LibTorch, one process: what W ranks of the mode must compute together.
int Reference(const Flags& f) {
  Blobs data;
  const int64_t w = f.world;
  std::vector<int64_t> perm = launch::trainer::ShardedSampler::Permutation(kSamples, kSeed, 0);
  auto rows = [&](int64_t micro, int64_t rank, int64_t ranks) {  // rank's rows of a micro-batch
    std::vector<int64_t> r;
    for (int64_t i = 0; i < kBatch; ++i) r.push_back(perm[(micro * kBatch + i) * ranks + rank]);
    return torch::tensor(r, torch::kLong);
  };
  const bool pipeline = f.mode == "pipeline";
  const int64_t replicas = f.local_sgd > 0 ? w : 1;
  std::vector<torch::nn::Sequential> seqs;
  std::vector<Net> nets;
  std::vector<std::unique_ptr<torch::optim::SGD>> opts;
  for (int64_t r = 0; r < replicas; ++r) {
    torch::manual_seed(kSeed);
    std::vector<torch::Tensor> params;
    if (pipeline) {
      seqs.push_back(MakeSequential());
      params = Trainable(*seqs.back());
    } else {
      nets.push_back(Net());
      params = Trainable(*nets.back());
    }
    opts.push_back(
        std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9)));
  }
  const int64_t data_world = pipeline ? w / 2 : (f.mode == "dp" ? 1 : w);
  int64_t micro = 0;
  for (int step = 0; step < f.steps; ++step) {
    for (int64_t r = 0; r < replicas; ++r) {
      for (int a = 0; a < f.accum; ++a) {
        // DDP / dp / pipeline: one replica sees the union of every rank's micro-batch.
        torch::Tensor idx = replicas > 1 ? rows(micro + a, r, w) : torch::Tensor();
        if (replicas == 1) {
          std::vector<torch::Tensor> parts;
          for (int64_t k = 0; k < data_world; ++k) parts.push_back(rows(micro + a, k, data_world));
          idx = torch::stack(parts, 1).reshape({-1});
        }
        auto x = data.x_.index_select(0, idx), y = data.y_.index_select(0, idx);
        auto logits = pipeline ? seqs[r]->forward(x) : nets[r]->forward(x);
        (torch::nn::functional::cross_entropy(logits, y) / f.accum).backward();
      }
      opts[r]->step();
      opts[r]->zero_grad();
    }
    micro += f.accum;
    if (replicas > 1 && ((step + 1) % f.local_sgd == 0 || step + 1 == f.steps)) {
      torch::NoGradGuard no_grad;
      auto p0 = Trainable(*nets[0]);
      for (size_t i = 0; i < p0.size(); ++i) {
        torch::Tensor sum = torch::zeros_like(p0[i]);
        for (int64_t r = 0; r < replicas; ++r) sum += Trainable(*nets[r])[i];
        for (int64_t r = 0; r < replicas; ++r) Trainable(*nets[r])[i].copy_(sum / replicas);
      }
    }
  }
  WriteFloats(f.out, pipeline ? Trainable(*seqs[0]) : Trainable(*nets[0]));
  return 0;
}

int Distributed(const Flags& f) {
  launch::config::TrainConfig options;
  options.seed = kSeed;
  options.gradient_accumulation_steps = f.accum;
  options.sync_each_batch = f.sync_each_batch;
  options.local_sgd_steps = f.local_sgd;
  using Mode = launch::config::ParallelMode;
  options.parallel.mode = f.mode == "none"       ? Mode::kNone
                          : f.mode == "dp"       ? Mode::kDp
                          : f.mode == "pipeline" ? Mode::kPipeline
                          : f.mode == "zero"     ? Mode::kZero
                                                 : Mode::kDdp;
  options.parallel.zero_stage = f.zero_stage;
  options.parallel.bucket_cap_mb = f.mode == "zero" ? 0.0005 : options.parallel.bucket_cap_mb;
  options.parallel.replicas = 2;
  options.parallel.stages = f.mode == "pipeline" ? 2 : 1;  // stages > 1: every replica a pipeline
  options.parallel.microbatches = 4;
  options.parallel.schedule = f.schedule == "gpipe" ? launch::config::PipelineSchedule::kGPipe
                                                    : launch::config::PipelineSchedule::k1F1B;
  options.batch_size = kBatch;
  auto created = Accelerator::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "api_check: %s\n", created.status().message().c_str());
    return 2;
  }
  Accelerator& accel = **created;
  std::vector<torch::Tensor> params;
  auto loss_fn = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  launch::Status prepared = launch::Status::Ok();
  Net net{nullptr};
  if (f.mode == "pipeline") {
    // Pipeline replicas may start from different weights: PreparePipeline broadcasts replica 0's.
    torch::manual_seed(kSeed + (f.skew_init ? accel.data_parallel_rank() : 0));
    auto stage = launch::trainer::SequentialStage(MakeSequential(), {2, 3}, accel.stage_index());
    if (!stage.ok()) return 2;
    params = Trainable(*stage->ptr());
    auto opt =
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    prepared = accel.PreparePipeline(*stage, opt);
  } else {
    // Ranks may start from different weights: Prepare broadcasts rank 0's.
    torch::manual_seed(kSeed + (f.skew_init ? accel.rank() : 0));
    net = Net();
    params = Trainable(*net);
    auto opt =
        std::make_shared<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
    prepared = accel.Prepare(net.ptr(), opt);
  }
  if (!prepared.ok()) {
    std::fprintf(stderr, "api_check: %s\n", prepared.message().c_str());
    return 2;
  }
  auto loader = accel.PrepareDataLoader(Blobs(), f.loader_batch);
  int64_t allreduces = 0;
  accel.TakeCommStats();
  try {
    while (accel.step() < f.steps) {
      auto batch = loader.Next();
      accel.Accumulate();
      if (accel.rank() == f.die_rank && accel.step() + 1 == f.die_step &&
          accel.env().recover_generation == 0)
        std::raise(SIGKILL);
      if (f.mode == "pipeline") {
        accel.PipelineForwardBackward(batch, loss_fn);
      } else if (f.own_backward) {
        accel.Backward(loss_fn(net->forward(batch.data), batch.target));
      } else {
        accel.ForwardBackwardAs<NetImpl>(batch, [&](NetImpl& m, const torch::data::Example<>& b) {
          return loss_fn(m.forward(b.data), b.target);
        });
      }
      accel.Step();
      allreduces += accel.TakeCommStats().allreduces;
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "api_check: %s\n", e.what_without_backtrace());
    return 1;
  }
  if (!accel.Finish().ok()) return 1;
  WriteFloats(f.out + "." + std::to_string(accel.rank()), params);
  accel.Print("allreduces_per_step=" + std::to_string(static_cast<double>(allreduces) / f.steps));
  accel.Barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  std::string die;
  CLI::App app{"api_check: a user's program on the public trainer API (tests/api/test_api.py)",
               "api_check"};
  launch::trainer::check::UseLastValue(app);
  app.add_option("--mode", f.mode, "ddp|zero|local_sgd|dp|pipeline|none");
  app.add_option("--schedule", f.schedule, "gpipe|1f1b (--mode pipeline)");
  app.add_option("--out", f.out, "the final parameters, raw float32 (rank R appends .R)");
  app.add_option("--accum", f.accum, "gradient accumulation steps");
  app.add_option("--zero_stage", f.zero_stage, "1|2|3 (--mode zero)");
  app.add_option("--local_sgd", f.local_sgd, "steps between averages (--mode local_sgd)");
  app.add_option("--steps", f.steps, "optimizer steps");
  app.add_option("--world", f.world, "ranks to emulate (--reference)");
  app.add_flag("--sync_each_batch", f.sync_each_batch, "synchronise every micro-batch");
  app.add_option("--die", die, "RANK:STEP: that rank SIGKILLs itself before step STEP");
  app.add_flag("--skew_init", f.skew_init, "every rank starts from different parameters");
  app.add_option("--loader_batch", f.loader_batch, "the loader's batch size");
  app.add_flag("--own_backward", f.own_backward, "a forward of its own, then Backward(loss)");
  app.add_flag("--reference", f.reference, "plain LibTorch in one process");
  if (int code = launch::trainer::check::ParseFlags(app, argc, argv); code >= 0) return code;
  if (!die.empty()) {
    f.die_rank = std::stoi(die.substr(0, die.find(':')));
    f.die_step = std::stoll(die.substr(die.find(':') + 1));
  }
  return f.reference ? Reference(f) : Distributed(f);
}
