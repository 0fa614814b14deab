#pragma once

// A reader for the IDX format of MNIST and Fashion-MNIST, as a torch::data batch dataset that
// Accelerator::PrepareDataLoader shards over the ranks:
//
//   auto train = launch::trainer::IdxDataset::Load(launch::trainer::kFashionMnistDir,
//                                                  launch::trainer::IdxSplit::kTrain);
//   if (!train.ok()) { /* train.status().ToString() names the file and the problem */ }
//   auto loader = accel->PrepareDataLoader(std::move(train).value(), /*batch_size=*/64);
//
// Format (big-endian, https://yann.lecun.com/exdb/mnist/): a 4-byte magic number whose low
// byte is the number of dimensions (images: 2051 = unsigned bytes, 3 dims N x H x W; labels:
// 2049 = unsigned bytes, 1 dim N), one 4-byte size per dimension, then the bytes row-major.
// Files may be gzipped (Debian's dataset-fashion-mnist ships them so); zlib reads both forms.
//
// The whole split is read into memory once (Fashion-MNIST's training images are 188 MB as
// float); get_batch copies the requested rows. Nothing is downloaded.
//
// Thread-safety: a loaded IdxDataset is immutable; copies share the tensors (as torch tensors
// do), so it may be copied into a loader cheaply and read from several threads.

#include <cstddef>
#include <string>

#include <torch/torch.h>

#include "base/status.h"

namespace launch::trainer {

// Where Debian's dataset-fashion-mnist package installs the four gzipped IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// Which file pair Load reads: kTrain the `train-*` files (60,000 examples in (Fashion-)MNIST),
// kTest the `t10k-*` files (10,000).
enum class IdxSplit { kTrain, kTest };

struct IdxOptions {
  // Pixels become floats as (byte / 255 - mean) / std. The defaults are the mean and standard
  // deviation of Fashion-MNIST's 60,000 training images (over all pixels, after / 255), so
  // the inputs are roughly zero-mean, unit-variance. MNIST's are 0.1307 and 0.3081.
  // mean = 0, std = 1 keeps the plain [0, 1] scale. REQUIRES: std > 0.
  double mean = 0.2860;
  double std = 0.3530;
};

class IdxDataset : public torch::data::datasets::BatchDataset<IdxDataset, torch::data::Example<>,
                                                              c10::ArrayRef<size_t>> {
 public:
  // Reads `dir`/<prefix>-images-idx3-ubyte and `dir`/<prefix>-labels-idx1-ubyte, prefix
  // "train" or "t10k" by `split`; each name with ".gz" appended is taken first when it exists.
  // Errors: NotFound naming the path when neither form of a file exists; IoError when a file
  // cannot be read or its gzip stream is corrupt; InvalidConfig naming the file and what is
  // wrong for a bad magic number, a zero dimension, a length that does not match the header
  // (truncated or trailing data), a label count different from the image count, or
  // options.std <= 0. Never crashes on a malformed file.
  static StatusOr<IdxDataset> Load(const std::string& dir, IdxSplit split,
                                   const IdxOptions& options = IdxOptions());

  // Wraps tensors already in memory. REQUIRES: images is float [N, 1, H, W] and labels is
  // int64 [N], with the same N.
  IdxDataset(torch::Tensor images, torch::Tensor labels);

  // The examples at `indices`, in that order: data float [B, 1, H, W], target int64 [B].
  // REQUIRES: every index < size() (LibTorch throws c10::Error otherwise).
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override;
  // Number of examples.
  c10::optional<size_t> size() const override;

  // Every example: images float [N, 1, H, W] (normalised), labels int64 [N].
  const torch::Tensor& images() const { return images_; }
  const torch::Tensor& labels() const { return labels_; }

 private:
  torch::Tensor images_;
  torch::Tensor labels_;
};

}  // namespace launch::trainer
