#include "trainer_runtime/comm/recovery.h"

#include <thread>

#include "base/strings.h"
#include "trainer_runtime/comm/shm_common.h"

namespace launch::trainer {

std::string WorldGroupName(int generation) {
  return generation == 0 ? "world" : "world.g" + std::to_string(generation);
}

Status AnnounceGeneration(c10d::Store& store, int generation) {
  try {
    // Last writer wins: replacements start one after the other, each with a higher number.
    shm::StoreSet(store, kGenerationKey, std::to_string(generation));
    return Status::Ok();
  } catch (const std::exception& e) {
    return Status::IoError("announcing recovery generation " + std::to_string(generation) +
                           " in the store: " + e.what());
  }
}

StatusOr<int> WaitForGeneration(c10d::Store& store, int after, std::chrono::milliseconds timeout,
                                const std::function<bool()>& stop) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  try {
    for (;;) {
      // check() does not block, unlike get(): the loop stays responsive to `stop`.
      if (store.check({kGenerationKey})) {
        long long generation = 0;
        const std::string text = shm::StoreGet(store, kGenerationKey);
        if (!ParseInt64(text, &generation))
          return Status::IoError(std::string("the store's ") + kGenerationKey +
                                 " is not a number: '" + text + "'");
        if (generation > after) return static_cast<int>(generation);
      }
      if (stop && stop()) return Status::Interrupted("stopped while waiting for a replacement");
      if (std::chrono::steady_clock::now() >= deadline)
        return Status::Timeout("no replacement joined within " +
                               std::to_string(timeout.count() / 1000) + " s");
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  } catch (const std::exception& e) {
    return Status::IoError(std::string("waiting for a replacement in the store: ") + e.what());
  }
}

}  // namespace launch::trainer
