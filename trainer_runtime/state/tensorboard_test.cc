#include "trainer_runtime/state/tensorboard.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "trainer_runtime/state/tensorboard_event.pb.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

// The records of an event file, each checked against its framing (lengths and masked CRCs).
std::vector<tensorboard::Event> ReadEvents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto u32 = [&](size_t at) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
    return v;
  };
  std::vector<tensorboard::Event> events;
  size_t at = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[at + i]);
    CHECK(u32(at + 8) == MaskedCrc32c(std::string_view(bytes.data() + at, 8)));
    REQUIRE(at + 12 + n + 4 <= bytes.size());
    const std::string data = bytes.substr(at + 12, n);
    CHECK(u32(at + 12 + n) == MaskedCrc32c(data));
    tensorboard::Event event;
    REQUIRE(event.ParseFromString(data));
    events.push_back(event);
    at += 12 + n + 4;
  }
  return events;
}

TEST_CASE("Crc32cIsCastagnolis") {
  CHECK(Crc32c("") == 0u);
  CHECK(Crc32c("123456789") == 0xE3069283u);  // the standard check value
  CHECK(Crc32c("a") == 0xC1D04330u);
}

TEST_CASE("EventFilesHoldTheScalarsInFramedRecords") {
  char tmpl[] = "/tmp/tensorboard-test-XXXXXX";
  REQUIRE(::mkdtemp(tmpl) != nullptr);
  const std::string dir = std::string(tmpl) + "/run/tensorboard";
  auto writer = EventFileWriter::Create(dir);
  REQUIRE_MESSAGE(writer.ok(), writer.status().ToString());
  CHECK((*writer)->path().find(dir + "/events.out.tfevents.") == 0);
  REQUIRE((*writer)->AddScalars(1, {{"train/loss", 2.5}, {"train/learning_rate", 1e-3}}).ok());
  REQUIRE((*writer)->AddScalars(2, {{"eval/accuracy", 0.75}}).ok());
  // Written through: the file is complete before the writer goes.
  const std::vector<tensorboard::Event> events = ReadEvents((*writer)->path());
  REQUIRE(events.size() == 3);
  CHECK(events[0].file_version() == "brain.Event:2");
  CHECK(events[0].wall_time() > 1.6e9);
  CHECK(events[1].step() == 1);
  REQUIRE(events[1].summary().value_size() == 2);
  CHECK(events[1].summary().value(0).tag() == "train/loss");
  CHECK(events[1].summary().value(0).simple_value() == 2.5f);
  CHECK(events[1].summary().value(1).simple_value() == 1e-3f);
  CHECK(events[2].step() == 2);
  CHECK(events[2].summary().value(0).tag() == "eval/accuracy");
  // A folder that cannot be made: IoError naming it.
  auto blocked = EventFileWriter::Create((*writer)->path() + "/sub");
  REQUIRE_FALSE(blocked.ok());
  CHECK(blocked.status().message().find((*writer)->path()) != std::string::npos);
  writer->reset();
  std::filesystem::remove_all(tmpl);
}

}  // namespace
}  // namespace launch::trainer
