#pragma once

// What the three examples share, so that each of them shows only its own way of training:
// "--name value" flags, and the accuracy on Fashion-MNIST's 10,000 test images computed with
// the images split over the ranks.

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "base/status.h"
#include "trainer_runtime/api/accelerator.h"
#include "trainer_runtime/data/idx.h"

namespace examples {

// Command-line flags of the form `--name value`.
class Flags {
 public:
  // InvalidArgument naming a flag that is not in `known` or has no value.
  static launch::StatusOr<Flags> Parse(int argc, char** argv,
                                       const std::vector<std::string>& known) {
    Flags flags;
    for (int i = 1; i < argc; ++i) {
      std::string arg = argv[i];
      std::string name = arg.rfind("--", 0) == 0 ? arg.substr(2) : "";
      bool is_known = false;
      for (const std::string& k : known) is_known = is_known || k == name;
      if (!is_known) {
        std::string choices;
        for (const std::string& k : known) choices += " --" + k;
        return launch::Status::InvalidArgument("unknown argument '" + arg + "' (flags:" + choices +
                                               ")");
      }
      if (i + 1 == argc) return launch::Status::InvalidArgument(arg + ": expected a value");
      flags.values_[name] = argv[++i];
    }
    return flags;
  }

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback) const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second;
  }
  // The flag as an integer >= 0, or `fallback` when it was not given.
  launch::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback) const {
    auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    char* end = nullptr;
    errno = 0;
    long long v = std::strtoll(it->second.c_str(), &end, 10);
    if (it->second.empty() || *end != '\0' || errno != 0 || v < 0) {
      return launch::Status::InvalidArgument("--" + name + ": expected an integer >= 0, got '" +
                                             it->second + "'");
    }
    return static_cast<int64_t>(v);
  }

 private:
  std::map<std::string, std::string> values_;
};

// `value` with `digits` decimals: Fixed(0.85123, 4) is "0.8512".
inline std::string Fixed(double value, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, value);
  return buf;
}

// "test_accuracy=0.8512": the line the examples end with (tests/examples reads it).
inline std::string AccuracyLine(double accuracy) { return "test_accuracy=" + Fixed(accuracy, 4); }

// The fraction of `test` whose arg-max class is the label. Rank r of the W data-parallel ranks
// classifies images r, r + W, r + 2W, ..., so each image is seen once and the work is split;
// AllReduceSum then adds up the counts, and every rank returns the same value.
// `logits(images)` returns [B, classes], or an undefined tensor on a pipeline stage that is not
// the last (which counts nothing). Runs without gradients. COLLECTIVE.
template <typename LogitsFn>
double TestAccuracy(launch::trainer::Accelerator& accel, const launch::trainer::IdxDataset& test,
                    LogitsFn logits) {
  torch::NoGradGuard no_grad;
  const int64_t n = static_cast<int64_t>(test.size().value());
  torch::Tensor mine =
      torch::arange(accel.data_parallel_rank(), n, accel.data_parallel_size(), torch::kInt64);
  torch::Tensor counts = torch::zeros({2}, torch::kInt64);  // correct, classified
  const torch::Tensor images = test.images();  // normalised once (the file holds bytes)
  const int64_t chunk = 1000;  // rows per forward pass: bounds the activations' memory
  for (int64_t begin = 0; begin < mine.size(0); begin += chunk) {
    torch::Tensor rows = mine.slice(0, begin, begin + chunk);
    torch::Tensor out = logits(images.index_select(0, rows));
    if (!out.defined()) continue;
    counts[0] += out.argmax(1).eq(test.labels().index_select(0, rows)).sum();
    counts[1] += rows.size(0);
  }
  accel.AllReduceSum(counts);
  return counts[0].item<double>() / counts[1].item<double>();
}

}  // namespace examples
