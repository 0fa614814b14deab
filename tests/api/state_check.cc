// A user's program on the public API (accelerator.h, sync_batchnorm.h) for tests/api/test_state.py:
// the state the Accelerator keeps right besides the gradients.
//
//   state_check --case lr_lambda --out FILE
//       one process; two parameter groups with different base rates under SetLrLambda. Writes
//       the final parameters (raw float32) for a PyTorch LambdaLR reference to compare.
//   state_check --case short_window
//       one process; gradient_accumulation_steps 4 over an epoch of 6 micro-batches: the second
//       window is cut short at 2 by the end of the data. Prints how far the trained parameters
//       are from plain LibTorch dividing that window by N (k/N of its mean gradient, what
//       accelerate does) and by k (its mean gradient).
//   state_check --case sync_bn --mode ddp|dp [--plain_bn] --out FILE
//       a Sequential with a BatchNorm1d converted by ConvertSyncBatchNorm, under
//       train.parallel.sync_batchnorm (--plain_bn: left as BatchNorm, option off); writes the
//       parameters then the running statistics (raw float32; rank R appends .R).
//   state_check --case sync_bn --reference --world W --out FILE
//       the same model with plain BatchNorm in one process on the global batch (every rank's
//       rows of each step together): what the synchronised ranks must equal.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "tests/api/check_util.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/model/sync_batchnorm.h"

namespace {

using launch::trainer::Accelerator;
using launch::trainer::check::WriteFloats;

struct Flags {
  std::string which, mode = "ddp", out;
  int world = 1;
  bool reference = false, plain_bn = false;
};

// Rows x features of a fixed formula, so PyTorch can build the same data without a file.
torch::Tensor Inputs(int64_t rows, int64_t features) {
  return torch::sin(torch::arange(rows * features, torch::kFloat) * 0.37).reshape({rows, features});
}
torch::Tensor Targets(int64_t rows, int64_t classes) {
  return torch::arange(rows, torch::kLong).remainder(classes);
}

class Rows : public torch::data::datasets::Dataset<Rows> {
 public:
  Rows(int64_t rows, int64_t features, int64_t classes)
      : x_(Inputs(rows, features)), y_(Targets(rows, classes)) {}
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  c10::optional<size_t> size() const override { return static_cast<size_t>(x_.size(0)); }
  torch::Tensor x_, y_;
};

// Weights of a fixed formula (also in test_state.py): every run and PyTorch start alike.
void InitLinear(torch::nn::Linear& l, double phase) {
  torch::NoGradGuard no_grad;
  l->weight.copy_(torch::cos(torch::arange(l->weight.numel(), torch::kFloat) * 0.5 + phase)
                      .reshape(l->weight.sizes()) *
                  0.4);
  l->bias.copy_(torch::linspace(-0.1, 0.1, l->bias.numel()));
}

launch::config::TrainConfig OneProcessOptions() {
  launch::config::TrainConfig options;
  options.parallel.mode = launch::config::ParallelMode::kNone;
  options.data.shuffle = false;  // file order: the references need no sampler
  return options;
}

// --- lr_lambda -------------------------------------------------------------------------------

int LrLambda(const Flags& f) {
  constexpr int64_t kRows = 40, kBatch = 8;
  auto options = OneProcessOptions();
  options.batch_size = kBatch;
  auto accel = Accelerator::Create(options).value();
  torch::nn::Linear body(5, 4), head(4, 3);
  InitLinear(body, 0.0);
  InitLinear(head, 1.0);
  auto net = std::make_shared<torch::nn::SequentialImpl>(body, torch::nn::Tanh(), head);
  // A slow body (0.02) and a fast head (0.2), as a fine-tuning loop has them.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(body->parameters(), std::make_unique<torch::optim::SGDOptions>(0.02));
  groups.emplace_back(head->parameters(), std::make_unique<torch::optim::SGDOptions>(0.2));
  auto opt =
      std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (auto& g : opt->param_groups())
    static_cast<torch::optim::SGDOptions&>(g.options()).momentum(0.9);
  if (auto s = accel->Prepare(net, opt); !s.ok()) {
    std::fprintf(stderr, "state_check: %s\n", s.message().c_str());
    return 2;
  }
  accel->SetLrLambda([](int64_t step) { return 1.0 / (1.0 + 0.5 * static_cast<double>(step)); });
  auto loader = accel->PrepareDataLoader(Rows(kRows, 5, 3), kBatch);
  for (int step = 0; step < 10; ++step) {
    auto batch = loader.Next();
    accel->Accumulate();
    accel->Backward(torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target));
    accel->Step();
  }
  std::printf("lrs %.9g %.9g\n", opt->param_groups()[0].options().get_lr(),
              opt->param_groups()[1].options().get_lr());
  WriteFloats(f.out, {body->weight, body->bias, head->weight, head->bias});
  return 0;
}

// --- short_window ----------------------------------------------------------------------------

int ShortWindow() {
  constexpr int64_t kBatch = 4, kMicro = 6, kAccum = 4;
  auto options = OneProcessOptions();
  options.batch_size = kBatch;
  options.gradient_accumulation_steps = kAccum;
  options.sync_with_dataloader = true;
  auto accel = Accelerator::Create(options).value();
  auto make = [] {
    torch::nn::Linear l(5, 3);
    InitLinear(l, 0.3);
    return l;
  };
  torch::nn::Linear net = make();
  auto opt = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(1.0));
  if (auto s = accel->Prepare(net.ptr(), opt); !s.ok()) return 2;
  Rows data(kBatch * kMicro, 5, 3);
  auto loader = accel->PrepareDataLoader(data, kBatch);
  int steps = 0;
  for (auto& batch : loader.Epoch(0)) {
    accel->Accumulate();
    accel->Backward(torch::nn::functional::cross_entropy(net->forward(batch.data), batch.target));
    if (accel->Step()) ++steps;
  }
  // Plain LibTorch: window 1 is micro-batches 0-3 over N; window 2 is 4-5 over `divisor`.
  auto reference = [&](double divisor) {
    torch::nn::Linear ref = make();
    torch::optim::SGD sgd(ref->parameters(), torch::optim::SGDOptions(1.0));
    using Window = std::tuple<int64_t, int64_t, double>;  // micro-batches [first, last), divisor
    for (auto [first, last, div] :
         {Window{0, 4, static_cast<double>(kAccum)}, Window{4, 6, divisor}}) {
      for (int64_t m = first; m < last; ++m) {
        auto x = data.x_.narrow(0, m * kBatch, kBatch), y = data.y_.narrow(0, m * kBatch, kBatch);
        (torch::nn::functional::cross_entropy(ref->forward(x), y) / div).backward();
      }
      sgd.step();
      sgd.zero_grad();
    }
    return (torch::cat({ref->weight.flatten(), ref->bias}) -
            torch::cat({net->weight.flatten(), net->bias}))
        .abs()
        .max()
        .item<double>();
  };
  std::printf("steps %d\ndiff_k_over_n %.3g\ndiff_mean %.3g\n", steps, reference(kAccum),
              reference(2));
  return 0;
}

// --- sync_bn ---------------------------------------------------------------------------------

constexpr int64_t kBnRows = 8, kBnFeatures = 6, kBnClasses = 3, kBnSteps = 6;

torch::nn::Sequential BnNet() {
  torch::nn::Linear in(kBnFeatures, 8), out(8, kBnClasses);
  InitLinear(in, 0.1);
  InitLinear(out, 0.7);
  return torch::nn::Sequential(in, torch::nn::BatchNorm1d(8), torch::nn::ReLU(), out);
}

std::vector<torch::Tensor> State(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters()) out.push_back(p);
  for (auto& b : m.named_buffers())
    if (b.value().is_floating_point()) out.push_back(b.value());
  return out;
}

// Rows of global step `step`, rank `rank` of `world` (each rank takes consecutive rows).
torch::data::Example<> BnBatch(int64_t step, int64_t rank, int64_t world) {
  const int64_t first = (step * world + rank) * kBnRows;
  const torch::Tensor x = Inputs(kBnSteps * world * kBnRows, kBnFeatures) * 2 + 0.5;
  const torch::Tensor y = Targets(kBnSteps * world * kBnRows, kBnClasses);
  return {x.narrow(0, first, kBnRows), y.narrow(0, first, kBnRows)};
}

int SyncBnReference(const Flags& f) {
  torch::nn::Sequential net = BnNet();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int64_t step = 0; step < kBnSteps; ++step) {
    std::vector<torch::Tensor> xs, ys;
    for (int64_t r = 0; r < f.world; ++r) {
      auto b = BnBatch(step, r, f.world);
      xs.push_back(b.data);
      ys.push_back(b.target);
    }
    torch::nn::functional::cross_entropy(net->forward(torch::cat(xs)), torch::cat(ys)).backward();
    opt.step();
    opt.zero_grad();
  }
  WriteFloats(f.out, State(*net));
  return 0;
}

int SyncBn(const Flags& f) {
  auto options = OneProcessOptions();
  options.parallel.mode =
      f.mode == "dp" ? launch::config::ParallelMode::kDp : launch::config::ParallelMode::kDdp;
  options.parallel.sync_batchnorm = !f.plain_bn;
  options.parallel.replicas = 2;
  options.parallel.dp_seeded_replicas = false;  // forwards together (sync_batchnorm.h)
  options.batch_size = kBnRows;
  auto created = Accelerator::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "state_check: %s\n", created.status().message().c_str());
    return 2;
  }
  Accelerator& accel = **created;
  // PyTorch's order: convert, then hand over (convert_sync_batchnorm before DDP).
  std::shared_ptr<torch::nn::Module> module = BnNet().ptr();
  int converted = 0;
  if (!f.plain_bn) module = launch::trainer::ConvertSyncBatchNorm(module, &converted);
  auto net = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module);
  auto opt = std::make_shared<torch::optim::SGD>(net->parameters(),
                                                 torch::optim::SGDOptions(0.1).momentum(0.9));
  if (auto s = accel.Prepare(net, opt); !s.ok()) {
    std::fprintf(stderr, "state_check: %s\n", s.message().c_str());
    return 2;
  }
  // dp: one process takes the global batch, its replicas split it; ddp: each rank its rows.
  const int64_t world = f.mode == "dp" ? 2 : accel.world_size();
  for (int64_t step = 0; step < kBnSteps; ++step) {
    torch::data::Example<> batch = BnBatch(step, accel.rank(), world);
    if (f.mode == "dp") {
      auto a = BnBatch(step, 0, 2), b = BnBatch(step, 1, 2);
      batch = {torch::cat({a.data, b.data}), torch::cat({a.target, b.target})};
    }
    accel.ForwardBackward(batch, [](torch::nn::Module& m, const torch::data::Example<>& chunk) {
      auto& seq = dynamic_cast<torch::nn::SequentialImpl&>(m);
      return torch::nn::functional::cross_entropy(seq.forward(chunk.data), chunk.target);
    });
    accel.Step();
  }
  if (!accel.Finish().ok()) return 1;
  accel.Print("converted " + std::to_string(converted));
  WriteFloats(f.out + "." + std::to_string(accel.rank()), State(*net));
  accel.Barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "state_check: the state the Accelerator keeps besides the gradients "
      "(tests/api/test_state.py)",
      "state_check"};
  launch::trainer::check::UseLastValue(app);
  app.add_option("--case", f.which, "lr_lambda|short_window|sync_bn");
  app.add_option("--mode", f.mode, "ddp|dp (sync_bn)");
  app.add_option("--out", f.out, "the output file, raw float32 (rank R appends .R)");
  app.add_option("--world", f.world, "ranks to emulate (--reference)");
  app.add_flag("--reference", f.reference, "plain BatchNorm in one process (sync_bn)");
  app.add_flag("--plain_bn", f.plain_bn, "leave the BatchNorm as it is, option off (sync_bn)");
  if (int code = launch::trainer::check::ParseFlags(app, argc, argv); code >= 0) return code;
  if (f.which == "lr_lambda") return LrLambda(f);
  if (f.which == "short_window") return ShortWindow();
  if (f.which == "sync_bn") return f.reference ? SyncBnReference(f) : SyncBn(f);
  std::fprintf(stderr, "state_check: --case lr_lambda|short_window|sync_bn\n");
  return 2;
}
