#include "trainer_runtime/train/self_test.h"

#include <chrono>
#include <cstdio>
#include <sstream>

#include "base/environment.h"
#include "config/train_config.h"
#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/model.h"
#include "trainer_runtime/parallel/strategy.h"
#include "trainer_runtime/parallel/strategy_factory.h"

namespace launch::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point since) {
  return std::chrono::duration<double, std::milli>(Clock::now() - since).count();
}

// One named check; prints its outcome on rank 0 (every rank prints failures).
class Checker {
 public:
  Checker(int rank, int total) : rank_(rank), total_(total) {}
  Status Run(const std::string& name, const std::function<Status()>& check) {
    ++index_;
    auto t0 = Clock::now();
    Status s;
    try {
      s = check();
    } catch (const c10::Error& e) {
      s = Status::Internal(e.what_without_backtrace());
    }
    if (!s.ok()) {
      std::fprintf(stderr, "[self-test] check %d/%d %s: FAILED on rank %d: %s\n", index_, total_,
                   name.c_str(), rank_, s.message().c_str());
      return s.WithContext(name);
    }
    if (rank_ == 0)
      std::printf("[self-test] check %d/%d %-42s ok (%.2f ms)\n", index_, total_, name.c_str(),
                  Ms(t0));
    std::fflush(stdout);
    return Status::Ok();
  }

 private:
  int rank_, total_, index_ = 0;
};

Status Expect(bool ok, const std::string& what) {
  return ok ? Status::Ok() : Status::Internal(what);
}

std::string Num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

// The all-reduce of the 4 MB check, through `pg` (whichever transport it routes to).
Status AllReduce4Mb(c10d::ProcessGroup& pg, int rank, int world) {
  // Large enough to take Gloo's multi-chunk path (and several shared-memory chunks); every
  // element must sum exactly.
  auto idx = torch::arange(1 << 20, torch::kFloat32);
  std::vector<at::Tensor> t = {idx * static_cast<float>(rank + 1)};
  pg.allreduce(t, c10d::AllreduceOptions())->wait();
  auto expected = idx * static_cast<float>(world * (world + 1) / 2);
  double err = (t[0] - expected).abs().max().item<double>();
  return Expect(err == 0.0, "max error " + Num(err));
}

Status BroadcastFromRank0(c10d::ProcessGroup& pg, int rank) {
  torch::manual_seed(1234);
  auto reference = torch::randn({4096});
  std::vector<at::Tensor> t = {rank == 0 ? reference.clone() : torch::zeros({4096})};
  pg.broadcast(t, c10d::BroadcastOptions())->wait();
  return Expect(torch::equal(t[0], reference),
                "rank " + std::to_string(rank) + " received different values");
}

// The short name of the transport `pg` routes all-reduces and broadcasts from rank 0 to.
std::string Transport(const CountingProcessGroup& pg) {
  if (pg.shm()) return "shared memory";
  if (pg.hierarchical()) return "hierarchical";
  return "Gloo";
}

}  // namespace

Status RunSelfTest(const SelfTestOptions& options) {
  LAUNCH_ASSIGN_OR_RETURN(DistEnv env, ParseDistEnv(CurrentEnvironment()));
  const int rank = env.rank, world = env.world_size;
  Checker checker(rank, 9);
  c10::intrusive_ptr<CountingProcessGroup> pg;

  LAUNCH_RETURN_IF_ERROR(checker.Run("process group", [&]() -> Status {
    if (world < 2)
      return Status::InvalidConfig("needs at least 2 processes (WORLD_SIZE is " +
                                   std::to_string(world) + ")");
    auto timeout = std::chrono::milliseconds(static_cast<int64_t>(options.init_timeout_s * 1000));
    LAUNCH_ASSIGN_OR_RETURN(pg, CreateProcessGroup(env, timeout));
    return Status::Ok();
  }));
  // Each check names the transport it ran on: the job's own routing (shared memory on one
  // host), and Gloo itself, which the job uses across hosts and for everything else.
  const std::string routed = " (" + Transport(*pg) + ")";
  if (rank == 0) {
    std::printf("[self-test] all-reduces and broadcasts go through %s\n",
                pg->allreduce_transport().c_str());
    std::fflush(stdout);
  }

  LAUNCH_RETURN_IF_ERROR(checker.Run("all-reduce, sum of ranks" + routed, [&]() -> Status {
    std::vector<at::Tensor> t = {torch::full({1}, static_cast<double>(rank + 1), torch::kFloat64)};
    pg->allreduce(t, c10d::AllreduceOptions())->wait();
    double expected = world * (world + 1) / 2.0;
    double got = t[0].item<double>();
    return Expect(got == expected, "rank " + std::to_string(rank) + " got " + Num(got) +
                                       ", expected " + Num(expected));
  }));

  LAUNCH_RETURN_IF_ERROR(
      checker.Run("all-reduce, 4 MB" + routed, [&]() { return AllReduce4Mb(*pg, rank, world); }));
  LAUNCH_RETURN_IF_ERROR(checker.Run("all-reduce, 4 MB (Gloo)",
                                     [&]() { return AllReduce4Mb(pg->inner(), rank, world); }));
  LAUNCH_RETURN_IF_ERROR(checker.Run("broadcast from rank 0" + routed,
                                     [&]() { return BroadcastFromRank0(*pg, rank); }));
  LAUNCH_RETURN_IF_ERROR(checker.Run("broadcast from rank 0 (Gloo)",
                                     [&]() { return BroadcastFromRank0(pg->inner(), rank); }));

  LAUNCH_RETURN_IF_ERROR(checker.Run("all-gather of ranks (Gloo)", [&]() -> Status {
    std::vector<at::Tensor> in = {torch::full({1}, static_cast<float>(rank))};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world; ++r) out[0].push_back(torch::zeros({1}));
    pg->allgather(out, in, c10d::AllgatherOptions())->wait();
    for (int r = 0; r < world; ++r)
      if (out[0][r].item<float>() != static_cast<float>(r))
        return Status::Internal("slot " + std::to_string(r) + " holds " +
                                Num(out[0][r].item<float>()));
    return Status::Ok();
  }));

  LAUNCH_RETURN_IF_ERROR(checker.Run("barrier (Gloo)", [&]() -> Status {
    pg->barrier(c10d::BarrierOptions())->wait();
    return Status::Ok();
  }));

  LAUNCH_RETURN_IF_ERROR(checker.Run("DDP step == one process" + routed, [&]() -> Status {
    // Every rank builds the same model and the same global batch; DDP trains on this rank's
    // shard, the reference on the whole batch, in this same process.
    config::TrainConfig cfg;
    cfg.model.mlp_layers = {16, 32, 4};
    cfg.parallel.mode = config::ParallelMode::kDdp;
    const int64_t per_rank = 8;
    torch::manual_seed(7);
    LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Model> ddp_model, CreateModel(cfg.model));
    torch::manual_seed(7);
    LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<Model> ref_model, CreateModel(cfg.model));
    torch::manual_seed(99);
    auto x = torch::randn({per_rank * world, 16});
    auto y = torch::randint(0, 4, {per_rank * world});
    LAUNCH_ASSIGN_OR_RETURN(std::unique_ptr<ParallelStrategy> ddp,
                            CreateStrategy(cfg, ddp_model.get(), nullptr, pg, env.tuning));
    ddp->Setup();
    const double lr = 0.1;
    auto shard_x = x.narrow(0, rank * per_rank, per_rank);
    auto shard_y = y.narrow(0, rank * per_rank, per_rank);
    ddp->BeforeForward(true);
    auto loss = torch::nn::functional::cross_entropy(ddp_model->Forward(shard_x), shard_y);
    ddp->BeforeBackward(loss, true);
    loss.backward();
    ddp->AfterBackward(true);
    auto ref_loss = torch::nn::functional::cross_entropy(ref_model->Forward(x), y);
    ref_loss.backward();
    torch::NoGradGuard no_grad;
    auto ddp_params = ddp_model->Parameters();
    auto ref_params = ref_model->Parameters();
    double worst = 0;
    for (size_t i = 0; i < ddp_params.size(); ++i) {
      ddp_params[i].sub_(ddp_params[i].grad() * lr);
      ref_params[i].sub_(ref_params[i].grad() * lr);
      double scale = ref_params[i].abs().max().item<double>() + 1e-12;
      worst = std::max(worst, (ddp_params[i] - ref_params[i]).abs().max().item<double>() / scale);
    }
    ddp->Finish(1);
    return Expect(worst < 1e-5, "parameters differ from the single-process step by " + Num(worst) +
                                    " (relative; tolerance 1e-5)");
  }));
  if (rank == 0) {
    std::printf("[self-test] all checks passed on %d processes\n", world);
    std::fflush(stdout);
  }
  return Status::Ok();
}

}  // namespace launch::trainer
