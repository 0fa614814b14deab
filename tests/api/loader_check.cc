// A user's program with several loaders and the evaluation collectives (accelerator.h,
// data_loader.h), for tests/api/test_loaders.py. Each --case is one behaviour; the program
// prints "key=value" lines (rank 0, or every rank with the rank in the key) that the test reads.
//
//   loader_check --case windows [--eval_with prepare|eval]  accumulation 4, an evaluation
//       loader prepared and consumed mid-run; prints each step's micro-batches and epoch
//   loader_check --case save --ckpt DIR    trains 5 steps, evaluates, saves; prints the position
//   loader_check --case resume --ckpt DIR  resumes, prints the position, evaluates a full pass
//       (--val_first: a validation loader prepared before the training loader, in both)
//   loader_check --case gather --out FILE  GatherForMetrics over a 101-sample evaluation set:
//       writes the gathered rows (float32) to FILE.R on every rank R
//   loader_check --case collectives        GatherList, PadAcrossProcesses, Broadcast,
//       BroadcastObject, SplitBetweenProcesses: prints what each rank got
//   loader_check --case unsynced           ddp with loss.backward() in place of Backward
//   loader_check --case ported             cpp/mnist's loop kept whole (backward(), step())
//   loader_check --case disagree           ddp, then rank 1 changes a weight before Finish
//   loader_check --case lines --wait FILE  prints a line, then waits for FILE (stdout a pipe)
//   loader_check --case workers            a loader with workers(3) against one without
//   loader_check --case zero_grad --zero_grad keep|zero|none [--mode ddp|zero1|zero2|zero3|
//       local_sgd] --out FILE  cpp/mnist's loop
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "tests/api/check_util.h"
#include "trainer_runtime/api/accelerator.h"

namespace {

using launch::trainer::Accelerator;
using launch::trainer::check::WriteFloats;

constexpr int64_t kFeatures = 4, kClasses = 3, kBatch = 4;

// The user's data: `n` samples whose features encode their index (row i is i, i+0.5, ...).
class Indexed : public torch::data::datasets::Dataset<Indexed> {
 public:
  explicit Indexed(int64_t n) : n_(n) {
    x_ = torch::arange(n, torch::kFloat).unsqueeze(1) + torch::arange(kFeatures) * 0.5;
    y_ = torch::arange(n, torch::kLong) % kClasses;
  }
  torch::data::Example<> get(size_t i) override { return {x_[i], y_[i]}; }
  c10::optional<size_t> size() const override { return static_cast<size_t>(n_); }

 private:
  int64_t n_;
  torch::Tensor x_, y_;
};

struct NetImpl : torch::nn::Module {
  NetImpl() { fc = register_module("fc", torch::nn::Linear(kFeatures, kClasses)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc->forward(x * 0.01); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

struct Flags {
  std::string test_case, ckpt, out, wait, eval_with = "prepare", zero_grad = "keep";
  bool val_first = false;
};

// --mode (zero_grad case): ddp (the default), zero1, zero2, zero3, local_sgd.
std::string g_mode = "ddp";

std::unique_ptr<Accelerator> Make(int accum) {
  launch::config::TrainConfig options;
  options.seed = 3;
  options.gradient_accumulation_steps = accum;
  options.parallel.mode = launch::config::ParallelMode::kDdp;
  if (g_mode.rfind("zero", 0) == 0) {
    options.parallel.mode = launch::config::ParallelMode::kZero;
    options.parallel.zero_stage = g_mode.back() - '0';
  } else if (g_mode == "local_sgd") {
    options.local_sgd_steps = 3;
  }
  options.batch_size = kBatch;
  auto created = Accelerator::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "loader_check: %s\n", created.status().message().c_str());
    std::exit(2);
  }
  return std::move(*created);
}

void Require(const launch::Status& s) {
  if (s.ok()) return;
  std::fprintf(stderr, "loader_check: %s\n", s.message().c_str());
  std::exit(3);
}

// A training step on the training loader's next batch.
void TrainStep(Accelerator& accel, Net& net, launch::trainer::DistributedDataLoader<Indexed>& l) {
  torch::data::Example<> batch = l.Next();
  accel.Accumulate();
  accel.Backward(torch::nn::functional::cross_entropy(net(batch.data), batch.target));
  accel.Step();
}

// Samples one evaluation pass covers over all ranks: through a second PrepareDataLoader (as
// one would with accelerate's prepare) or PrepareEvalLoader.
int64_t Evaluate(Accelerator& accel, Net& net, const std::string& with) {
  torch::NoGradGuard no_grad;
  auto n = torch::zeros({1}, torch::kDouble);
  if (with == "eval") {
    auto eval = accel.PrepareEvalLoader(Indexed(48), kBatch);
    for (auto& batch : eval) n += accel.GatherForMetrics(net(batch.data)).size(0) / 1.0;
    return static_cast<int64_t>(n.item<double>());
  }
  auto eval = accel.PrepareDataLoader(Indexed(48), kBatch);
  for (auto& batch : eval.Epoch(0)) n += static_cast<double>(net(batch.data).size(0));
  accel.AllReduceSum(n);
  return static_cast<int64_t>(n.item<double>());
}

int Windows(const Flags& f) {
  auto accel = Make(4);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Require(accel->Prepare(net, opt));  // held by value, as LibTorch programs hold them
  auto train = accel->PrepareDataLoader(Indexed(512), kBatch);  // 64 batches per rank
  while (accel->step() < 2) TrainStep(*accel, net, train);
  accel->Print("evaluated=" + std::to_string(Evaluate(*accel, net, f.eval_with)));
  while (accel->step() < 10) {
    const int64_t before = accel->step();
    TrainStep(*accel, net, train);
    if (accel->step() != before)
      accel->Print("step=" + std::to_string(accel->step()) +
                   " micro=" + std::to_string(accel->micro_batches_last_step()) +
                   " epoch=" + std::to_string(accel->epoch()));
  }
  Require(accel->Finish());
  return 0;
}

int Save(const Flags& f) {
  auto accel = Make(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Require(accel->Prepare(net, opt));
  // --val_first: a validation loader prepared before the training loader, and a look at it
  // before training (the review's F3).
  std::optional<launch::trainer::DistributedDataLoader<Indexed>> val;
  if (f.val_first) val.emplace(accel->PrepareDataLoader(Indexed(48), kBatch));
  auto train = accel->PrepareDataLoader(Indexed(256), kBatch);
  if (val) val->Next();
  while (accel->step() < 5) TrainStep(*accel, net, train);
  accel->Print("evaluated=" + std::to_string(Evaluate(*accel, net, f.eval_with)));
  Require(accel->SaveState(f.ckpt));
  accel->Print("saved epoch=" + std::to_string(accel->epoch()) +
               " batch=" + std::to_string(train.cursor().batch) +
               " samples=" + std::to_string(accel->samples_seen()) +
               " training=" + std::to_string(train.is_training_loader()));
  Require(accel->Finish());
  return 0;
}

int Resume(const Flags& f) {
  auto accel = Make(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Require(accel->Prepare(net, opt));
  std::optional<launch::trainer::DistributedDataLoader<Indexed>> val;
  if (f.val_first) val.emplace(accel->PrepareDataLoader(Indexed(48), kBatch));
  auto train = accel->PrepareDataLoader(Indexed(256), kBatch);
  auto loaded = accel->LoadState(f.ckpt);
  Require(loaded.status());
  if (f.val_first) TrainStep(*accel, net, train);  // the loader order cannot be mended here
  accel->Print("resumed step=" + std::to_string(accel->step()) + " epoch=" +
               std::to_string(accel->epoch()) + " batch=" + std::to_string(train.cursor().batch));
  accel->Print("evaluated=" + std::to_string(Evaluate(*accel, net, f.eval_with)));
  accel->Print("after epoch=" + std::to_string(accel->epoch()) +
               " batch=" + std::to_string(train.cursor().batch));
  Require(accel->Finish());
  return 0;
}

int Gather(const Flags& f) {
  auto accel = Make(1);
  auto eval = accel->PrepareEvalLoader(Indexed(101), 8);
  std::vector<torch::Tensor> rows;
  int64_t mine = 0;
  for (auto& batch : eval) {
    mine += batch.data.size(0);
    // A "prediction" per sample and its label, gathered as accelerate's gather_for_metrics.
    rows.push_back(accel->GatherForMetrics(
        torch::stack({batch.data.select(1, 0), batch.target.to(torch::kFloat)}, 1)));
  }
  std::printf("rank%d_samples=%lld batches=%lld\n", accel->rank(), static_cast<long long>(mine),
              static_cast<long long>(eval.num_batches()));
  WriteFloats(f.out + "." + std::to_string(accel->rank()), {torch::cat(rows)});
  return 0;
}

int Collectives(const Flags&) {
  auto accel = Make(1);
  const int r = accel->rank();
  auto show = [r](const std::string& key, const torch::Tensor& t) {
    std::string s;
    torch::Tensor flat = t.to(torch::kDouble).flatten();
    for (int64_t i = 0; i < flat.numel(); ++i)
      s += (i ? "," : "") + std::to_string(static_cast<int64_t>(flat[i].item<double>()));
    std::printf("rank%d_%s=%s shape=%s\n", r, key.c_str(), s.c_str(), c10::str(t.sizes()).c_str());
  };
  // Rank r holds r + 1 rows of [10r + i, -1].
  torch::Tensor mine =
      torch::stack({torch::arange(r + 1) + 10 * r, torch::full({r + 1}, -1, torch::kLong)}, 1);
  torch::Tensor list_all = torch::cat(accel->GatherList(mine));
  show("gather", accel->Gather(mine));
  show("gatherlist", list_all);
  show("pad", accel->PadAcrossProcesses(torch::arange(r + 1), 0, 7));
  show("padfirst", accel->PadAcrossProcesses(torch::arange(r + 1).unsqueeze(0), 1, 7, true));
  torch::Tensor b = torch::full({2}, 100 + r, torch::kLong);
  show("broadcast", accel->Broadcast(b, 1));
  const std::string obj = accel->BroadcastObject(r == 1 ? std::string("from one\0!", 10) : "", 1);
  std::printf("rank%d_object=%zu:%s\n", r, obj.size(), obj.c_str());
  const launch::trainer::IndexRange range = accel->SplitBetweenProcesses(10);
  std::printf("rank%d_split=%lld,%lld\n", r, static_cast<long long>(range.begin),
              static_cast<long long>(range.end));
  return 0;
}

int Unsynced(const Flags&) {
  auto accel = Make(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Require(accel->Prepare(net, opt));
  auto train = accel->PrepareDataLoader(Indexed(256), kBatch);
  for (int i = 0; i < 3; ++i) {
    torch::data::Example<> batch = train.Next();
    accel->Accumulate();
    torch::nn::functional::cross_entropy(net(batch.data), batch.target).backward();  // the bug
    accel->Step();
  }
  Require(accel->Finish());
  return 0;
}

// cpp/mnist with only Create, Prepare and PrepareDataLoader added: loss.backward() and
// optimizer.step() kept. Prints "batch I" before each Next(); the second Next() must stop it.
int Ported(const Flags&) {
  auto accel = Make(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Require(accel->Prepare(net, opt));
  auto train = accel->PrepareDataLoader(Indexed(256), kBatch);
  for (int i = 0; i < 8; ++i) {
    std::printf("batch %d\n", i);
    std::fflush(stdout);
    torch::data::Example<> batch = train.Next();
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net(batch.data), batch.target).backward();
    opt.step();
  }
  Require(accel->Finish());
  return 0;
}

int Disagree(const Flags&) {
  auto accel = Make(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  Require(accel->Prepare(net, opt));
  auto train = accel->PrepareDataLoader(Indexed(256), kBatch);
  for (int i = 0; i < 3; ++i) TrainStep(*accel, net, train);
  if (accel->rank() == 1) {
    torch::NoGradGuard no_grad;
    net->fc->bias[0].add_(1.0);  // a change outside Step on one rank
  }
  launch::Status finished = accel->Finish();
  std::printf("rank%d_finish=%s\n", accel->rank(), finished.ToString().c_str());
  return finished.ok() ? 0 : 4;
}

// cpp/mnist's loop: optimizer.zero_grad() before the backward (--zero_grad zero: LibTorch
// 1.13's, detach_ + zero_; none: set_to_none, LibTorch 2's default; keep: no zero_grad, Step
// zeroes), 12 steps, then the final parameters to FILE.R.
int ZeroGrad(const Flags& f) {
  auto accel = Make(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  Require(accel->Prepare(net, opt));
  auto train = accel->PrepareDataLoader(Indexed(512), kBatch);
  while (accel->step() < 12) {
    torch::data::Example<> batch = train.Next();
    if (f.zero_grad == "zero") {
      opt.zero_grad();
    } else if (f.zero_grad == "none") {
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
    }
    accel->Backward(torch::nn::functional::cross_entropy(net(batch.data), batch.target));
    accel->Step();
  }
  Require(accel->Finish());
  std::vector<torch::Tensor> params = net->parameters();
  WriteFloats(f.out + "." + std::to_string(accel->rank()),
              {torch::cat({params[0].flatten(), params[1].flatten()})});
  return 0;
}

// Threads of this process (/proc/self/task).
int Threads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

// A training loader with workers(3) against one without: the same batches over two and a half
// epochs, a jump with Epoch(e) mid-epoch included; then a loader destroyed mid-epoch with
// batches fetched ahead leaves no thread behind.
int Workers(const Flags&) {
  auto accel = Make(1);
  auto plain = accel->PrepareDataLoader(Indexed(50), 4);  // 12 batches per epoch, 2 left over
  auto ahead = accel->PrepareDataLoader(Indexed(50), 4);
  const int before = Threads();
  ahead.workers(3);
  int64_t same = 0, differ = 0;
  auto compare = [&](const torch::data::Example<>& a, const torch::data::Example<>& b) {
    (torch::equal(a.data, b.data) && torch::equal(a.target, b.target) ? same : differ) += 1;
  };
  for (int i = 0; i < 30; ++i) compare(plain.Next(), ahead.Next());
  // Epoch 4 from its start, while the workers fetched on into epoch 2.
  plain.Epoch(4);
  ahead.Epoch(4);
  for (int i = 0; i < 5; ++i) compare(plain.Next(), ahead.Next());
  const int with_workers = Threads();
  {
    auto dropped = accel->PrepareDataLoader(Indexed(50), 4);
    dropped.workers(2);
    dropped.Next();  // fetching ahead when it goes
  }
  ahead.workers(0);
  std::printf("same=%lld differ=%lld extra_threads=%d left_threads=%d\n",
              static_cast<long long>(same), static_cast<long long>(differ), with_workers - before,
              Threads() - before);
  return 0;
}

int Lines(const Flags& f) {
  auto accel = Make(1);
  std::printf("ready\n");  // no flush: Create made stdout line-buffered
  while (::access(f.wait.c_str(), F_OK) != 0) ::usleep(10000);
  std::printf("done\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  CLI::App app{
      "loader_check: several loaders and the evaluation collectives "
      "(tests/api/test_loaders.py)",
      "loader_check"};
  launch::trainer::check::UseLastValue(app);
  app.add_option(
      "--case", f.test_case,
      "windows|save|resume|gather|collectives|unsynced|ported|disagree|lines|zero_grad|workers");
  app.add_option("--ckpt", f.ckpt, "the checkpoint directory (save, resume)");
  app.add_option("--out", f.out, "the output file (gather, zero_grad)");
  app.add_option("--wait", f.wait, "the file to wait for (lines)");
  app.add_option("--mode", g_mode, "ddp|zero1|zero2|zero3|local_sgd (zero_grad)");
  app.add_option("--zero_grad", f.zero_grad, "keep|zero|none (zero_grad)");
  app.add_option("--eval_with", f.eval_with, "prepare|eval (windows)");
  app.add_flag("--val_first", f.val_first, "save, resume: a loader prepared before training's");
  if (int code = launch::trainer::check::ParseFlags(app, argc, argv); code >= 0) return code;
  if (f.test_case == "windows") return Windows(f);
  if (f.test_case == "save") return Save(f);
  if (f.test_case == "resume") return Resume(f);
  if (f.test_case == "gather") return Gather(f);
  if (f.test_case == "collectives") return Collectives(f);
  if (f.test_case == "unsynced") return Unsynced(f);
  if (f.test_case == "ported") return Ported(f);
  if (f.test_case == "disagree") return Disagree(f);
  if (f.test_case == "lines") return Lines(f);
  if (f.test_case == "zero_grad") return ZeroGrad(f);
  if (f.test_case == "workers") return Workers(f);
  std::fprintf(stderr, "loader_check: --case: unknown '%s'\n", f.test_case.c_str());
  return 2;
}
