// A user-style program for the hang-forensics tests (test_hang_forensics.py): every rank
// all-reduces a small tensor through the library (Accelerator::AllReduceSum) in a loop, and
// prints "step K" after every --print_every'th (1).
//
//   collective-hang [--steps N] [--skip_at K] [--print_every P]
//
// --steps N: that many steps, then exit 0 (0: forever, until a signal). --skip_at K: at step K,
// rank 1 skips the all-reduce and enters a barrier instead (a desync: rank 0 waits in the
// all-reduce, rank 1 in the barrier, at the same sequence number).

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "trainer_runtime/api/accelerator.h"

int main(int argc, char** argv) {
  long steps = 0, skip_at = -1, print_every = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--steps") {
      steps = std::atol(argv[i + 1]);
    } else if (flag == "--skip_at") {
      skip_at = std::atol(argv[i + 1]);
    } else if (flag == "--print_every") {
      print_every = std::max(1L, std::atol(argv[i + 1]));
    } else {
      std::fprintf(stderr, "collective-hang: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  launch::config::TrainConfig options;
  auto created = launch::trainer::Accelerator::Create(options);
  if (!created.ok()) {
    std::fprintf(stderr, "collective-hang: %s\n", created.status().message().c_str());
    return 2;
  }
  launch::trainer::Accelerator& accel = **created;
  for (long step = 1; steps == 0 || step <= steps; ++step) {
    if (step == skip_at && accel.rank() == 1) {
      accel.Barrier();
    } else {
      torch::Tensor t = torch::ones({16});
      accel.AllReduceSum(t);
    }
    if (step % print_every == 0) {
      std::printf("step %ld\n", step);
      std::fflush(stdout);
    }
  }
  return 0;
}
