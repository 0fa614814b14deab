// IdxDataset: tiny IDX files written here (raw and gzipped), malformed ones, and the real
// Fashion-MNIST test split when Debian's dataset-fashion-mnist is installed.

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "base/test_skip.h"
#include "base/test_util.h"
#include "trainer_runtime/data/idx.h"

#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

using Bytes = std::vector<uint8_t>;

void PutBigEndian32(Bytes* out, uint32_t v) {
  out->push_back(static_cast<uint8_t>(v >> 24));
  out->push_back(static_cast<uint8_t>(v >> 16));
  out->push_back(static_cast<uint8_t>(v >> 8));
  out->push_back(static_cast<uint8_t>(v));
}

// An IDX file: magic, sizes, then `data` as given (which may disagree with the sizes).
Bytes Idx(uint32_t magic, const std::vector<uint32_t>& dims, const Bytes& data) {
  Bytes out;
  PutBigEndian32(&out, magic);
  for (uint32_t d : dims) PutBigEndian32(&out, d);
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// n images of h x w whose pixel k of image i is (i * 7 + k) % 256, and labels i % 10.
Bytes Images(uint32_t n, uint32_t h, uint32_t w) {
  Bytes data;
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t k = 0; k < h * w; ++k) data.push_back(static_cast<uint8_t>((i * 7 + k) % 256));
  return Idx(2051, {n, h, w}, data);
}
Bytes Labels(uint32_t n) {
  Bytes data;
  for (uint32_t i = 0; i < n; ++i) data.push_back(static_cast<uint8_t>(i % 10));
  return Idx(2049, {n}, data);
}

void WriteRaw(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

void WriteGzip(const std::string& path, const Bytes& bytes) {
  gzFile f = ::gzopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(::gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) ==
          static_cast<int>(bytes.size()));
  REQUIRE(::gzclose(f) == Z_OK);
}

bool Contains(const Status& s, const std::string& part) {
  return s.message().find(part) != std::string::npos;
}

const IdxOptions kUnit{/*mean=*/0.0, /*std=*/1.0};

TEST_CASE("IdxLoadsRawFilesWithShapesAndValues") {
  std::string dir = testing::MakeTempDir("idx-test");
  WriteRaw(dir + "/train-images-idx3-ubyte", Images(3, 2, 4));
  WriteRaw(dir + "/train-labels-idx1-ubyte", Labels(3));
  auto ds = IdxDataset::Load(dir, IdxSplit::kTrain, kUnit);
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  CHECK(ds->size().value() == 3);
  // Double parentheses: doctest cannot print sizes and dtypes, so it only checks the bool.
  CHECK((ds->images().sizes() == torch::IntArrayRef({3, 1, 2, 4})));
  CHECK((ds->images().scalar_type() == torch::kFloat32));
  CHECK((ds->labels().scalar_type() == torch::kInt64));
  CHECK(ds->labels().equal(torch::tensor({0, 1, 2}, torch::kInt64)));
  // Image 2, pixel (1, 3) is k = 7: (2 * 7 + 7) / 255.
  CHECK(ds->images()[2][0][1][3].item<float>() == doctest::Approx(21.0 / 255));
}

TEST_CASE("IdxNormalisesWithFashionMnistStatisticsByDefault") {
  std::string dir = testing::MakeTempDir("idx-test");
  WriteRaw(dir + "/train-images-idx3-ubyte", Idx(2051, {1, 1, 3}, {0, 255, 51}));
  WriteRaw(dir + "/train-labels-idx1-ubyte", Labels(1));
  auto ds = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  auto px = ds->images().flatten();
  CHECK(px[0].item<float>() == doctest::Approx((0.0 - 0.2860) / 0.3530));
  CHECK(px[1].item<float>() == doctest::Approx((1.0 - 0.2860) / 0.3530));
  CHECK(px[2].item<float>() == doctest::Approx((0.2 - 0.2860) / 0.3530));
  auto bad = IdxDataset::Load(dir, IdxSplit::kTrain, IdxOptions{0.5, 0.0});
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == Status::Code::kInvalidConfig);
}

TEST_CASE("IdxReadsGzipAndPrefersItOverTheRawFile") {
  std::string dir = testing::MakeTempDir("idx-test");
  WriteGzip(dir + "/t10k-images-idx3-ubyte.gz", Images(5, 3, 3));
  WriteGzip(dir + "/t10k-labels-idx1-ubyte.gz", Labels(5));
  // A raw pair of another size beside them: the .gz must win.
  WriteRaw(dir + "/t10k-images-idx3-ubyte", Images(2, 3, 3));
  WriteRaw(dir + "/t10k-labels-idx1-ubyte", Labels(2));
  auto ds = IdxDataset::Load(dir + "/", IdxSplit::kTest, kUnit);
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  CHECK(ds->size().value() == 5);
  CHECK(ds->images()[4][0][2][2].item<float>() == doctest::Approx((4 * 7 + 8) / 255.0));
  CHECK(ds->labels()[4].item<int64_t>() == 4);
}

TEST_CASE("IdxGetBatchSelectsRowsInOrder") {
  std::string dir = testing::MakeTempDir("idx-test");
  WriteRaw(dir + "/train-images-idx3-ubyte", Images(6, 2, 2));
  WriteRaw(dir + "/train-labels-idx1-ubyte", Labels(6));
  auto ds = IdxDataset::Load(dir, IdxSplit::kTrain, kUnit);
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  std::vector<size_t> rows = {5, 0, 3};
  torch::data::Example<> batch = ds->get_batch(rows);
  CHECK((batch.data.sizes() == torch::IntArrayRef({3, 1, 2, 2})));
  CHECK(batch.target.equal(torch::tensor({5, 0, 3}, torch::kInt64)));
  CHECK(batch.data[0].equal(ds->images()[5]));
  CHECK(batch.data[2].equal(ds->images()[3]));
}

TEST_CASE("IdxMissingFileIsNotFoundNamingThePath") {
  std::string dir = testing::MakeTempDir("idx-test");
  auto none = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == Status::Code::kNotFound);
  CHECK(Contains(none.status(), dir + "/train-images-idx3-ubyte"));
  WriteRaw(dir + "/train-images-idx3-ubyte", Images(2, 2, 2));
  auto no_labels = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(no_labels.ok());
  CHECK(no_labels.status().code() == Status::Code::kNotFound);
  CHECK(Contains(no_labels.status(), "train-labels-idx1-ubyte"));
}

TEST_CASE("IdxRejectsBadMagicNamingTheFile") {
  std::string dir = testing::MakeTempDir("idx-test");
  // Labels where the images belong (a swapped pair), and garbage where the labels belong.
  WriteRaw(dir + "/train-images-idx3-ubyte", Labels(4));
  WriteRaw(dir + "/train-labels-idx1-ubyte", Labels(4));
  auto swapped = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(swapped.ok());
  CHECK(swapped.status().code() == Status::Code::kInvalidConfig);
  CHECK(Contains(swapped.status(), dir + "/train-images-idx3-ubyte"));
  CHECK(Contains(swapped.status(), "magic number 2049"));

  WriteRaw(dir + "/train-images-idx3-ubyte", Images(4, 2, 2));
  WriteRaw(dir + "/train-labels-idx1-ubyte", {'h', 'e', 'l', 'l', 'o', '!', '!', '!'});
  auto garbage = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(garbage.ok());
  CHECK(Contains(garbage.status(), dir + "/train-labels-idx1-ubyte"));
  CHECK(Contains(garbage.status(), "expected 2049"));

  WriteRaw(dir + "/train-labels-idx1-ubyte", {0, 0});
  auto tiny = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(tiny.ok());
  CHECK(Contains(tiny.status(), "too short"));
}

TEST_CASE("IdxRejectsTruncatedAndOversizedData") {
  std::string dir = testing::MakeTempDir("idx-test");
  Bytes images = Images(4, 3, 3);
  WriteRaw(dir + "/train-labels-idx1-ubyte", Labels(4));

  Bytes cut(images.begin(), images.end() - 5);
  WriteRaw(dir + "/train-images-idx3-ubyte", cut);
  auto truncated = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(truncated.ok());
  CHECK(truncated.status().code() == Status::Code::kInvalidConfig);
  CHECK(Contains(truncated.status(), "train-images-idx3-ubyte"));
  CHECK(Contains(truncated.status(), "truncated"));

  Bytes header_only(images.begin(), images.begin() + 10);  // magic and half the sizes
  WriteRaw(dir + "/train-images-idx3-ubyte", header_only);
  auto short_header = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(short_header.ok());
  CHECK(Contains(short_header.status(), "truncated header"));

  Bytes longer = images;
  longer.push_back(0);
  WriteRaw(dir + "/train-images-idx3-ubyte", longer);
  auto trailing = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(trailing.ok());
  CHECK(Contains(trailing.status(), "trailing data"));

  // Sizes whose product overflows 64 bits must not be believed (nor allocated).
  WriteRaw(dir + "/train-images-idx3-ubyte",
           Idx(2051, {0xffffffffu, 0xffffffffu, 0xffffffffu}, {1, 2, 3}));
  auto huge = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(huge.ok());
  CHECK(Contains(huge.status(), "truncated"));

  WriteRaw(dir + "/train-images-idx3-ubyte", Idx(2051, {4, 0, 3}, {}));
  auto zero = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(zero.ok());
  CHECK(Contains(zero.status(), "dimension 1 is 0"));
}

TEST_CASE("IdxRejectsATruncatedGzipStream") {
  std::string dir = testing::MakeTempDir("idx-test");
  std::string gz = dir + "/t10k-images-idx3-ubyte.gz";
  WriteGzip(gz, Images(50, 28, 28));
  WriteGzip(dir + "/t10k-labels-idx1-ubyte.gz", Labels(50));
  REQUIRE(::truncate(gz.c_str(), 200) == 0);
  auto ds = IdxDataset::Load(dir, IdxSplit::kTest);
  REQUIRE_FALSE(ds.ok());
  CHECK(Contains(ds.status(), gz));
}

TEST_CASE("IdxRejectsDifferentImageAndLabelCounts") {
  std::string dir = testing::MakeTempDir("idx-test");
  WriteRaw(dir + "/train-images-idx3-ubyte", Images(3, 2, 2));
  WriteRaw(dir + "/train-labels-idx1-ubyte", Labels(2));
  auto ds = IdxDataset::Load(dir, IdxSplit::kTrain);
  REQUIRE_FALSE(ds.ok());
  CHECK(ds.status().code() == Status::Code::kInvalidConfig);
  CHECK(Contains(ds.status(), "3 images"));
  CHECK(Contains(ds.status(), "2 labels"));
}

TEST_CASE("IdxLoadsTheRealFashionMnistTestSplit") {
  struct stat st;
  if (::stat(kFashionMnistDir, &st) != 0) {
    launch::testing::SkipNeedsSetup(std::string(kFashionMnistDir) +
                                    " not installed (dataset-fashion-mnist)");
    return;
  }
  auto ds = IdxDataset::Load(kFashionMnistDir, IdxSplit::kTest);
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  CHECK(ds->size().value() == 10000);
  CHECK((ds->images().sizes() == torch::IntArrayRef({10000, 1, 28, 28})));
  CHECK(ds->labels().min().item<int64_t>() == 0);
  CHECK(ds->labels().max().item<int64_t>() == 9);
  torch::Tensor per_class = torch::bincount(ds->labels());
  CHECK(per_class.equal(torch::full({10}, 1000, torch::kInt64)));
  // Normalised with the training split's statistics, the test split is near zero mean.
  CHECK(std::abs(ds->images().mean().item<double>()) < 0.05);
}

}  // namespace
}  // namespace launch::trainer
