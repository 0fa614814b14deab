// `launch`: the library plus main().
#include <cstdio>
#include <new>

#include "base/exit_code.h"
#include "launcher/launcher.h"

int main(int argc, char** argv) {
  // Every size is bounded where it is parsed; should memory still run out, the user gets a
  // sentence and an exit code instead of std::terminate's abort (the workers, if any, are
  // stopped by the unwinding agent and their shims' parent-death signal).
  try {
    return launch::launcher::Main(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fputs("launch: error: out of memory\n", stderr);
    return launch::kExitFailure;
  }
}
