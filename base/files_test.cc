#include "base/files.h"

#include <doctest/doctest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <dirent.h>

#include <fstream>
#include <string>
#include <vector>

#include "base/test_util.h"

namespace launch {
namespace {

TEST_CASE("ReadSmallFileReadsUpToItsLimitAndNothingWhenMissing") {
  const std::string dir = testing::MakeTempDir("files-test");
  const std::string path = dir + "/f";
  std::string text(100000, 'x');
  text[99999] = 'y';
  { std::ofstream(path) << text; }
  CHECK(ReadSmallFile(path) == text);
  CHECK(ReadSmallFile(path, 10) == std::string(10, 'x'));
  CHECK(ReadSmallFile(dir + "/missing").empty());
  // /proc files report size 0 and are read to their end.
  CHECK(ReadSmallFile("/proc/self/status").find("Pid:") != std::string::npos);
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("FileExistsIsTrueForRegularFilesOnly") {
  const std::string dir = testing::MakeTempDir("files-test");
  const std::string path = dir + "/f";
  CHECK_FALSE(FileExists(path));
  { std::ofstream(path) << "x"; }
  CHECK(FileExists(path));
  CHECK_FALSE(FileExists(dir));  // a folder is not a file
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  REQUIRE(d != nullptr);
  while (dirent* e = ::readdir(d))
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") names.push_back(e->d_name);
  ::closedir(d);
  return names;
}

TEST_CASE("WriteFileAtomicallyCreatesParentsReplacesAndLeavesNoTempFile") {
  const std::string dir = testing::MakeTempDir("files-test");
  const std::string path = dir + "/a/b/config.yaml";
  REQUIRE(WriteFileAtomically(path, "one\n").ok());
  CHECK(*ReadFile(path) == "one\n");
  REQUIRE(WriteFileAtomically(path, "two\n", {0600}).ok());
  CHECK(*ReadFile(path) == "two\n");
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(Entries(dir + "/a/b") == std::vector<std::string>{"config.yaml"});
  // exclusive: an existing file stays as it was.
  Status s = WriteFileAtomically(path, "three\n", {0644, /*exclusive=*/true});
  CHECK(s.message().find("cannot create " + path + ": File exists") == 0);
  CHECK(*ReadFile(path) == "two\n");
  REQUIRE(WriteFileAtomically(dir + "/a/new", "x", {0644, true}).ok());
  // A folder where the file should go: an error, nothing left behind.
  REQUIRE(::mkdir((dir + "/folder").c_str(), 0755) == 0);
  CHECK_FALSE(WriteFileAtomically(dir + "/folder", "x").ok());
  CHECK(Entries(dir + "/a/b") == std::vector<std::string>{"config.yaml"});
  std::vector<std::string> top = Entries(dir);
  CHECK(top.size() == 2);  // a, folder
  CHECK(ReadFile(dir + "/missing").status().code() == Status::Code::kNotFound);
  for (const char* p : {"/a/b/config.yaml", "/a/new", "/a/b", "/a", "/folder"}) {
    ::unlink((dir + p).c_str());
    ::rmdir((dir + p).c_str());
  }
  ::rmdir(dir.c_str());
}

TEST_CASE("AtomicFileWriterShowsNothingUntilCommitAndRemovesAnAbandonedTempFile") {
  const std::string dir = testing::MakeTempDir("files-test");
  const std::string path = dir + "/archive.pt";
  REQUIRE(WriteFileAtomically(path, "old").ok());
  {
    AtomicFileWriter file(path);
    CHECK(file.Append("new "));
    CHECK(file.Append(std::string(1 << 20, 'x')));  // larger than one write's worth of pipe
    CHECK(*ReadFile(path) == "old");                // PATH unchanged while writing
    CHECK(Entries(dir).size() == 2);                // archive.pt and the temp file
    REQUIRE(file.Commit().ok());
  }
  CHECK(*ReadFile(path) == "new " + std::string(1 << 20, 'x'));
  CHECK(Entries(dir) == std::vector<std::string>{"archive.pt"});
  {
    AtomicFileWriter abandoned(path);  // a serialiser that threw halfway
    CHECK(abandoned.Append("torn"));
  }
  CHECK(ReadFile(path)->size() == 4 + (1u << 20));
  CHECK(Entries(dir) == std::vector<std::string>{"archive.pt"});
  // A file where the folder should be: the error sticks and names the temp file.
  AtomicFileWriter blocked(path + "/sub");
  CHECK_FALSE(blocked.status().ok());
  CHECK_FALSE(blocked.Append("x"));
  Status s = blocked.Commit();
  CHECK(s.message().find(path) != std::string::npos);
  CHECK(Entries(dir) == std::vector<std::string>{"archive.pt"});
  ::unlink(path.c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("MakeDirsCreatesParentsAcceptsExistingAndNamesWhatFails") {
  const std::string dir = testing::MakeTempDir("files-test");
  REQUIRE(MakeDirs(dir + "/a/b/c").ok());
  struct stat st;
  CHECK(::stat((dir + "/a/b/c").c_str(), &st) == 0);
  CHECK(MakeDirs(dir + "/a/b").ok());  // already there
  { std::ofstream(dir + "/file") << "x"; }
  // A file where a folder should be: named, whether it is the last part or a parent.
  Status s = MakeDirs(dir + "/file/sub");
  CHECK(s.message() == "cannot create folder " + dir + "/file/: Not a directory");
  s = MakeDirs(dir + "/file");
  CHECK(s.message().find("cannot create folder " + dir + "/file/") == 0);
  CHECK(s.message().find("Not a directory") != std::string::npos);
  for (const char* p : {"/a/b/c", "/a/b", "/a", "/file"}) {
    ::rmdir((dir + p).c_str());
    ::unlink((dir + p).c_str());
  }
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace launch
