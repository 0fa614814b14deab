// Prints a line with plain stdio and never flushes, then waits (at most argv[2] seconds) for
// the file argv[1] to appear before printing its last line: a C worker whose progress reaches
// the console only if its stdout is line-buffered (test_live_output.py).

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 3) return 2;
  printf("ready\n");
  for (int waited = 0; waited < atoi(argv[2]) * 10 && access(argv[1], F_OK) != 0; ++waited)
    usleep(100 * 1000);
  // Whether the go file came in time: it can only if "ready" reached the test before.
  printf("done %s\n", access(argv[1], F_OK) == 0 ? "go" : "timeout");
  return 0;
}
