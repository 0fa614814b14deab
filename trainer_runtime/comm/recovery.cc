#include "trainer_runtime/comm/recovery.h"

#include <thread>
#include <vector>

#include "base/strings.h"

namespace launch::trainer {
namespace {

std::vector<uint8_t> Bytes(const std::string& text) { return {text.begin(), text.end()}; }

// `value` of kGenerationKey as a number; IoError naming it when it is none.
StatusOr<int64_t> ParseGeneration(const std::vector<uint8_t>& value) {
  long long generation = 0;
  const std::string text(value.begin(), value.end());
  if (!ParseInt64(text, &generation))
    return Status::IoError(std::string("the store's ") + kGenerationKey + " is not a number: '" +
                           text + "'");
  return static_cast<int64_t>(generation);
}

// Counts the ranks that arrived at a generation (store.add: one atomic step each).
std::string ArrivedKey(int64_t generation) {
  return "launch_recover/g" + std::to_string(generation) + "/arrived";
}

}  // namespace

StatusOr<int64_t> AnnouncedGeneration(c10d::Store& store) {
  // check() does not block, unlike get().
  if (!store.check({kGenerationKey})) return 0;
  return ParseGeneration(store.get(kGenerationKey));
}

std::string GroupNameIn(const std::string& base, int generation) {
  return generation == 0 ? base : base + ".g" + std::to_string(generation);
}

std::string WorldGroupName(int generation) { return GroupNameIn("world", generation); }

namespace {

// Writes `mine` at `key` unless the value there already `holds` (a missing key never does):
// both the generation and the first notice of a loss only ever move one way. compareSet writes
// only over the value read (an empty one matches a missing key) and otherwise returns the value
// that won; each retry follows another writer's change, so the loop ends within a few turns.
// The store's failures throw.
Status WriteUnlessHeld(c10d::Store& store, const std::string& key, const std::vector<uint8_t>& mine,
                       const std::function<StatusOr<bool>(const std::vector<uint8_t>&)>& holds) {
  std::vector<uint8_t> seen;
  if (store.check({key})) seen = store.get(key);
  for (int turn = 0; turn < 1000; ++turn) {
    if (!seen.empty()) {
      LAUNCH_ASSIGN_OR_RETURN(const bool held, holds(seen));
      if (held) return Status::Ok();
    }
    std::vector<uint8_t> now = store.compareSet(key, seen, mine);
    if (now == mine) return Status::Ok();
    seen = std::move(now);
  }
  return Status::IoError("the store's " + key + " kept changing");
}

std::string LossKey(int generation) {
  return "launch_recover/g" + std::to_string(generation) + "/noticed";
}

// "<milliseconds since the epoch> <by>".
std::optional<LossNotice> ParseNotice(const std::vector<uint8_t>& value) {
  const std::string text(value.begin(), value.end());
  const size_t space = text.find(' ');
  long long ms = 0;
  if (space == std::string::npos || !ParseInt64(text.substr(0, space), &ms)) return std::nullopt;
  return LossNotice{std::chrono::system_clock::time_point(std::chrono::milliseconds(ms)),
                    text.substr(space + 1)};
}

}  // namespace

Status AnnounceGeneration(c10d::Store& store, int generation) {
  const std::string what = "announcing recovery generation " + std::to_string(generation);
  try {
    // The key only grows: a replacement that starts after a newer one (two ranks lost at once,
    // their replacements racing) leaves it.
    return WriteUnlessHeld(store, kGenerationKey, Bytes(std::to_string(generation)),
                           [&](const std::vector<uint8_t>& seen) -> StatusOr<bool> {
                             LAUNCH_ASSIGN_OR_RETURN(const int64_t current, ParseGeneration(seen));
                             return current >= generation;
                           })
        .WithContext(what);
  } catch (const std::exception& e) {
    return Status::IoError(what + " in the store: " + e.what());
  }
}

Status NoteLoss(c10d::Store& store, int generation, const LossNotice& notice) {
  const long long ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(notice.at.time_since_epoch()).count();
  try {
    // The earliest notice stays.
    return WriteUnlessHeld(store, LossKey(generation), Bytes(std::to_string(ms) + " " + notice.by),
                           [&](const std::vector<uint8_t>& seen) -> StatusOr<bool> {
                             const std::optional<LossNotice> other = ParseNotice(seen);
                             return other && other->at <= notice.at;
                           })
        .WithContext("noting a loss");
  } catch (const std::exception& e) {
    return Status::IoError("noting a loss in the store: " + std::string(e.what()));
  }
}

std::optional<LossNotice> FirstNoticedLoss(c10d::Store& store, int generation) {
  const std::string key = LossKey(generation);
  try {
    if (!store.check({key})) return std::nullopt;
    return ParseNotice(store.get(key));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

StatusOr<int> JoinGeneration(c10d::Store& store, int at_least, int world_size,
                             std::chrono::milliseconds timeout, const std::function<bool()>& stop) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int64_t joined = 0;   // the generation this rank counted itself in at (0: none yet)
  int64_t arrived = 0;  // how many had arrived there when last asked
  try {
    for (;;) {
      // The count before the key: once everyone arrived at `joined`, that generation forms,
      // even if a newer one was announced since (a loss after that is a recovery of its own).
      if (joined > 0) {
        arrived = store.add(ArrivedKey(joined), 0);
        if (arrived >= world_size) return static_cast<int>(joined);
      }
      LAUNCH_ASSIGN_OR_RETURN(const int64_t newest, AnnouncedGeneration(store));
      if (newest >= at_least && newest > joined) {
        // A newer generation than the one this rank waits in: it will fill up, not this one.
        joined = newest;
        arrived = store.add(ArrivedKey(joined), 1);
        if (arrived >= world_size) return static_cast<int>(joined);
      }
      if (stop && stop()) return Status::Interrupted("stopped while waiting for a replacement");
      if (std::chrono::steady_clock::now() >= deadline) {
        const std::string waited = std::to_string(timeout.count() / 1000) + " s";
        if (joined == 0) return Status::Timeout("no replacement joined within " + waited);
        return Status::Timeout("the group of recovery generation " + std::to_string(joined) +
                               " did not fill within " + waited + ": " + std::to_string(arrived) +
                               " of " + std::to_string(world_size) + " ranks arrived");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  } catch (const std::exception& e) {
    return Status::IoError(std::string("waiting for a replacement in the store: ") + e.what());
  }
}

}  // namespace launch::trainer
