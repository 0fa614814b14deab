// `train`: the worker binary that `launch` (or torchrun, srun, mpirun) starts once per rank. Its
// command line is config/train_cli.h's: `train CONFIG.yaml [--KEY VALUE...]`, or the
// `--effective_config FILE` that launch resolved. Exit status: 0 done, 2 bad configuration
// (nothing trained), 143 stopped by SIGTERM/SIGINT after checkpointing, 1 anything else.

#include <cstdio>
#include <string>
#include <vector>

#include "base/environment.h"
#include "base/exit_code.h"
#include "config/train_cli.h"
#include "trainer_runtime/train/self_test.h"
#include "trainer_runtime/train/trainer.h"

namespace {

// Interrupted (SIGTERM/SIGINT, after checkpointing) is 143, bad configuration 2 (nothing
// trained), the rest 1: base/exit_code.h.
int Fail(const launch::Status& status) {
  std::fprintf(stderr, "train: error: %s\n", status.message().c_str());
  return launch::ExitCodeFor(status);
}

}  // namespace

int main(int argc, char** argv) {
  launch::StatusOr<launch::config::TrainCommandLine> cl =
      launch::config::ParseTrainCommandLine(std::vector<std::string>(argv + 1, argv + argc));
  if (!cl.ok()) return Fail(cl.status());
  if (cl->help) {
    std::fputs(cl->help_text.c_str(), stdout);
    return 0;
  }
  if (cl->version) {
    std::printf("train %s (%s)\n", LAUNCH_VERSION, launch::trainer::BuildDescription().c_str());
    // `launch env` reports this LibTorch: the one the trainer runs on, not a guess.
    const std::string library = launch::trainer::LibTorchLibrary();
    if (!library.empty()) std::printf("LibTorch library: %s\n", library.c_str());
    return 0;
  }
  if (cl->self_test) {
    launch::Status s = launch::trainer::RunSelfTest({});
    return s.ok() ? 0 : Fail(s);
  }
  launch::StatusOr<launch::config::LaunchConfig> cfg =
      launch::config::ResolveTrainConfig(*cl, launch::CurrentEnvironment());
  if (!cfg.ok()) return Fail(cfg.status());
  launch::trainer::TrainerOptions options;
  options.dump_params = cl->dump_params;
  launch::Status status = launch::trainer::RunTrainer(cfg->train, options);
  return status.ok() ? 0 : Fail(status);
}
