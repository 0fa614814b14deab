// liblaunch-pystack.so: the Python shim's (sitecustomize.py) answer to the agent's stack-dump
// signal, in the format agent/stall_watch.cc reads (base/collective_ring.h InstallStackDump):
// a "pid N ..." line, the stack, then a line "end" in the file `ring path + ".stack"`, truncated
// each time.
//
// The stack itself is faulthandler's (every Python thread, written without the GIL from the
// signal handler, so it works while the main thread blocks in a collective's C++ wait).
// faulthandler alone cannot do it: it writes to one file descriptor chosen once, which the agent
// unlinks before each request, and it writes no end marker, so the agent could not tell a
// finished dump from one in progress. So the shim first registers faulthandler for the signal on
// a descriptor of /dev/null, then installs this handler over it: it opens the file afresh, points
// faulthandler's descriptor at it (dup3), calls faulthandler's handler, points the descriptor back
// at /dev/null and writes "end". Everything here is async-signal-safe.
//
// Plain C, libc only: loading it costs the worker nothing beyond the dlopen.

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

// The signal the agent sends: base/collective_ring.h StackDumpSignal() (SIGRTMIN + 6). A C file
// cannot include that C++ header; tests/trainer/test_python_forensics.py checks the two agree.
int launch_pystack_signal(void) { return SIGRTMIN + 6; }

static char g_path[PATH_MAX];
static int g_dump_fd = -1;  // faulthandler writes here
static int g_null_fd = -1;  // a copy of the /dev/null it points at between dumps
static void (*g_faulthandler)(int) = 0;
static int g_busy = 0;

static void WriteAll(int fd, const char* text, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, text, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    text += w;
    n -= (size_t)w;
  }
}

static void OnStackDump(int signo) {
  int saved = errno;
  // faulthandler walks every thread's Python frames without the GIL: only safe while the
  // threads that run Python stand still. The signal is sent to the process, and the kernel may
  // hand it to a C++ thread (LibTorch's autograd engine) while the main thread runs Python and
  // changes its frames under the walk (seen: SIGSEGV in PyUnstable_InterpreterFrame_GetLine on
  // Python 3.13). So another thread passes it on to the main thread, which is then interrupted
  // where it stands (holding the GIL if it ran Python, so no other thread runs Python either).
  // If the main thread is gone, this thread dumps.
  const pid_t pid = getpid();
  if ((pid_t)syscall(SYS_gettid) != pid && syscall(SYS_tgkill, pid, pid, signo) == 0) {
    errno = saved;
    return;
  }
  // Two requests at once (a real-time signal queues, and another thread may take the second):
  // the first one's dump answers both.
  if (__atomic_exchange_n(&g_busy, 1, __ATOMIC_ACQUIRE)) {
    errno = saved;
    return;
  }
  int fd = open(g_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd >= 0) {
    char line[64] = "pid ";
    size_t n = 4;
    char digits[24];
    size_t d = 0;
    unsigned long p = (unsigned long)pid;
    do {
      digits[d++] = (char)('0' + p % 10);
      p /= 10;
    } while (p != 0);
    while (d > 0) line[n++] = digits[--d];
    const char tail[] = " python threads (faulthandler, most recent call first):\n";
    WriteAll(fd, line, n);
    WriteAll(fd, tail, sizeof tail - 1);
    // The duplicate shares fd's file offset: faulthandler's lines land after the header, and
    // "end" after them.
    if (dup3(fd, g_dump_fd, O_CLOEXEC) >= 0) {
      g_faulthandler(signo);
      dup3(g_null_fd, g_dump_fd, O_CLOEXEC);
    }
    WriteAll(fd, "end\n", 4);
    close(fd);
  }
  __atomic_store_n(&g_busy, 0, __ATOMIC_RELEASE);
  errno = saved;
}

// Puts OnStackDump over the handler faulthandler.register(launch_pystack_signal(), file=dump_fd)
// installed. 0 on success; -1 (errno set) when the path is too long, the installed handler is
// not a plain one (faulthandler's is), or a system call fails. Call once, from one thread.
int launch_pystack_install(const char* path, int dump_fd) {
  const int signo = launch_pystack_signal();
  size_t len = strlen(path);
  if (len >= sizeof g_path) {
    errno = ENAMETOOLONG;
    return -1;
  }
  struct sigaction current;
  if (sigaction(signo, NULL, &current) != 0) return -1;
  if ((current.sa_flags & SA_SIGINFO) || current.sa_handler == SIG_DFL ||
      current.sa_handler == SIG_IGN || current.sa_handler == OnStackDump) {
    errno = EINVAL;
    return -1;
  }
  int null_fd = fcntl(dump_fd, F_DUPFD_CLOEXEC, 3);
  if (null_fd < 0) return -1;
  memcpy(g_path, path, len + 1);
  g_dump_fd = dump_fd;
  g_null_fd = null_fd;
  g_faulthandler = current.sa_handler;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = OnStackDump;
  // SA_ONSTACK as faulthandler asks for its own handler (it may run on its alternate stack).
  sa.sa_flags = SA_RESTART | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  return sigaction(signo, &sa, NULL);
}
