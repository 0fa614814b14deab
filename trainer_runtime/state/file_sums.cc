#include "trainer_runtime/state/file_sums.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include <openssl/evp.h>

#include "base/check.h"
#include "base/files.h"
#include "base/strings.h"

namespace launch::trainer {
namespace {

thread_local RecordingWrites* g_recording = nullptr;

bool IsHex64(std::string_view s) {
  if (s.size() != 64) return false;
  for (char c : s)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

// A path a list may name: relative, inside the folder, one line.
bool IsInsidePath(std::string_view p) {
  if (p.empty() || p[0] == '/' || p.find('\n') != std::string_view::npos) return false;
  for (const std::string& part : Split(p, '/'))
    if (part.empty() || part == "." || part == "..") return false;
  return true;
}

}  // namespace

std::string RankFileSumsPath(const std::string& step_dir, int rank) {
  return step_dir + "/rank" + std::to_string(rank) + ".sha256";
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  LAUNCH_CHECK(ctx_ != nullptr &&
                   EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) == 1,
               "SHA-256 init failed");
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::Update(std::string_view bytes) {
  LAUNCH_CHECK(EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), bytes.data(), bytes.size()) == 1,
               "SHA-256 update failed");
}

std::string Sha256::HexDigest() {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  LAUNCH_CHECK(EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), out, &len) == 1 && len == 32,
               "SHA-256 final failed");
  static const char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    hex += kHex[out[i] >> 4];
    hex += kHex[out[i] & 15];
  }
  return hex;
}

StatusOr<std::string> Sha256OfFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::NotFound(path + ": missing");
    return Status::IoError(path + ": " + std::strerror(err));
  }
  Sha256 sha;
  std::string buffer(1 << 20, '\0');
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return Status::IoError(path + ": " + std::strerror(err));
    }
    if (n == 0) break;
    sha.Update(std::string_view(buffer.data(), static_cast<size_t>(n)));
  }
  ::close(fd);
  return sha.HexDigest();
}

RecordingWrites::RecordingWrites() : outer_(g_recording) { g_recording = this; }

RecordingWrites::~RecordingWrites() { g_recording = outer_; }

void RecordWrittenFile(std::string path, std::string sha256) {
  if (g_recording) g_recording->files_.push_back({std::move(path), std::move(sha256)});
}

Status WriteRankFileSums(const std::string& step_dir, int rank,
                         const std::vector<WrittenFile>& files) {
  std::string text;
  const std::filesystem::path folder = std::filesystem::path(step_dir).lexically_normal();
  for (const WrittenFile& f : files) {
    // Lexically: writers join paths as they like ("step10//model.pt" when a part is empty).
    const std::string relative =
        std::filesystem::path(f.path).lexically_normal().lexically_relative(folder).string();
    if (!IsInsidePath(relative))
      return Status::InvalidArgument("checkpoint file " + f.path + " is not inside " + step_dir);
    text += f.sha256 + "  " + relative + "\n";
  }
  return WriteFileAtomically(RankFileSumsPath(step_dir, rank), text);
}

Status JoinFileSums(const std::string& step_dir, int world,
                    const std::vector<std::string>& own_files) {
  std::string text;
  for (const std::string& file : own_files) {
    StatusOr<std::string> sha = Sha256OfFile(step_dir + "/" + file);
    if (!sha.ok()) return Status::IoError("hashing the checkpoint's " + sha.status().message());
    text += *sha + "  " + file + "\n";
  }
  for (int r = 0; r < world; ++r) {
    StatusOr<std::string> part = ReadFile(RankFileSumsPath(step_dir, r));
    if (!part.ok())
      return Status::IoError("the list of files rank " + std::to_string(r) +
                             " wrote: " + part.status().message());
    text += *part;
  }
  LAUNCH_RETURN_IF_ERROR(WriteFileAtomically(step_dir + "/" + kFileSumsName, text));
  for (int r = 0; r < world; ++r) std::remove(RankFileSumsPath(step_dir, r).c_str());
  return Status::Ok();
}

FileSumsCheck CheckFileSums(const std::string& step_dir, int part, int parts) {
  FileSumsCheck check;
  const std::string list = step_dir + "/" + kFileSumsName;
  StatusOr<std::string> text = ReadFile(list);
  if (!text.ok() && text.status().code() == Status::Code::kNotFound) return check;
  check.listed = true;
  if (!text.ok()) {
    if (part == 0) check.damage.push_back(kFileSumsName + (": " + text.status().message()));
    return check;
  }
  int index = 0;
  for (const std::string& line : Split(*text, '\n')) {
    if (line.empty()) continue;
    const std::string_view hash = std::string_view(line).substr(0, 64);
    const std::string path = line.size() > 66 ? line.substr(66) : std::string();
    if (!IsHex64(hash) || line.compare(64, 2, "  ") != 0 || !IsInsidePath(path)) {
      if (part == 0)
        check.damage.push_back(std::string(kFileSumsName) + ": malformed line '" +
                               line.substr(0, 100) + "'");
      return check;
    }
    if (index++ % parts != part) continue;
    StatusOr<std::string> sha = Sha256OfFile(step_dir + "/" + path);
    if (!sha.ok() && sha.status().code() == Status::Code::kNotFound) {
      check.damage.push_back(path + ": missing");
    } else if (!sha.ok()) {
      check.damage.push_back(path + ": unreadable (" + sha.status().message() + ")");
    } else if (*sha != hash) {
      check.damage.push_back(path + ": its contents differ from those committed (SHA-256)");
    }
  }
  return check;
}

}  // namespace launch::trainer
