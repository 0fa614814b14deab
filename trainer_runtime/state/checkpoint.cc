#include "trainer_runtime/state/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <string_view>

#include "base/files.h"

namespace launch::trainer {
namespace {

// "meta" holds the integer fields in this order. Fields are only ever appended: an older file
// has a shorter tensor, and the fields it lacks keep their defaults. "schedule": the doubles.
std::array<int64_t*, 11> IntFields(TrainState& s) {
  return {&s.step,
          &s.epoch,
          &s.batch_in_epoch,
          &s.samples_seen,
          &s.world_size,
          &s.data_world,
          &s.epoch_start,
          &s.epoch_offset,
          &s.samples_seen_global,
          &s.origin_data_world,
          &s.anchor_step};
}

torch::Tensor MetaTensor(TrainState s) {
  std::vector<int64_t> values;
  for (int64_t* field : IntFields(s)) values.push_back(*field);
  return torch::tensor(values, torch::kLong);
}

torch::Tensor ScheduleTensor(const TrainState& s) {
  return torch::tensor({s.anchor_position, s.anchor_slope}, torch::kDouble);
}

TrainState FromMeta(const torch::Tensor& meta, const torch::Tensor& schedule) {
  TrainState s;
  const auto fields = IntFields(s);
  auto a = meta.accessor<int64_t, 1>();
  const size_t n = std::min(static_cast<size_t>(a.size(0)), fields.size());
  for (size_t i = 0; i < n; ++i) *fields[i] = a[static_cast<int64_t>(i)];
  if (schedule.defined() && schedule.numel() >= 2) {
    auto d = schedule.accessor<double, 1>();
    s.anchor_position = d[0];
    s.anchor_slope = d[1];
  }
  return s;
}

// Reads the archive from the file itself (tensors are read record by record into their own
// storage): no copy of the whole file in memory.
StatusOr<std::unique_ptr<torch::serialize::InputArchive>> Open(const std::string& path) {
  // What ReadFile said for a missing file, which callers tell apart from a damaged one.
  if (::access(path.c_str(), R_OK) != 0)
    return Status::NotFound("cannot open '" + path + "': " + std::strerror(errno));
  auto archive = std::make_unique<torch::serialize::InputArchive>();
  try {
    archive->load_from(path);
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

// Streams `archive` into the temp file of an atomic write (base/files.h AtomicFileWriter): the
// file never exists in memory as a whole. A write error is kept by the writer and reported by
// Commit; LibTorch's zip writer is told every write worked, because 1.13's writer, told
// otherwise, throws again from its destructor while the first exception unwinds
// (std::terminate).
Status SaveArchive(torch::serialize::OutputArchive& archive, const std::string& path) {
  AtomicFileWriter file(path);
  try {
    archive.save_to([&file](const void* bytes, size_t size) -> size_t {
      file.Append(std::string_view(static_cast<const char*>(bytes), size));
      return size;
    });
  } catch (const c10::Error& e) {
    return Status::IoError("writing checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return file.Commit().WithContext("checkpoint");
}

}  // namespace

Status SaveModelState(const std::string& path, const Model& model,
                      torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  try {
    // The archive refers to the tensors; nothing is copied until it is written.
    for (auto& [name, p] : model.NamedParameters()) archive.write("param/" + name, p.detach());
    for (auto& [name, b] : model.NamedBuffers()) archive.write("buffer/" + name, b.detach());
    torch::serialize::OutputArchive opt;
    optimizer.save(opt);
    archive.write("optimizer", opt);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
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
  torch::serialize::OutputArchive archive;
  try {
    archive.write("layout", layout);
    torch::serialize::OutputArchive opt;
    optimizer.save(opt);
    archive.write("optimizer", opt);
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

Status LoadOptimizerState(const std::string& path, torch::optim::Optimizer& optimizer,
                          const torch::Tensor& layout) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::Tensor written;
    archive->read("layout", written);
    if (!written.sizes().equals(layout.sizes()) || !written.equal(layout))
      return Status::InvalidConfig("checkpoint '" + path + "' was cut as " + List(written) +
                                   ", this run as " + List(layout) + " (world, stage, unit sizes)");
    torch::serialize::InputArchive opt;
    archive->read("optimizer", opt);
    optimizer.load(opt);
    return Status::Ok();
  } catch (const c10::Error& e) {
    return Status::InvalidConfig("checkpoint '" + path + "': cannot restore the optimizer state: " +
                                 e.what_without_backtrace());
  }
}

Status SaveRankState(const std::string& path, const TrainState& state) {
  torch::serialize::OutputArchive archive;
  try {
    archive.write("meta", MetaTensor(state));
    archive.write("schedule", ScheduleTensor(state));
    archive.write("rng", at::detail::getDefaultCPUGenerator().get_state());
  } catch (const c10::Error& e) {
    return Status::IoError("serialising checkpoint " + path + ": " + e.what_without_backtrace());
  }
  return SaveArchive(archive, path);
}

StatusOr<TrainState> LoadRankState(const std::string& path, bool restore_rng) {
  LAUNCH_ASSIGN_OR_RETURN(auto archive, Open(path));
  try {
    torch::Tensor meta, schedule;
    archive->read("meta", meta);
    if (!archive->try_read("schedule", schedule)) schedule = torch::Tensor();
    if (restore_rng) {
      torch::Tensor rng;
      archive->read("rng", rng);
      at::Generator generator = at::detail::getDefaultCPUGenerator();  // shares the state
      generator.set_state(rng);
    }
    return FromMeta(meta, schedule);
  } catch (const c10::Error& e) {
    return Status::IoError("checkpoint '" + path +
                           "' is incomplete: " + e.what_without_backtrace());
  }
}

}  // namespace launch::trainer
