#pragma once

// What makes a checkpoint verifiable: the SHA-256 of every file in it, recorded when it is
// committed and checked before it is loaded, so that a flipped byte, a truncated or a deleted
// file is found before it becomes parameters (a LibTorch archive reads back without checking
// its own CRCs).
//
// A checkpoint folder (Accelerator::SaveState) ends up with SHA256SUMS, in sha256sum's format
// ("<hex>  <path>" relative to the folder), so `cd stepN && sha256sum -c SHA256SUMS` checks it by
// hand. It is made in two halves:
//   - each rank's writer records the files it writes with the hash of their bytes, computed as
//     they are streamed to disk (RecordingWrites, RecordWrittenFile), and writes its list as
//     rank<r>.sha256 after them;
//   - at the commit, once every rank has written, rank 0 joins the lists (and run.txt, which
//     it wrote itself) into SHA256SUMS and removes them (JoinFileSums).
// Verification is shared: each of `parts` ranks hashes every parts-th file of the list
// (CheckFileSums), so a checkpoint is read once in all.
//
// No LibTorch here.

#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace launch::trainer {

// The name of the folder's list, and of one rank's half of it.
inline constexpr const char* kFileSumsName = "SHA256SUMS";
std::string RankFileSumsPath(const std::string& step_dir, int rank);

// SHA-256 of a byte stream, as lower-case hex.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(std::string_view bytes);
  // The digest of everything given; the object is then spent.
  std::string HexDigest();

 private:
  void* ctx_;  // EVP_MD_CTX
};

// The SHA-256 of a file's contents: NotFound when it does not exist, IoError on a read error.
StatusOr<std::string> Sha256OfFile(const std::string& path);

// A file written into a checkpoint folder and the hash of what was written.
struct WrittenFile {
  std::string path;  // as given to the writer
  std::string sha256;
};

// While a RecordingWrites is alive, RecordWrittenFile on the same thread adds to it (the
// checkpoint writers in checkpoint.cc call it for every file they commit). Scopes nest; the
// innermost records.
class RecordingWrites {
 public:
  RecordingWrites();
  ~RecordingWrites();
  RecordingWrites(const RecordingWrites&) = delete;
  RecordingWrites& operator=(const RecordingWrites&) = delete;
  const std::vector<WrittenFile>& files() const { return files_; }

 private:
  friend void RecordWrittenFile(std::string path, std::string sha256);
  std::vector<WrittenFile> files_;
  RecordingWrites* outer_;
};
void RecordWrittenFile(std::string path, std::string sha256);

// Writes rank `rank`'s list of `files` (each under `step_dir`) as RankFileSumsPath, atomically.
// InvalidArgument for a file outside `step_dir`; IoError naming the list.
Status WriteRankFileSums(const std::string& step_dir, int rank,
                         const std::vector<WrittenFile>& files);

// Joins the lists of ranks 0 .. world-1 and the hashes of `own_files` (relative to `step_dir`,
// hashed here: files rank 0 wrote outside the recording, run.txt) into `step_dir`/SHA256SUMS,
// written atomically, then removes the ranks' lists. IoError naming a missing or unreadable
// list, or the file that could not be written.
Status JoinFileSums(const std::string& step_dir, int world,
                    const std::vector<std::string>& own_files);

// What CheckFileSums found.
struct FileSumsCheck {
  bool listed = false;              // the folder has SHA256SUMS (older checkpoints do not)
  std::vector<std::string> damage;  // one line per bad file of this part: "model.pt: missing"
};
// Hashes the entries i of `step_dir`/SHA256SUMS with i % parts == part and compares each with
// its recorded hash. A missing list is `listed` false, not damage; an unreadable or malformed
// list is damage (named once, by part 0).
FileSumsCheck CheckFileSums(const std::string& step_dir, int part, int parts);

}  // namespace launch::trainer
