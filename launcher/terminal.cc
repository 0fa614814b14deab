#include "launcher/terminal.h"

#include <poll.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "base/strings.h"

namespace launch::launcher {
namespace {

// The one process-wide flag: the number of the signal that asked us to stop, or 0. Handlers do
// nothing else; the reading loop polls it, so the terminal is restored on the normal path.
volatile std::sig_atomic_t g_stop_signal = 0;

void OnStopSignal(int signo) { g_stop_signal = signo; }

Status InterruptedBy(int signo) {
  return Status::Interrupted("interrupted by " + SignalName(signo));
}

constexpr char kBold[] = "\x1b[1m";
constexpr char kDim[] = "\x1b[2m";
constexpr char kCyan[] = "\x1b[36m";
constexpr char kRed[] = "\x1b[31m";
constexpr char kReset[] = "\x1b[0m";

}  // namespace

Terminal::Terminal(int in_fd, int out_fd) : in_fd_(in_fd), out_fd_(out_fd) {
  const char* term = std::getenv("TERM");
  fancy_ = !(term && std::strcmp(term, "dumb") == 0) && IsTerminal(out_fd_);
  have_termios_ = tcgetattr(in_fd_, &saved_termios_) == 0;
  g_stop_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: a blocked read or poll returns EINTR
  sigaction(SIGINT, &sa, &saved_int_);
  sigaction(SIGTERM, &sa, &saved_term_);
  sigaction(SIGHUP, &sa, &saved_hup_);
}

Terminal::~Terminal() {
  Restore();
  sigaction(SIGINT, &saved_int_, nullptr);
  sigaction(SIGTERM, &saved_term_, nullptr);
  sigaction(SIGHUP, &saved_hup_, nullptr);
}

bool Terminal::IsTerminal(int fd) { return isatty(fd) == 1; }

int Terminal::Columns() const {
  struct winsize ws {};
  if (ioctl(out_fd_, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return 80;
}

Status Terminal::EnterRawMode() {
  if (!have_termios_) return Status::Ok();
  struct termios raw = saved_termios_;
  raw.c_lflag &= ~(ICANON | ECHO | IEXTEN);  // ISIG stays: Ctrl-C still raises SIGINT
  raw.c_iflag &= ~(IXON);
  raw.c_cc[VMIN] = 1;
  raw.c_cc[VTIME] = 0;
  if (tcsetattr(in_fd_, TCSAFLUSH, &raw) != 0)
    return Status::FromErrno("cannot switch the terminal to raw mode", errno);
  raw_ = true;
  return Status::Ok();
}

void Terminal::Restore() {
  if (raw_ && have_termios_) tcsetattr(in_fd_, TCSAFLUSH, &saved_termios_);
  raw_ = false;
}

Status Terminal::ReadByte(int timeout_ms, unsigned char* byte, bool* got) {
  *got = false;
  // Poll in short slices so a signal that arrives between the flag check and the wait is seen
  // within 100 ms even where EINTR does not reach us.
  int waited = 0;
  while (true) {
    if (g_stop_signal) return InterruptedBy(g_stop_signal);
    int slice = timeout_ms < 0 ? 100 : std::min(100, timeout_ms - waited);
    if (timeout_ms >= 0 && slice <= 0) return Status::Ok();
    struct pollfd pfd {
      in_fd_, POLLIN, 0
    };
    int r = poll(&pfd, 1, slice);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno("poll on the terminal", errno);
    }
    if (r == 0) {
      waited += slice;
      continue;
    }
    ssize_t n = read(in_fd_, byte, 1);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Status::FromErrno("reading the terminal", errno);
    }
    if (n == 0) {
      *byte = 0x04;  // end of input reads as Ctrl-D
    }
    *got = true;
    return Status::Ok();
  }
}

StatusOr<Terminal::Key> Terminal::ReadKey() {
  unsigned char c = 0;
  bool got = false;
  LAUNCH_RETURN_IF_ERROR(ReadByte(-1, &c, &got));
  Key key;
  switch (c) {
    case '\r':
    case '\n':
      key.kind = KeyKind::kEnter;
      return key;
    case 0x7f:
    case 0x08:
      key.kind = KeyKind::kBackspace;
      return key;
    case 0x15:
      key.kind = KeyKind::kKillLine;
      return key;
    case 0x03:
      key.kind = KeyKind::kInterrupt;
      return key;
    case 0x04:
      key.kind = KeyKind::kEof;
      return key;
    case 0x1b:
      break;
    default:
      key.kind = KeyKind::kChar;
      key.ch = static_cast<char>(c);
      return key;
  }
  // ESC: an arrow key is ESC [ A (or ESC O A in application mode); a lone ESC is followed by
  // nothing within a few milliseconds.
  key.kind = KeyKind::kEscape;
  unsigned char next = 0;
  LAUNCH_RETURN_IF_ERROR(ReadByte(50, &next, &got));
  if (!got || (next != '[' && next != 'O')) return key;
  unsigned char final_byte = 0;
  do {  // skip parameters such as "1;5" up to the final byte
    LAUNCH_RETURN_IF_ERROR(ReadByte(50, &final_byte, &got));
    if (!got) return key;
  } while ((final_byte >= '0' && final_byte <= '9') || final_byte == ';');
  switch (final_byte) {
    case 'A':
      key.kind = KeyKind::kUp;
      break;
    case 'B':
      key.kind = KeyKind::kDown;
      break;
    case 'C':
      key.kind = KeyKind::kRight;
      break;
    case 'D':
      key.kind = KeyKind::kLeft;
      break;
    default:
      break;
  }
  return key;
}

void Terminal::Write(const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = write(out_fd_, text.data() + done, text.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    done += static_cast<size_t>(n);
  }
}

// ---------------------------------------------------------------------------------------------

void Prompter::Say(const std::string& text) { term_->Write(text + "\n"); }

void Prompter::Warn(const std::string& text) {
  term_->Write(term_->fancy() ? std::string("  ") + kRed + "! " + text + kReset + "\n"
                              : "  ! " + text + "\n");
}

StatusOr<int> Prompter::Choose(const std::string& question, const std::vector<std::string>& options,
                               int default_index) {
  LAUNCH_CHECK(
      !options.empty() && default_index >= 0 && default_index < static_cast<int>(options.size()),
      "bad menu for '" + question + "'");
  const bool fancy = term_->fancy();
  const int n = static_cast<int>(options.size());
  // Redrawing moves the cursor up one row per line: no line may wrap.
  const size_t width = static_cast<size_t>(std::max(20, term_->Columns() - 1));
  int current = default_index;
  auto render = [&]() {
    std::string out;
    for (int i = 0; i < n; ++i) {
      bool on = i == current;
      std::string line = std::string(on ? "  > " : "    ") + std::to_string(i + 1) + ") " +
                         options[static_cast<size_t>(i)];
      if (line.size() > width) line = line.substr(0, width - 3) + "...";
      if (fancy && on) line = std::string(kCyan) + line + kReset;
      out += line + "\n";
    }
    if (!fancy) out += "  choice [" + std::to_string(current + 1) + "]: ";
    return out;
  };
  const std::string hint = "(arrow keys or 1-" + std::to_string(std::min(n, 9)) + ", Enter)";
  // The rows the header takes, so that the final redraw can replace it too.
  const size_t header_chars = 2 + question.size() + 1 + hint.size();
  const int header_rows = static_cast<int>((header_chars + width) / (width + 1));
  std::string header =
      fancy ? std::string(kBold) + "? " + question + kReset + " " + kDim + hint + kReset
            : "? " + question + " " + hint;
  term_->Write(header + "\n" + render());
  while (true) {
    LAUNCH_ASSIGN_OR_RETURN(Terminal::Key key, term_->ReadKey());
    int before = current;
    switch (key.kind) {
      case Terminal::KeyKind::kUp:
        current = (current + n - 1) % n;
        break;
      case Terminal::KeyKind::kDown:
        current = (current + 1) % n;
        break;
      case Terminal::KeyKind::kInterrupt:
      case Terminal::KeyKind::kEof:
        return Status::Interrupted("interrupted at: " + question);
      case Terminal::KeyKind::kEnter: {
        // Replace the menu by the question and its answer.
        if (fancy) term_->Write("\x1b[" + std::to_string(n + header_rows) + "A\r\x1b[J");
        std::string answer = options[static_cast<size_t>(current)];
        term_->Write(fancy ? std::string(kBold) + "? " + question + kReset + " " + kCyan + answer +
                                 kReset + "\n"
                           : "\n? " + question + " " + answer + "\n");
        return current;
      }
      case Terminal::KeyKind::kChar:
        if (key.ch >= '1' && key.ch <= '9' && key.ch - '1' < n) current = key.ch - '1';
        if (key.ch == 'k') current = (current + n - 1) % n;
        if (key.ch == 'j') current = (current + 1) % n;
        break;
      default:
        break;
    }
    if (current != before) {
      if (fancy) {
        term_->Write("\x1b[" + std::to_string(n) + "A\r\x1b[J" + render());
      } else {
        term_->Write(std::to_string(current + 1) + "\n" + render());
      }
    }
  }
}

StatusOr<std::string> Prompter::ReadLine() {
  std::string line;
  while (true) {
    LAUNCH_ASSIGN_OR_RETURN(Terminal::Key key, term_->ReadKey());
    switch (key.kind) {
      case Terminal::KeyKind::kEnter:
        term_->Write("\n");
        return line;
      case Terminal::KeyKind::kInterrupt:
        return Status::Interrupted("interrupted");
      case Terminal::KeyKind::kEof:
        if (line.empty()) return Status::Interrupted("end of input");
        break;
      case Terminal::KeyKind::kBackspace:
        if (!line.empty()) {
          // Drop one UTF-8 code point (continuation bytes are 10xxxxxx).
          while (!line.empty() && (static_cast<unsigned char>(line.back()) & 0xC0) == 0x80)
            line.pop_back();
          if (!line.empty()) line.pop_back();
          term_->Write("\b \b");
        }
        break;
      case Terminal::KeyKind::kKillLine:
        term_->Write(std::string(line.size(), '\b') + std::string(line.size(), ' ') +
                     std::string(line.size(), '\b'));
        line.clear();
        break;
      case Terminal::KeyKind::kChar:
        if (static_cast<unsigned char>(key.ch) >= 0x20) {
          line += key.ch;
          term_->Write(std::string(1, key.ch));
        }
        break;
      default:
        break;  // arrows and ESC are not part of a text answer
    }
  }
}

StatusOr<std::string> Prompter::Ask(const std::string& question, const std::string& default_value,
                                    const Validator& validate) {
  const bool fancy = term_->fancy();
  while (true) {
    std::string prompt = fancy ? std::string(kBold) + "? " + question + kReset : "? " + question;
    if (!default_value.empty()) prompt += " [" + default_value + "]";
    term_->Write(prompt + ": ");
    LAUNCH_ASSIGN_OR_RETURN(std::string line, ReadLine());
    std::string answer = Trim(line);
    if (answer.empty()) answer = default_value;
    std::string error =
        validate ? validate(answer) : (answer.empty() ? "an answer is needed" : std::string());
    if (error.empty()) return answer;
    Warn(error);
  }
}

StatusOr<int> Prompter::AskInt(const std::string& question, int default_value, int lo, int hi) {
  LAUNCH_ASSIGN_OR_RETURN(std::string answer, Ask(question, std::to_string(default_value),
                                                  [lo, hi](const std::string& a) {
                                                    long long v = 0;
                                                    if (!ParseInt64(a, &v))
                                                      return "'" + a + "' is not a whole number";
                                                    if (v < lo || v > hi)
                                                      return "expected a number from " +
                                                             std::to_string(lo) + " to " +
                                                             std::to_string(hi) + ", got " + a;
                                                    return std::string();
                                                  }));
  long long v = 0;
  ParseInt64(answer, &v);
  return static_cast<int>(v);
}

StatusOr<bool> Prompter::Confirm(const std::string& question, bool default_value) {
  LAUNCH_ASSIGN_OR_RETURN(
      std::string answer,
      Ask(question + (default_value ? " [YES/no]" : " [yes/NO]"), "", [](const std::string& a) {
        std::string l = ToLower(a);
        if (l.empty() || l == "y" || l == "yes" || l == "n" || l == "no") return std::string();
        return "please answer yes or no, not '" + a + "'";
      }));
  std::string l = ToLower(answer);
  if (l.empty()) return default_value;
  return l == "y" || l == "yes";
}

}  // namespace launch::launcher
