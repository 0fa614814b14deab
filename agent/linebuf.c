// Preloaded (LD_PRELOAD) into a worker that is not run under Python, so that its stdout, a pipe
// to the agent, is line-buffered as on a terminal: stdio would otherwise hold up to 4 KiB and
// a C++ loop's progress would arrive in blocks, or only at exit. The mechanism is coreutils'
// stdbuf (libstdbuf.so with _STDBUF_O=L); launch ships its own so that it needs no path that
// differs between distributions, and the launcher sets it only when this file exists.
//
// The constructor runs after libc's and before the program's own: no output can have been
// buffered yet. stderr is unbuffered already. A statically linked or setuid program ignores
// LD_PRELOAD and keeps its buffering (`line_buffered: false` turns this off for every worker).

#include <stdio.h>

__attribute__((constructor)) static void LaunchLineBufferStdout(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
}
