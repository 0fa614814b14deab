#include "trainer_runtime/util/env.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <limits>

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

// Reads `name` into `out` when set, as an integer in [min_value, max_value].
Status ReadBounded(const std::map<std::string, std::string>& env, const char* name,
                   long long min_value, long long max_value, long long* out) {
  std::string text;
  if (Find(env, {name}, &text).empty()) return Status::Ok();
  long long v = 0;
  if (!ParseInt64(Trim(text), &v) || v < min_value || v > max_value)
    return Status::InvalidConfig(std::string("environment ") + name +
                                 ": expected an integer from " + std::to_string(min_value) +
                                 " to " + std::to_string(max_value) + ", got '" + text + "'");
  *out = v;
  return Status::Ok();
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

StatusOr<Tuning> ParseTuning(const std::map<std::string, std::string>& env) {
  Tuning t;
  long long v = t.gloo_threads;
  LAUNCH_RETURN_IF_ERROR(ReadBounded(env, "LAUNCH_GLOO_THREADS", 1, 64, &v));
  t.gloo_threads = static_cast<int>(v);
  std::string text;
  if (!Find(env, {"LAUNCH_SHM_ALLREDUCE"}, &text).empty()) {
    const std::string s = ToLower(Trim(text));
    if (s == "0" || s == "false" || s == "off")
      t.shm_allreduce = false;
    else if (s == "1" || s == "true" || s == "on")
      t.shm_allreduce = true;
    else
      return Status::InvalidConfig(
          "environment LAUNCH_SHM_ALLREDUCE: expected 0, false, off (shared memory off) or 1, "
          "true, on, got '" +
          text + "'");
  }
  // At most 1 TiB, so that the shift below cannot overflow.
  v = static_cast<long long>(t.ddp_exchange_max_bytes >> 10);
  LAUNCH_RETURN_IF_ERROR(ReadBounded(env, "LAUNCH_DDP_EXCHANGE_MAX_KB", 0, 1LL << 30, &v));
  t.ddp_exchange_max_bytes = static_cast<size_t>(v) << 10;
  v = t.dp_threads_per_replica;  // 0 (unset) stays 0: the default split
  LAUNCH_RETURN_IF_ERROR(ReadBounded(env, "LAUNCH_DP_THREADS_PER_REPLICA", 1, 256, &v));
  t.dp_threads_per_replica = static_cast<int>(v);
  return t;
}

StatusOr<DistEnv> ParseDistEnv(const std::map<std::string, std::string>& env) {
  DistEnv d;
  LAUNCH_ASSIGN_OR_RETURN(d.tuning, ParseTuning(env));
  if (auto it = env.find("CUDA_VISIBLE_DEVICES"); it != env.end())
    d.cuda_visible_devices = it->second;
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
  if (!Find(env, {"LAUNCH_TEST_SHARE_GPU"}, &text).empty()) d.test_share_gpu = Trim(text) == "1";
  if (!Find(env, {"LAUNCH_CONSOLE_TTY"}, &text).empty()) d.console_tty = Trim(text) == "1";
  if (!Find(env, {"LAUNCH_RECOVER"}, &text).empty()) {
    const std::string mode = Trim(text);
    if (mode != "in_place" && mode != "restart" && !mode.empty())
      return Status::InvalidConfig(
          "environment LAUNCH_RECOVER: expected in_place or restart, got '" + text + "'");
    d.recover_in_place = mode == "in_place";
  }
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"LAUNCH_RECOVER_GENERATION"}, 0, &d.recover_generation));
  LAUNCH_RETURN_IF_ERROR(ReadInt(env, {"LAUNCH_RECOVER_WAIT_S"}, 1, &d.recover_wait_s));
  LAUNCH_RETURN_IF_ERROR(ReadBounded(env, "LAUNCH_RECOVER_LOST_AT_MS", 1,
                                     std::numeric_limits<long long>::max(), &d.recover_lost_at_ms));
  // Only printed: printable and short, or not at all.
  if (!Find(env, {"LAUNCH_RECOVER_LOST_BY"}, &text).empty() && text.size() <= 100 &&
      std::all_of(text.begin(), text.end(), [](char c) { return c >= 0x20 && c < 0x7f; }))
    d.recover_lost_by = text;
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

bool IsSpare() {
  const char* spare = std::getenv("LAUNCH_SPARE");
  return spare != nullptr && std::string(spare) == "1";
}

StatusOr<bool> AwaitSpareAssignment() {
  if (!IsSpare()) return true;
  std::string text;
  char buf[4096];
  while (text.size() < 2 || text.compare(text.size() - 2, 2, "\n\n") != 0) {
    const ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::FromErrno("a spare reading its assignment from stdin", errno);
    if (n == 0) {
      if (text.empty()) return false;  // let go: the job needs no spare any more
      return Status::IoError("a spare's assignment ended before its empty line (" +
                             std::to_string(text.size()) + " bytes)");
    }
    text.append(buf, static_cast<size_t>(n));
  }
  for (const std::string& line : Split(text, '\n')) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos || eq == 0) continue;
    ::setenv(line.substr(0, eq).c_str(), line.substr(eq + 1).c_str(), 1);
  }
  ::unsetenv("LAUNCH_SPARE");
  return true;
}

}  // namespace launch::trainer
