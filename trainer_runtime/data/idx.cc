#include "trainer_runtime/data/idx.h"

#include <sys/stat.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace launch::trainer {
namespace {

constexpr uint32_t kImagesMagic = 2051;  // 0x00000803: unsigned bytes, 3 dimensions
constexpr uint32_t kLabelsMagic = 2049;  // 0x00000801: unsigned bytes, 1 dimension

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

// `dir`/`name`.gz when it exists, else `dir`/`name`: Debian ships the .gz only, a user who
// unpacked them has the raw files, and zlib reads both.
StatusOr<std::string> FindFile(const std::string& dir, const std::string& name) {
  std::string base = dir.empty() ? name : (dir.back() == '/' ? dir + name : dir + "/" + name);
  if (Exists(base + ".gz")) return base + ".gz";
  if (Exists(base)) return base;
  return Status::NotFound(base + "[.gz]: no such file (IDX data folder '" + dir + "')");
}

// zlib's last error on `file`, without the "path: " it puts in front.
std::string GzError(gzFile file, const std::string& path) {
  int code = Z_OK;
  std::string message = ::gzerror(file, &code);
  if (message.rfind(path + ": ", 0) == 0) message.erase(0, path.size() + 2);
  return message;
}

// The whole decompressed content of `path`. The buffer grows with the data actually read, so a
// header that lies about its sizes cannot make us allocate more than the file holds.
StatusOr<std::string> ReadAll(const std::string& path) {
  errno = 0;
  gzFile file = ::gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    if (errno != 0) return Status::FromErrno(path + ": cannot open", errno);
    return Status::IoError(path + ": cannot open (zlib could not allocate its state)");
  }
  std::unique_ptr<gzFile_s, int (*)(gzFile)> closer(file, &::gzclose);
  ::gzbuffer(file, 1 << 18);
  std::string data;
  std::vector<char> chunk(1 << 20);
  for (;;) {
    int n = ::gzread(file, chunk.data(), static_cast<unsigned>(chunk.size()));
    if (n < 0) return Status::IoError(path + ": " + GzError(file, path));
    if (n == 0) break;
    data.append(chunk.data(), static_cast<size_t>(n));
  }
  // A truncated gzip stream ends the reads quietly and leaves Z_BUF_ERROR ("unexpected end of
  // file") behind, which only gzerror reports.
  int code = Z_OK;
  ::gzerror(file, &code);
  if (code != Z_OK) {
    return Status::IoError(path + ": corrupt gzip stream (" + GzError(file, path) + ")");
  }
  return data;
}

uint32_t BigEndian32(const std::string& bytes, size_t at) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + at);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string JoinDims(const std::vector<int64_t>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "x" : "") + std::to_string(dims[i]);
  return s;
}

// Parses an IDX file of unsigned bytes whose magic number must be `magic` (which fixes the
// number of dimensions) into a uint8 tensor of the header's shape. Every size is checked
// against the bytes actually present before anything is allocated from it.
StatusOr<torch::Tensor> ParseUbyte(const std::string& path, const std::string& bytes,
                                   uint32_t magic, const char* kind) {
  if (bytes.size() < 4) {
    return Status::InvalidConfig(path + ": " + std::to_string(bytes.size()) +
                                 " bytes, too short for an IDX header");
  }
  uint32_t found = BigEndian32(bytes, 0);
  if (found != magic) {
    std::string hint;
    if (found == kImagesMagic || found == kLabelsMagic) {
      hint = found == kImagesMagic ? " (an image file)" : " (a label file)";
    }
    return Status::InvalidConfig(path + ": bad magic number " + std::to_string(found) + hint +
                                 ", expected " + std::to_string(magic) + " for IDX " + kind);
  }
  size_t ndims = magic & 0xff;
  size_t header = 4 + 4 * ndims;
  if (bytes.size() < header) {
    return Status::InvalidConfig(path + ": truncated header (" + std::to_string(bytes.size()) +
                                 " bytes, the header needs " + std::to_string(header) + ")");
  }
  std::vector<int64_t> dims;
  const uint64_t payload = bytes.size() - header;
  // Three 32-bit sizes can overflow 64 bits: such a header is wrong whatever the file holds.
  uint64_t need = 1;
  bool overflow = false;
  for (size_t i = 0; i < ndims; ++i) {
    uint32_t d = BigEndian32(bytes, 4 + 4 * i);
    if (d == 0) {
      return Status::InvalidConfig(path + ": dimension " + std::to_string(i) + " is 0");
    }
    dims.push_back(d);
    overflow = overflow || __builtin_mul_overflow(need, uint64_t{d}, &need);
  }
  if (overflow || need != payload) {
    return Status::InvalidConfig(
        path + ": " + std::to_string(payload) + " data bytes after the header, but its " +
        JoinDims(dims) + " " + kind + " need " +
        (overflow ? std::string("more than 2^64") : std::to_string(need)) +
        (overflow || need > payload ? " (truncated file?)" : " (trailing data)"));
  }
  torch::Tensor t = torch::empty(dims, torch::kUInt8);
  std::memcpy(t.data_ptr<uint8_t>(), bytes.data() + header, payload);
  return t;
}

StatusOr<torch::Tensor> ReadUbyte(const std::string& dir, const std::string& name, uint32_t magic,
                                  const char* kind) {
  LAUNCH_ASSIGN_OR_RETURN(std::string path, FindFile(dir, name));
  LAUNCH_ASSIGN_OR_RETURN(std::string bytes, ReadAll(path));
  return ParseUbyte(path, bytes, magic, kind);
}

}  // namespace

StatusOr<IdxDataset> IdxDataset::Load(const std::string& dir, IdxSplit split,
                                      const IdxOptions& options) {
  if (!(options.std > 0)) {
    return Status::InvalidConfig("IdxOptions.std must be > 0, got " + std::to_string(options.std));
  }
  const std::string prefix = split == IdxSplit::kTrain ? "train" : "t10k";
  const std::string images_name = prefix + "-images-idx3-ubyte";
  const std::string labels_name = prefix + "-labels-idx1-ubyte";
  try {
    LAUNCH_ASSIGN_OR_RETURN(torch::Tensor images,
                            ReadUbyte(dir, images_name, kImagesMagic, "images"));
    LAUNCH_ASSIGN_OR_RETURN(torch::Tensor labels,
                            ReadUbyte(dir, labels_name, kLabelsMagic, "labels"));
    if (images.size(0) != labels.size(0)) {
      return Status::InvalidConfig(dir + ": " + images_name + " has " +
                                   std::to_string(images.size(0)) + " images but " + labels_name +
                                   " has " + std::to_string(labels.size(0)) + " labels");
    }
    // [N, H, W] -> [N, 1, H, W]: the channel dimension torch::nn::Conv2d expects.
    return IdxDataset(images.unsqueeze(1), labels.to(torch::kInt64), options);
  } catch (const c10::Error& e) {
    return Status::Internal(dir + ": loading IDX " + prefix +
                            " split: " + e.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    return Status::IoError(dir + ": loading IDX " + prefix + " split: out of memory");
  }
}

torch::Tensor NormalizePixels(const torch::Tensor& bytes, const IdxOptions& options) {
  return bytes.to(torch::kFloat32).div_(255.0).sub_(options.mean).div_(options.std);
}

IdxDataset::IdxDataset(torch::Tensor images, torch::Tensor labels, const IdxOptions& options)
    : pixels_(std::move(images)), labels_(std::move(labels)), options_(options) {
  LAUNCH_CHECK(pixels_.dim() == 4 && (pixels_.scalar_type() == torch::kFloat32 ||
                                      pixels_.scalar_type() == torch::kUInt8),
               "IdxDataset images must be uint8 or float [N, C, H, W]");
  LAUNCH_CHECK(labels_.dim() == 1 && labels_.scalar_type() == torch::kInt64,
               "IdxDataset labels must be int64 [N]");
  LAUNCH_CHECK(pixels_.size(0) == labels_.size(0), "IdxDataset: images and labels differ in N");
}

torch::Tensor IdxDataset::images() const {
  return pixels_.scalar_type() == torch::kUInt8 ? NormalizePixels(pixels_, options_) : pixels_;
}

torch::data::Example<> IdxDataset::get_batch(c10::ArrayRef<size_t> indices) {
  // size_t has no torch dtype: copy into an int64 index tensor for index_select.
  torch::Tensor index = torch::empty({static_cast<int64_t>(indices.size())}, torch::kInt64);
  int64_t* p = index.data_ptr<int64_t>();
  for (size_t i = 0; i < indices.size(); ++i) p[i] = static_cast<int64_t>(indices[i]);
  torch::Tensor x = pixels_.index_select(0, index);
  if (x.scalar_type() == torch::kUInt8) x = NormalizePixels(x, options_);
  return {x, labels_.index_select(0, index)};
}

c10::optional<size_t> IdxDataset::size() const { return static_cast<size_t>(pixels_.size(0)); }

}  // namespace launch::trainer
