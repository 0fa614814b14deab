#pragma once

// What the API check programs (api_check, loader_check, models_check, state_check) share.

#include <CLI/CLI.hpp>
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

// A command line parser for a check program: a flag given twice keeps its last value.
inline void UseLastValue(CLI::App& app) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

// Parses argv into the options of `app`. Returns -1 to go on, else the exit code: 0 after
// --help, 2 for a bad command line (CLI11's message on stderr).
inline int ParseFlags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return -1;
}

}  // namespace launch::trainer::check
