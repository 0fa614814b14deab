#pragma once

// The terminal UI of `launch config`: key input in non-canonical mode, and prompts built on it
// (menus driven by arrow and number keys, text answers with a default and on-the-spot
// validation, yes/no questions, secrets typed without echo).
//
// Text answers on a real terminal are edited with libedit (BSD; its readline API): cursor keys,
// Home/End, Ctrl-A/E/K, this session's earlier answers on Up/Down, and Tab completing file
// names where the question asks for a path. Elsewhere (pipes in tests, TERM=dumb) and for
// secrets, a small editor of our own reads the line: Backspace and Ctrl-U only. Text is UTF-8;
// column widths and libedit's decoding follow LC_CTYPE, which the caller sets (RunWizard: the
// user's locale when it is UTF-8, else C.UTF-8).
//
// Terminal owns the terminal state for its lifetime: the constructor records the input's
// termios and installs SIGINT/SIGTERM/SIGHUP handlers that only set a flag; EnterRawMode()
// switches off line buffering and echo (signals stay enabled, so Ctrl-C raises SIGINT as usual);
// the destructor restores both the termios and the previous signal handlers. A pending signal
// or a Ctrl-C/Ctrl-D typed as a key makes every read return Status::Interrupted, so callers
// unwind and write nothing. Works on non-terminal fds too (pipes in tests): raw mode is then a
// no-op and input is read byte by byte all the same.
//
// Not thread-safe; at most one Terminal may exist at a time (the signal flag is process-wide).

#include <termios.h>

#include <csignal>
#include <functional>
#include <string>
#include <vector>

#include "base/status.h"

namespace launch::launcher {

class Terminal {
 public:
  enum class KeyKind {
    kChar,       // a byte of text (UTF-8 sequences arrive byte by byte)
    kEnter,      // CR or LF
    kBackspace,  // DEL or ^H
    kKillLine,   // ^U
    kUp,
    kDown,
    kLeft,
    kRight,
    kEscape,     // a lone ESC, or an escape sequence we do not know
    kInterrupt,  // ^C read as a byte (when the terminal does not turn it into SIGINT)
    kEof,        // ^D, or the end of the input
  };
  struct Key {
    KeyKind kind = KeyKind::kEscape;
    char ch = 0;  // for kChar
  };

  // Does not take ownership of the fds.
  Terminal(int in_fd, int out_fd);
  ~Terminal();
  Terminal(const Terminal&) = delete;
  Terminal& operator=(const Terminal&) = delete;

  // Whether `fd` is a terminal.
  static bool IsTerminal(int fd);

  // Non-canonical input without echo. No-op (OK) when the input is not a terminal.
  Status EnterRawMode();
  // Back to the termios found at construction. Idempotent; the destructor calls it.
  void Restore();

  // The next key. Interrupted when a signal arrived (before or while waiting); kEof at the end
  // of the input; IoError when reading fails.
  StatusOr<Key> ReadKey();

  // Whether ReadEditedLine may be used: input and output are the process's stdin and stdout
  // (libedit's readline API reads and writes those), both terminals, and fancy().
  bool CanEdit() const;
  // One line read with libedit after `prompt` (which may hold ANSI styles), without the
  // newline. Meanwhile the terminal is in libedit's mode (echo on, signals on); on return it is
  // in raw mode again. Non-blank lines join this process's history. Tab completes file names
  // when `complete_files`, else does nothing. Interrupted on a signal (as ReadKey) or Ctrl-D on
  // an empty line. REQUIRES: CanEdit(), EnterRawMode() called.
  StatusOr<std::string> ReadEditedLine(const std::string& prompt, bool complete_files);

  // Writes all of `text` (retrying on EINTR and short writes); errors are ignored: there is no
  // one to tell when the terminal itself is gone.
  void Write(const std::string& text);

  // Whether output may use ANSI colours and cursor movement (TERM is not "dumb").
  bool fancy() const { return fancy_; }

  // Width of the output terminal in columns; 80 when unknown.
  int Columns() const;

 private:
  int in_fd_;
  int read_fd_;             // where keys are read: owned_read_fd_, else in_fd_
  int owned_read_fd_ = -1;  // the input terminal reopened non-blocking (see ReadByteFrom)
  int out_fd_;
  bool fancy_ = true;
  bool have_termios_ = false;
  bool raw_ = false;
  bool editor_ready_ = false;  // libedit initialised for this terminal
  struct termios saved_termios_ {};
  struct sigaction saved_int_ {
  }, saved_term_{}, saved_hup_{};
};

// Questions asked on a Terminal. Every method returns Interrupted when the user pressed Ctrl-C
// (or Ctrl-D on an empty answer, or the input ended), and the final answer otherwise.
class Prompter {
 public:
  // Returns "" when `answer` is acceptable, otherwise what is wrong with it (shown, then the
  // question is asked again).
  using Validator = std::function<std::string(const std::string& answer)>;

  explicit Prompter(Terminal* terminal) : term_(terminal) {}

  // A menu: Up/Down (or k/j) move, a number key 1-9 jumps to that entry, Enter chooses.
  // Returns the chosen index. REQUIRES: !options.empty(), 0 <= default_index < options.size().
  StatusOr<int> Choose(const std::string& question, const std::vector<std::string>& options,
                       int default_index);

  // A free-text answer; an empty answer means `default_value` (shown as "[default]" when not
  // empty). The answer (default included) must pass `validate`, else the error is shown and
  // the question repeats; without a validator any non-empty answer passes (a validator decides
  // itself whether an empty answer is acceptable). Leading and trailing blanks are trimmed.
  StatusOr<std::string> Ask(const std::string& question, const std::string& default_value,
                            const Validator& validate = nullptr);
  // Ask for a file or folder: Tab completes file names where the line is edited with libedit.
  StatusOr<std::string> AskPath(const std::string& question, const std::string& default_value,
                                const Validator& validate = nullptr);
  // Ask for a secret: typed characters are not shown (Backspace and Ctrl-U still edit), and
  // the answer joins no history. An empty answer keeps `current`, which is never shown: the
  // prompt says "[Enter keeps the current one]" instead.
  StatusOr<std::string> AskSecret(const std::string& question, const std::string& current,
                                  const Validator& validate = nullptr);

  // An integer in [lo, hi]; the default is shown as "[n]".
  StatusOr<int> AskInt(const std::string& question, int default_value, int lo, int hi);

  // yes/no; shown as "[YES/no]" or "[yes/NO]" with the default in capitals.
  StatusOr<bool> Confirm(const std::string& question, bool default_value);

  // A line of information (not a question).
  void Say(const std::string& text);
  // A line saying what is wrong with an answer ("  ! text", in red on a fancy terminal).
  void Warn(const std::string& text);

 private:
  enum class LineKind { kText, kPath, kSecret };
  // The question loop behind Ask, AskPath and AskSecret; `shown_default` is what the brackets
  // show ("" for none).
  StatusOr<std::string> AskLine(const std::string& question, const std::string& shown_default,
                                const std::string& default_value, LineKind kind,
                                const Validator& validate);
  // Writes `prompt` and reads one line: with libedit where the terminal allows it (not for
  // secrets), else with our own editor (Backspace, Ctrl-U; no echo for kSecret). Interrupted
  // on ^C, or ^D on an empty line.
  StatusOr<std::string> ReadLine(const std::string& prompt, LineKind kind);

  Terminal* term_;
};

}  // namespace launch::launcher
