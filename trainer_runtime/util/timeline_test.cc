// Timeline's files read back with a JSON parser (plain C++: this binary links no LibTorch).

#include "trainer_runtime/util/timeline.h"

#include <stdlib.h>
#include <unistd.h>

#include <string>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "base/files.h"
#include "base/test_util.h"

namespace launch::trainer {
namespace {

using nlohmann::json;

json Parse(const std::string& path) {
  StatusOr<std::string> text = ReadFile(path);
  REQUIRE(text.ok());
  const json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  REQUIRE_FALSE(j.is_discarded());
  return j;
}

TEST_CASE("TimelineNamesRoundTripThroughWriteRankAndMerge") {
  // A quote, a backslash, control characters, brackets, non-ASCII and an emoji.
  const std::string name = "bucket \"0\" \\ [x]\x01\t\n\x1f \xC3\xA9 \xF0\x9F\x98\x80";
  const std::string track = "comm \"\\\x02";
  Timeline& timeline = Timeline::Get();
  timeline.Configure(/*rank=*/3, /*from_step=*/1, /*steps=*/1);
  timeline.BeginStep(1);
  const auto start = Timeline::Clock::now();
  timeline.Span("train", name, start, start + std::chrono::microseconds(5));
  timeline.EndAsync(timeline.BeginAsync(track.c_str(), name));
  timeline.EndStep();

  const std::string dir = testing::MakeTempDir("timeline-test");
  REQUIRE(timeline.WriteRank(dir + "/rank3.json").ok());
  REQUIRE(WriteFileAtomically(dir + "/empty.json", "[]\n").ok());
  REQUIRE(Timeline::Merge({dir + "/empty.json", dir + "/rank3.json"}, dir + "/timeline.json").ok());

  const json events = Parse(dir + "/timeline.json");
  CHECK(events == Parse(dir + "/rank3.json"));
  REQUIRE(events.is_array());
  REQUIRE(events.size() == 5);  // two metadata events, the span, the async begin and end
  CHECK(events[0]["args"]["name"] == "rank 3");
  CHECK(events[1]["args"]["sort_index"] == 3);
  CHECK(events[2]["ph"] == "X");
  CHECK(events[2]["tid"] == "train");
  CHECK(events[2]["name"].get<std::string>() == name);
  CHECK(events[2]["dur"] == 5);
  for (int i : {3, 4}) {
    CHECK(events[i]["ph"] == (i == 3 ? "b" : "e"));
    CHECK(events[i]["pid"] == 3);
    CHECK(events[i]["tid"].get<std::string>() == track);
    CHECK(events[i]["cat"].get<std::string>() == track);
    CHECK(events[i]["name"].get<std::string>() == name);
    CHECK(events[i]["id"] == events[3]["id"]);
  }
  for (const char* file : {"rank3.json", "empty.json", "timeline.json"})
    ::unlink((dir + "/" + file).c_str());
  ::rmdir(dir.c_str());
}

TEST_CASE("TimelineMergeRejectsAFileThatIsNoArray") {
  const std::string dir = testing::MakeTempDir("timeline-test");
  REQUIRE(WriteFileAtomically(dir + "/rank0.json", "{\"ph\": \"X\"}\n").ok());
  const Status s = Timeline::Merge({dir + "/rank0.json"}, dir + "/timeline.json");
  CHECK(s.code() == Status::Code::kIoError);
  CHECK(s.message().find(dir + "/rank0.json") != std::string::npos);
  CHECK_FALSE(FileExists(dir + "/timeline.json"));
  ::unlink((dir + "/rank0.json").c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace launch::trainer
