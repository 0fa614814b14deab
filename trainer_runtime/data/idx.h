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
// The whole split is read into memory once and kept as bytes (Fashion-MNIST's training images
// take 47 MB, the test images 7.8 MB per process); get_batch normalises the requested rows to
// floats. Nothing is downloaded.
//
// Thread-safety: a loaded IdxDataset is immutable; copies share the tensors (as torch tensors
// do), so it may be copied into a loader cheaply and read from several threads.

#include <cstddef>
#include <string>

#include <torch/torch.h>

#include "base/status.h"
#include "config/train_config.h"

namespace launch::trainer {

// Where Debian's dataset-fashion-mnist package installs the four gzipped IDX files.
using config::kFashionMnistDir;

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

// Pixels as floats: (byte / 255 - options.mean) / options.std, for uint8 images of any shape.
torch::Tensor NormalizePixels(const torch::Tensor& bytes, const IdxOptions& options);

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

  // Wraps tensors already in memory. REQUIRES: labels is int64 [N]; images is [N, C, H, W]
  // with the same N, either uint8 pixels (normalised by `options` in get_batch) or floats
  // (returned as they are).
  IdxDataset(torch::Tensor images, torch::Tensor labels, const IdxOptions& options = IdxOptions());

  // The examples at `indices`, in that order: data float [B, C, H, W], target int64 [B].
  // REQUIRES: every index < size() (LibTorch throws c10::Error otherwise).
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override;
  // Number of examples.
  c10::optional<size_t> size() const override;

  // Every image as floats [N, C, H, W] (normalised; a new tensor for byte images).
  torch::Tensor images() const;
  // The images as stored: uint8 [N, 1, H, W] when loaded from files.
  const torch::Tensor& pixels() const { return pixels_; }
  const torch::Tensor& labels() const { return labels_; }
  const IdxOptions& options() const { return options_; }

 private:
  torch::Tensor pixels_;
  torch::Tensor labels_;
  IdxOptions options_;
};

}  // namespace launch::trainer
