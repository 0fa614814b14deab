#include "trainer_runtime/state/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <sstream>

#include "base/files.h"

namespace launch::trainer {
namespace {

torch::Tensor MetaTensor(const TrainState& s) {
  return torch::tensor({s.step, s.epoch, s.batch_in_epoch, s.samples_seen, s.world_size},
                       torch::kLong);
}

TrainState FromMeta(const torch::Tensor& t) {
  auto a = t.accessor<int64_t, 1>();
  TrainState s;
  s.step = a[0];
  s.epoch = a[1];
  s.batch_in_epoch = a[2];
  s.samples_seen = a[3];
  s.world_size = a[4];
  return s;
}

StatusOr<std::unique_ptr<torch::serialize::InputArchive>> Open(const std::string& path) {
  LAUNCH_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  auto archive = std::make_unique<torch::serialize::InputArchive>();
  try {
    std::istringstream in(bytes);
    archive->load_from(in);
  } catch (const c10::Error& e) {
    return Status::IoError("checkpoint '" + path +
                           "' is unreadable: " + e.what_without_backtrace());
  }
  return archive;
}

// "[1, 2, 3]" of an integer tensor.
std::string List(const torch::Tensor& t) {
  std::string out = "[";
  const torch::Tensor flat = t.to(torch::kLong).reshape({-1});
  for (int64_t i = 0; i < flat.numel(); ++i)
    out += (i ? ", " : "") + std::to_string(flat[i].item<int64_t>());
  return out + "]";
}

}  // namespace

Status SaveModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer) {
  std::ostringstream bytes;
  try {
    torch::serialize::OutputArchive archive;
    for (auto& [name, p] : model.NamedParameters()) archive.write("param/" + name, p.detach());
    for (auto& [name, b] : model.NamedBuffers()) archive.write("buffer/" + name, b.detach());
    torch::serialize::OutputArchive opt;
    optimizer.save(opt);
    archive.write("optimizer", opt);
    archive.save_to(bytes);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint: " + std::string(e.what_without_backtrace()));
  }
  return WriteFileAtomically(path, bytes.str()).WithContext("checkpoint");
}

Status LoadModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  std::string current = "param";
  try {
    torch::NoGradGuard no_grad;
    auto restore = [&](const std::string& key, const torch::Tensor& dst) -> Status {
      current = key;
      torch::Tensor src;
      archive->read(key, src);
      if (!src.sizes().equals(dst.sizes()))
        return Status::InvalidConfig("checkpoint '" + path + "': " + key + " has shape " +
                                     c10::str(src.sizes()) + " but the model has " +
                                     c10::str(dst.sizes()) +
                                     " (was it written by a different model?)");
      dst.detach().copy_(src);
      return Status::Ok();
    };
    for (auto& [name, p] : model.NamedParameters())
      LAUNCH_RETURN_IF_ERROR(restore("param/" + name, p));
    for (auto& [name, b] : model.NamedBuffers())
      LAUNCH_RETURN_IF_ERROR(restore("buffer/" + name, b));
    current = "optimizer";
    torch::serialize::InputArchive opt;
    archive->read("optimizer", opt);
    optimizer.load(opt);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::InvalidConfig(
        "checkpoint '" + path + "': cannot restore " + current +
        " (was it written by a different model or optimizer?): " + e.what_without_backtrace());
  }
}

Status SaveOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout) {
  std::ostringstream bytes;
  try {
    torch::serialize::OutputArchive archive;
    archive.write("layout", layout);
    torch::serialize::OutputArchive opt;
    optimizer.save(opt);
    archive.write("optimizer", opt);
    archive.save_to(bytes);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint: " + std::string(e.what_without_backtrace()));
  }
  return WriteFileAtomically(path, bytes.str()).WithContext("checkpoint");
}

Status LoadOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::Tensor written;
    archive->read("layout", written);
    if (!written.sizes().equals(layout.sizes()) || !written.equal(layout))
      return Status::InvalidConfig("checkpoint '" + path + "' was cut as " + List(written) +
                                   ", this run as " + List(layout) +
                                   " (world, stage, unit sizes)");
    torch::serialize::InputArchive opt;
    archive->read("optimizer", opt);
    optimizer.load(opt);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::InvalidConfig("checkpoint '" + path +
                                 "': cannot restore the optimizer state: " +
                                 e.what_without_backtrace());
  }
}

Status SaveRankState(const std::string& path, const TrainState& state) {
  std::ostringstream bytes;
  try {
    torch::serialize::OutputArchive archive;
    archive.write("meta", MetaTensor(state));
    archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());
    archive.save_to(bytes);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint: " + std::string(e.what_without_backtrace()));
  }
  return WriteFileAtomically(path, bytes.str()).WithContext("checkpoint");
}

StatusOr<TrainState> LoadRankState(const std::string& path, bool restore_rng) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::Tensor meta;
    archive->read("meta", meta);
    if (restore_rng) {
      torch::Tensor rng;
      archive->read("rng", rng);
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the state
      generator.set_state(rng);
    }
    return FromMeta(meta);
  } catch (const c10::Error& e) {
    return Status::IoError("checkpoint '" + path +
                           "' is incomplete: " + e.what_without_backtrace());
  }
}

}  // namespace launch::trainer
