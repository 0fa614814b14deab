#include "launcher/terminal.h"

#include <dlfcn.h>
#include <editline/readline.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cwchar>
#include <type_traits>

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

// Waits up to `timeout_ms` (-1: for ever) for one byte of `fd`. *got is false on timeout; the
// end of the input reads as Ctrl-D. `fd` should be non-blocking (Terminal::read_fd_): a Ctrl-C
// makes the kernel flush the input queue (ISIG without NOFLSH) as it raises SIGINT, so keys
// that poll reported can be gone when read runs, and a blocking read would then wait for the
// next key with the handler already run.
Status ReadByteFrom(int fd, int timeout_ms, unsigned char* byte, bool* got) {
  *got = false;
  // Poll in short slices so a signal that arrives between the flag check and the wait is seen
  // within 100 ms even where EINTR does not reach us.
  int waited = 0;
  while (true) {
    if (g_stop_signal) return InterruptedBy(g_stop_signal);
    int slice = timeout_ms < 0 ? 100 : std::min(100, timeout_ms - waited);
    if (timeout_ms >= 0 && slice <= 0) return Status::Ok();
    struct pollfd pfd {
      fd, POLLIN, 0
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
    ssize_t n = read(fd, byte, 1);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return Status::FromErrno("reading the terminal", errno);
    }
    if (n == 0) {
      *byte = 0x04;  // end of input reads as Ctrl-D
    }
    *got = true;
    return Status::Ok();
  }
}

// Bytes in the UTF-8 sequence that `lead` starts; 1 for a byte that starts none.
size_t Utf8Length(unsigned char lead) {
  if (lead >= 0xF0 && lead <= 0xF7) return 4;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  return 1;
}

// The code point at text[*pos], moving *pos past it. A malformed byte reads as itself (as
// Latin-1), so that no typed byte is lost.
char32_t DecodeUtf8(const std::string& text, size_t* pos) {
  const unsigned char lead = static_cast<unsigned char>(text[*pos]);
  const size_t n = Utf8Length(lead);
  char32_t cp = lead & (0x7F >> n);
  for (size_t i = 1; i < n; ++i) {
    const unsigned char c = *pos + i < text.size() ? static_cast<unsigned char>(text[*pos + i]) : 0;
    if ((c & 0xC0) != 0x80) {
      ++*pos;
      return lead;
    }
    cp = (cp << 6) | (c & 0x3F);
  }
  *pos += n;
  return n == 1 ? lead : cp;
}

// Columns `text` takes on the terminal: 2 for a wide (CJK) character, 0 for a combining mark,
// 1 where the locale does not know the character.
size_t DisplayColumns(const std::string& text) {
  size_t columns = 0;
  for (size_t pos = 0; pos < text.size();) {
    int w = wcwidth(static_cast<wchar_t>(DecodeUtf8(text, &pos)));
    columns += w < 0 ? 1 : static_cast<size_t>(w);
  }
  return columns;
}

// libedit, loaded when the first edited line is read: `launch` itself starts without it (and
// its libtinfo, libbsd and libmd: fewer objects for the dynamic loader at every start, and
// `launch` runs where libedit is not installed; the wizard then falls back to its own line
// input). Types come from <editline/readline.h>; every symbol is looked up here.
struct Editline {
  decltype(&::readline) readline;
  decltype(&::add_history) add_history;
  decltype(&::rl_initialize) initialize;
  decltype(&::rl_filename_completion_function) filename_completion_function;
  decltype(&::rl_completion_matches) completion_matches;
  decltype(&::rl_getc_function) getc_function;
  decltype(&::rl_catch_signals) catch_signals;
  decltype(&::rl_readline_name) readline_name;
  decltype(&::rl_instream) instream;
  decltype(&::rl_outstream) outstream;
  decltype(&::rl_completion_append_character) completion_append_character;
  decltype(&::rl_attempted_completion_function) attempted_completion_function;
  decltype(&::rl_attempted_completion_over) attempted_completion_over;

  // Null when libedit.so.2 or one of its symbols is missing.
  static const Editline* Get() {
    static const Editline* loaded = Load();
    return loaded;
  }

 private:
  static const Editline* Load() {
    void* lib = dlopen("libedit.so.2", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return nullptr;
    static Editline e;
    bool complete = true;
    auto bind = [&](auto& field, const char* name) {
      field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(dlsym(lib, name));
      complete &= field != nullptr;
    };
    bind(e.readline, "readline");
    bind(e.add_history, "add_history");
    bind(e.initialize, "rl_initialize");
    bind(e.filename_completion_function, "rl_filename_completion_function");
    bind(e.completion_matches, "rl_completion_matches");
    bind(e.getc_function, "rl_getc_function");
    bind(e.catch_signals, "rl_catch_signals");
    bind(e.readline_name, "rl_readline_name");
    bind(e.instream, "rl_instream");
    bind(e.outstream, "rl_outstream");
    bind(e.completion_append_character, "rl_completion_append_character");
    bind(e.attempted_completion_function, "rl_attempted_completion_function");
    bind(e.attempted_completion_over, "rl_attempted_completion_over");
    return complete ? &e : nullptr;  // the library stays loaded for the process's life
  }
};

// The fd ReadEditorChar reads: the editing Terminal's read_fd_ (libedit passes only stdin).
int g_editor_read_fd = -1;

// libedit's character source (rl_getc_function): the next UTF-8 character of the terminal as a
// code point (libedit stores what this returns as one wchar_t). It waits as ReadKey does, so a
// Ctrl-C ends the line at once: libedit's own read() retries the first EINTR and would sit
// until the next key. EOF on a signal, an error or the end of the input.
int ReadEditorChar(FILE* in) {
  const int fd = g_editor_read_fd >= 0 ? g_editor_read_fd : fileno(in);
  unsigned char byte = 0;
  bool got = false;
  if (!ReadByteFrom(fd, -1, &byte, &got).ok()) return EOF;
  std::string sequence(1, static_cast<char>(byte));
  const size_t length = Utf8Length(byte);
  while (sequence.size() < length) {
    if (!ReadByteFrom(fd, 50, &byte, &got).ok()) return EOF;
    if (!got) break;
    sequence += static_cast<char>(byte);
  }
  size_t pos = 0;
  return static_cast<int>(DecodeUtf8(sequence, &pos));
}

// File names for Tab, a folder's with its '/' so that the next Tab goes on inside it (libedit's
// readline API appends one fixed character to every unique match; it is set to none).
char* CompleteFileName(const char* text, int state) {
  char* match = Editline::Get()->filename_completion_function(text, state);
  struct stat st {};
  if (match == nullptr || stat(match, &st) != 0 || !S_ISDIR(st.st_mode)) return match;
  const size_t n = std::strlen(match);
  if (n > 0 && match[n - 1] == '/') return match;
  char* with_slash = static_cast<char*>(std::realloc(match, n + 2));  // libedit free()s it
  if (with_slash == nullptr) return match;
  std::strcpy(with_slash + n, "/");
  return with_slash;
}

// Tab's candidates where the question asks for a path. Given as the "attempted" function: with
// it libedit does not backslash-escape blanks in a name (the answer is taken literally).
char** CompletePath(const char* text, int, int) {
  return Editline::Get()->completion_matches(text, CompleteFileName);
}

// Tab elsewhere: no candidates, and no fallback to file names.
char** CompleteNothing(const char*, int, int) {
  *Editline::Get()->attempted_completion_over = 1;
  return nullptr;
}

// `prompt` with each ANSI style sequence between \1 and \2, which libedit does not count as
// columns when it places the cursor.
std::string MarkInvisible(const std::string& prompt) {
  std::string out;
  for (size_t i = 0; i < prompt.size(); ++i) {
    size_t end = prompt[i] == '\x1b' ? prompt.find('m', i) : std::string::npos;
    if (end == std::string::npos) {
      out += prompt[i];
      continue;
    }
    out += '\1' + prompt.substr(i, end + 1 - i) + '\2';
    i = end;
  }
  return out;
}

constexpr char kBold[] = "\x1b[1m";
constexpr char kDim[] = "\x1b[2m";
constexpr char kCyan[] = "\x1b[36m";
constexpr char kRed[] = "\x1b[31m";
constexpr char kReset[] = "\x1b[0m";

}  // namespace

Terminal::Terminal(int in_fd, int out_fd) : in_fd_(in_fd), read_fd_(in_fd), out_fd_(out_fd) {
  // A second open file description of the same terminal, non-blocking: setting O_NONBLOCK on
  // in_fd_ would change the description the shell shares. Without it (no name in /dev), reads
  // block as before and only the Ctrl-C race in ReadByteFrom remains.
  char name[256];
  if (IsTerminal(in_fd_) && ttyname_r(in_fd_, name, sizeof name) == 0) {
    int fd = open(name, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0) read_fd_ = owned_read_fd_ = fd;
  }
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
  if (owned_read_fd_ >= 0) close(owned_read_fd_);
  if (g_editor_read_fd == owned_read_fd_) g_editor_read_fd = -1;
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
  // TCSADRAIN, not TCSAFLUSH: coming back from libedit's mode, keys typed ahead are answers.
  if (tcsetattr(in_fd_, TCSADRAIN, &raw) != 0)
    return Status::FromErrno("cannot switch the terminal to raw mode", errno);
  raw_ = true;
  return Status::Ok();
}

void Terminal::Restore() {
  if (raw_ && have_termios_) tcsetattr(in_fd_, TCSAFLUSH, &saved_termios_);
  raw_ = false;
}

StatusOr<Terminal::Key> Terminal::ReadKey() {
  unsigned char c = 0;
  bool got = false;
  LAUNCH_RETURN_IF_ERROR(ReadByteFrom(read_fd_, -1, &c, &got));
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
  LAUNCH_RETURN_IF_ERROR(ReadByteFrom(read_fd_, 50, &next, &got));
  if (!got || (next != '[' && next != 'O')) return key;
  unsigned char final_byte = 0;
  do {  // skip parameters such as "1;5" up to the final byte
    LAUNCH_RETURN_IF_ERROR(ReadByteFrom(read_fd_, 50, &final_byte, &got));
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

bool Terminal::CanEdit() const {
  return in_fd_ == STDIN_FILENO && out_fd_ == STDOUT_FILENO && fancy_ && IsTerminal(in_fd_) &&
         Editline::Get() != nullptr;
}

StatusOr<std::string> Terminal::ReadEditedLine(const std::string& prompt, bool complete_files) {
  LAUNCH_CHECK(CanEdit(), "ReadEditedLine needs stdin and stdout on a terminal, and libedit");
  const Editline& el = *Editline::Get();
  if (!editor_ready_) {
    // rl_initialize turns editing off when it finds echo off, and libedit takes the mode it
    // finds then as the one to return to: the terminal's own. Later calls go straight from raw
    // mode to libedit's, so no typed-ahead key is echoed by the terminal in between.
    if (have_termios_) tcsetattr(in_fd_, TCSADRAIN, &saved_termios_);
    *el.getc_function = ReadEditorChar;  // rl_initialize installs it
    *el.catch_signals = 0;  // keep our handlers: libedit's re-send the signal to the whole group
    *el.readline_name = "launch";  // ~/.editrc lines prefixed "launch:" apply here only
    *el.instream = stdin;
    *el.outstream = stdout;
    if (el.initialize() != 0) {
      LAUNCH_RETURN_IF_ERROR(EnterRawMode());
      return Status::IoError("cannot start libedit's line editor");
    }
    *el.completion_append_character = '\0';
    editor_ready_ = true;
  }
  *el.attempted_completion_function = complete_files ? CompletePath : CompleteNothing;
  g_editor_read_fd = read_fd_;
  char* line = el.readline(MarkInvisible(prompt).c_str());
  Status raw = EnterRawMode();
  if (line == nullptr) {
    if (g_stop_signal) return InterruptedBy(g_stop_signal);
    return Status::Interrupted("end of input");
  }
  std::string text(line);
  std::free(line);
  LAUNCH_RETURN_IF_ERROR(raw);
  if (!Trim(text).empty()) el.add_history(text.c_str());
  return text;
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

StatusOr<std::string> Prompter::ReadLine(const std::string& prompt, LineKind kind) {
  if (kind != LineKind::kSecret && term_->CanEdit())
    return term_->ReadEditedLine(prompt, kind == LineKind::kPath);
  term_->Write(prompt);
  // A secret shows nothing, not even one '*' per character, as sudo and ssh do: a screen share
  // or a terminal log then holds neither the secret nor its length.
  const bool echo = kind != LineKind::kSecret;
  auto erase = [&](size_t columns) {
    if (echo)
      term_->Write(std::string(columns, '\b') + std::string(columns, ' ') +
                   std::string(columns, '\b'));
  };
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
          // Drop the last UTF-8 character (continuation bytes are 10xxxxxx) and the columns
          // it took.
          size_t start = line.size() - 1;
          while (start > 0 && (static_cast<unsigned char>(line[start]) & 0xC0) == 0x80) --start;
          const size_t columns = DisplayColumns(line.substr(start));
          line.erase(start);
          erase(columns);
        }
        break;
      case Terminal::KeyKind::kKillLine:
        erase(DisplayColumns(line));
        line.clear();
        break;
      case Terminal::KeyKind::kChar:
        if (static_cast<unsigned char>(key.ch) >= 0x20) {
          line += key.ch;
          if (echo) term_->Write(std::string(1, key.ch));
        }
        break;
      default:
        break;  // arrows and ESC are not part of a text answer here
    }
  }
}

StatusOr<std::string> Prompter::AskLine(const std::string& question,
                                        const std::string& shown_default,
                                        const std::string& default_value, LineKind kind,
                                        const Validator& validate) {
  std::string prompt =
      term_->fancy() ? std::string(kBold) + "? " + question + kReset : "? " + question;
  if (!shown_default.empty()) prompt += " [" + shown_default + "]";
  prompt += ": ";
  while (true) {
    LAUNCH_ASSIGN_OR_RETURN(std::string line, ReadLine(prompt, kind));
    std::string answer = Trim(line);
    if (answer.empty()) answer = default_value;
    std::string error =
        validate ? validate(answer) : (answer.empty() ? "an answer is needed" : std::string());
    if (error.empty()) return answer;
    Warn(error);
  }
}

StatusOr<std::string> Prompter::Ask(const std::string& question, const std::string& default_value,
                                    const Validator& validate) {
  return AskLine(question, default_value, default_value, LineKind::kText, validate);
}

StatusOr<std::string> Prompter::AskPath(const std::string& question,
                                        const std::string& default_value,
                                        const Validator& validate) {
  return AskLine(question, default_value, default_value, LineKind::kPath, validate);
}

StatusOr<std::string> Prompter::AskSecret(const std::string& question, const std::string& current,
                                          const Validator& validate) {
  return AskLine(question, current.empty() ? "" : "Enter keeps the current one", current,
                 LineKind::kSecret, validate);
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
