#pragma once

#include <string>
#include <string_view>

#include "base/status.h"

namespace launch {

// The last component of a path ("train.yaml" for "configs/train.yaml", the path itself when
// it has no slash), and everything before it ("configs"; "." when there is no slash).
std::string Basename(const std::string& path);
std::string Dirname(const std::string& path);

// mkdir -p: creates `path` and its missing parents (0755). IoError names the folder that
// could not be created (also when a file stands where a folder should be).
Status MakeDirs(const std::string& path);

struct WriteOptions {
  unsigned mode = 0644;    // permissions of a new file (umask applies)
  bool exclusive = false;  // refuse (AlreadyExists... IoError EEXIST) when `path` exists
};

// Crash-safe file replacement: writes `PATH.tmp.<pid>.<n>` (created O_EXCL, so nothing planted
// there is followed), fsyncs it, moves it to PATH (rename; link when exclusive, which fails if
// PATH appeared meanwhile) and fsyncs the folder. A process killed at any point leaves the old
// complete file or the new complete file at PATH, never a torn one, and no temp file survives
// a failed call. Creates missing parent folders. IoError naming the file on failure.
Status WriteFileAtomically(const std::string& path, std::string_view bytes,
                           WriteOptions options = {});

// WriteFileAtomically for a file produced piece by piece (a serialiser streaming a large
// archive), with the same guarantees and without the whole file in memory:
//   AtomicFileWriter file(path);   // creates PATH.tmp.<pid>.<n> (and missing parent folders)
//   file.Append(piece); ...        // writes through to the temp file
//   Status s = file.Commit();      // fsync, rename (link when exclusive), fsync the folder
// The first error sticks: later Appends do nothing and return false, status() and Commit()
// report it (IoError naming the file). A writer destroyed before a successful Commit removes
// its temp file, so PATH keeps its old contents. Not thread-safe; one writer per file.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path, WriteOptions options = {});
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  // Appends `bytes` to the temp file: false once any call failed.
  bool Append(std::string_view bytes);
  // Ok, or the first error.
  const Status& status() const { return status_; }
  // Makes the file visible at PATH. REQUIRES: called at most once.
  Status Commit();

 private:
  void Fail(Status status);

  std::string path_;
  std::string dir_;
  std::string tmp_;
  WriteOptions options_;
  int fd_ = -1;
  bool committed_ = false;
  Status status_;
};

// A whole file. NotFound when it cannot be opened, IoError on a read error.
StatusOr<std::string> ReadFile(const std::string& path);
// A regular file of at most `max_bytes`, read whole: InvalidArgument naming the path for a
// directory, a device (/dev/zero would be read until memory ran out), a FIFO (opened without
// blocking, so one without a writer is refused, not waited on) or a larger file; NotFound and
// IoError as ReadFile.
StatusOr<std::string> ReadRegularFile(const std::string& path, size_t max_bytes);
// Whether `path` names a regular file (following links).
bool FileExists(const std::string& path);

// The first `limit` bytes of a file ("" when it cannot be read): /proc and /sys files, small
// configuration files.
std::string ReadSmallFile(const std::string& path, size_t limit = 1 << 20);
// Writes `text` to an existing file (a /proc or /sys control file): IoError naming it.
Status WriteExistingFile(const std::string& path, const std::string& text);

// Raises this process's RLIMIT_NOFILE soft limit to the hard limit (a rendezvous server may
// hold thousands of connections); best effort.
void RaiseDescriptorLimit();
// The soft limit this process started with (what its children should get back).
unsigned long long OriginalDescriptorLimit();

}  // namespace launch
