// ReadErrorFile on files written as torchrun's @record writes them (Python's json, ASCII only).

#include "agent/error_file.h"

#include <stdlib.h>
#include <unistd.h>

#include <fstream>
#include <string>

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

// A file holding `text` in a fresh folder, removed at the end of the test.
struct ErrorFile {
  std::string dir, path;
  explicit ErrorFile(const std::string& text) {
    char tmpl[] = "/tmp/error-file-test-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    dir = tmpl;
    path = dir + "/rank_0.error.json";
    std::ofstream(path, std::ios::binary) << text;
  }
  ~ErrorFile() {
    ::unlink(path.c_str());
    ::rmdir(dir.c_str());
  }
};

TEST_CASE("ReadErrorFileDecodesEveryEscapeOfPythonsJson") {
  // json.dumps({"message": {"message": "ValueError: \U0001F600 \"q\" \\ a\nb \x01", ...}}):
  // the emoji as a surrogate pair, a quote, a backslash, a newline and a control character.
  ErrorFile f(
      R"({"message": {"message": "ValueError: \ud83d\ude00 \"q\" \\ a\nb \u0001 \u00e9", )"
      R"("extraInfo": {"py_callstack": "Traceback (most recent call last):\n  File \"x.py\"\n", )"
      R"("timestamp": "1700000000"}}})");
  const std::optional<WorkerError> e = ReadErrorFile(f.path);
  REQUIRE(e.has_value());
  CHECK(e->message == "ValueError: \xF0\x9F\x98\x80 \"q\" \\ a\nb \x01 \xC3\xA9");
  CHECK(e->traceback == "Traceback (most recent call last):\n  File \"x.py\"\n");
}

TEST_CASE("ReadErrorFileTakesAPlainStringMessage") {
  ErrorFile f(R"({"message": "RuntimeError: boom"})");
  const std::optional<WorkerError> e = ReadErrorFile(f.path);
  REQUIRE(e.has_value());
  CHECK(e->message == "RuntimeError: boom");
  CHECK(e->traceback.empty());
}

TEST_CASE("ReadErrorFileTakesATracebackWithoutMessage") {
  ErrorFile f(R"({"message": {"extraInfo": {"py_callstack": "Traceback ..."}}})");
  const std::optional<WorkerError> e = ReadErrorFile(f.path);
  REQUIRE(e.has_value());
  CHECK(e->message.empty());
  CHECK(e->traceback == "Traceback ...");
}

TEST_CASE("ReadErrorFileIgnoresFilesNotInTheFormat") {
  for (const char* text :
       {"", "not json", R"({"message": )", R"(["message"])", R"({"other": "x"})",
        R"({"message": {"message": ""}})", R"({"message": null})", R"({"message": "a"} trailing)",
        R"({"message": "lone surrogate \ud83d"})"}) {
    const std::string shown = text;
    CAPTURE(shown);
    ErrorFile f(text);
    CHECK_FALSE(ReadErrorFile(f.path).has_value());
  }
  CHECK_FALSE(ReadErrorFile("/nonexistent/rank_0.error.json").has_value());
}

TEST_CASE("ReadErrorFileIgnoresFilesOverOneMebibyte") {
  const std::string big = R"({"message": ")" + std::string(1 << 20, 'x') + R"("})";
  ErrorFile f(big);
  CHECK_FALSE(ReadErrorFile(f.path).has_value());
  ErrorFile small(R"({"message": ")" + std::string((1 << 20) - 20, 'x') + R"("})");
  CHECK(ReadErrorFile(small.path).has_value());
}

}  // namespace
}  // namespace launch::agent
