// `train CONFIG.yaml [--output_dir D] [--max_steps N] [--dump_params]`: the worker binary that
// `launch` (or torchrun, srun, mpirun) starts once per rank. Exit status: 0 done, 2 bad
// configuration (nothing trained), 143 stopped by SIGTERM/SIGINT after checkpointing, 1 anything
// else.

#include <cstdio>
#include <cstdlib>
#include <string>

#include "base/strings.h"
#include "config/loader.h"
#include "trainer_runtime/train/self_test.h"
#include "trainer_runtime/train/trainer.h"

namespace {

constexpr const char* kUsage =
    "usage: train CONFIG.yaml [--output_dir DIR] [--max_steps N] [--dump_params]\n"
    "       train --self_test   (the distributed self-check behind `launch test`)\n"
    "Runs the `train:` section of CONFIG.yaml on this rank (RANK, WORLD_SIZE, MASTER_ADDR,\n"
    "MASTER_PORT from the environment; start it with `launch CONFIG.yaml`).\n";

int Fail(const launch::Status& status) {
  std::fprintf(stderr, "train: error: %s\n", status.message().c_str());
  using Code = launch::Status::Code;
  const Code c = status.code();
  if (c == Code::kInterrupted) return 128 + 15;  // stopped on request (SIGTERM/SIGINT)
  return (c == Code::kInvalidConfig || c == Code::kInvalidArgument || c == Code::kNotFound) ? 2 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path;
  launch::trainer::TrainerOptions options;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    auto value = [&](const std::string& flag) -> const char* {
      if (i + 1 >= argc) return nullptr;
      (void)flag;
      return argv[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    } else if (arg == "--output_dir" || arg == "--output-dir") {
      const char* v = value(arg);
      if (!v) return Fail(launch::Status::InvalidArgument(arg + " needs a value"));
      options.output_dir = v;
    } else if (launch::StartsWith(arg, "--output_dir=")) {
      options.output_dir = arg.substr(13);
    } else if (arg == "--max_steps" || arg == "--max-steps") {
      const char* v = value(arg);
      long long n = 0;
      if (!v || !launch::ParseInt64(v, &n) || n < 1)
        return Fail(launch::Status::InvalidArgument(arg + " needs a positive integer"));
      options.max_steps = n;
    } else if (arg == "--self_test" || arg == "--self-test") {
      launch::Status s = launch::trainer::RunSelfTest({});
      return s.ok() ? 0 : Fail(s);
    } else if (arg == "--dump_params") {
      options.dump_params = true;
    } else if (launch::StartsWith(arg, "-")) {
      return Fail(launch::Status::InvalidArgument("unknown flag '" + arg + "'\n" + kUsage));
    } else if (config_path.empty()) {
      config_path = arg;
    } else {
      return Fail(launch::Status::InvalidArgument("unexpected argument '" + arg + "'"));
    }
  }
  if (config_path.empty()) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  if (const char* t = std::getenv("LAUNCH_INIT_TIMEOUT_S")) {
    double v = 0;
    if (!launch::ParseDouble(t, &v) || v <= 0)
      return Fail(launch::Status::InvalidConfig(
          "environment LAUNCH_INIT_TIMEOUT_S: expected seconds > 0, got '" + std::string(t) + "'"));
    options.init_timeout_s = v;
  }
  launch::StatusOr<launch::config::TrainConfig> train =
      launch::config::LoadTrainConfigFile(config_path);
  if (!train.ok()) return Fail(train.status());
  launch::Status status = launch::trainer::RunTrainer(*train, options);
  if (!status.ok()) return Fail(status);
  return 0;
}
