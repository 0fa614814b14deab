#pragma once

// What the API check programs (api_check, loader_check, models_check, state_check) share.

#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

namespace launch::trainer::check {

// `tensors` as float32, one after the other, raw (api_helpers.py's floats() reads them back).
inline void WriteFloats(const std::string& path, const std::vector<torch::Tensor>& tensors) {
  std::ofstream f(path, std::ios::binary);
  for (const auto& t : tensors) {
    auto c = t.detach().to(torch::kFloat).contiguous();
    f.write(static_cast<const char*>(c.data_ptr()), c.numel() * sizeof(float));
  }
}

}  // namespace launch::trainer::check
