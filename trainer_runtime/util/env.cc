#include "trainer_runtime/util/env.h"

#include "base/strings.h"

namespace launch::trainer {
namespace {

// Looks up the first of `names` that is set; returns the name used (empty when none).
std::string Find(const std::map<std::string, std::string>& env,
                 std::initializer_list<const char*> names, std::string* value) {
  for (const char* name : names) {
    auto it = env.find(name);
    if (it != env.end() && !it->second.empty()) {
      *value = it->second;
      return name;
    }
  }
  return "";
}

Status ReadInt(const std::map<std::string, std::string>& env,
               std::initializer_list<const char*> names, int min_value, int* out,
               bool* found = nullptr) {
  std::string text;
  std::string name = Find(env, names, &text);
  if (found) *found = !name.empty();
  if (name.empty()) return Status::Ok();
  long long v = 0;
  if (!ParseInt64(Trim(text), &v) || v < min_value || v > (1 << 30))
    return Status::InvalidConfig("environment " + name + ": expected an integer >= " +
                                 std::to_string(min_value) + ", got '" + text + "'");
  *out = static_cast<int>(v);
  return Status::Ok();
}

}  // namespace

std::string DistEnv::Describe() const {
  return "rank " + std::to_string(rank) + "/" + std::to_string(world_size) + " (local " +
         std::to_string(local_rank) + ") store " + master_addr + ":" + std::to_string(master_port);
}

StatusOr<DistEnv> ParseDistEnv(const std::map<std::string, std::string>& env) {
  DistEnv d;
  bool has_rank = false, has_world = false;
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"},
                                 0, &d.rank, &has_rank));
  LAUNCH_RETURN_IF_ERROR(ReadInt(env,
                                 {"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"},
                                 1, &d.world_size, &has_world));
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"},
                                 0, &d.local_rank));
  d.local_world_size = d.world_size;
  LAUNCH_RETURN_IF_ERROR(
      ReadInt(env, {"LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"}, 1, &d.local_world_size));
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"MASTER_PORT"}, 1, &d.master_port));
  if (d.master_port > 65535)
    return Status::InvalidConfig("environment MASTER_PORT: " + std::to_string(d.master_port) +
                                 " is not a TCP port");
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"TORCHELASTIC_RESTART_COUNT"}, 0, &d.restart_count));
  std::string text;
  if (!Find(env, {"MASTER_ADDR"}, &text).empty()) d.master_addr = Trim(text);
  if (!Find(env, {"TORCHELASTIC_RUN_ID"}, &text).empty()) d.run_id = text;
  if (!Find(env, {"TORCHELASTIC_USE_AGENT_STORE"}, &text).empty())
    d.use_agent_store = ToLower(Trim(text)) == "true" || Trim(text) == "1";
  if (!Find(env, {"ACCELERATE_USE_CPU"}, &text).empty())
    d.use_cpu = ToLower(Trim(text)) == "true" || Trim(text) == "1";
  if (!Find(env, {"LAUNCH_RECOVER"}, &text).empty()) {
    const std::string mode = Trim(text);
    if (mode != "in_place" && mode != "restart" && !mode.empty())
      return Status::InvalidConfig(
          "environment LAUNCH_RECOVER: expected in_place or restart, got '" + text + "'");
    d.recover_in_place = mode == "in_place";
  }
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"LAUNCH_RECOVER_GENERATION"}, 0, &d.recover_generation));
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"LAUNCH_RECOVER_WAIT_S"}, 1, &d.recover_wait_s));
  d.from_launcher = has_rank || has_world;
  if (has_rank != has_world)
    return Status::InvalidConfig(
        std::string("environment: ") +
        (has_rank ? "RANK is set but WORLD_SIZE is not" : "WORLD_SIZE is set but RANK is not") +
        " (start workers with `launch` or torchrun)");
  if (d.rank >= d.world_size)
    return Status::InvalidConfig("environment RANK: " + std::to_string(d.rank) +
                                 " is not below WORLD_SIZE " + std::to_string(d.world_size));
  return d;
}

}  // namespace launch::trainer
