#include "trainer_runtime/state/file_sums.h"

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "base/files.h"
#include "base/test_util.h"
#include "trainer_runtime/util/doctest_torch.h"  // last (see there)

namespace launch::trainer {
namespace {

TEST_CASE("Sha256 matches FIPS 180-2's examples, streamed or whole") {
  Sha256 whole;
  whole.Update("abc");
  CHECK(whole.HexDigest() == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  Sha256 pieces;
  pieces.Update("abcdbcdecdefdefgefghfghighij");
  pieces.Update("hijkijkljklmklmnlmnomnopnopq");
  CHECK(pieces.HexDigest() == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("a recorded folder checks whole; a changed, missing or unlisted file is named") {
  const std::string dir = testing::MakeTempDir("file-sums-test");
  REQUIRE(MakeDirs(dir + "/pair1").ok());
  {
    RecordingWrites outer;
    {
      RecordingWrites written;
      for (const char* name : {"model.pt", "pair1/model.pt"}) {
        // Joined with an empty part, as a stage's folder name can be: still inside.
        const std::string path = dir + (name[0] == 'p' ? "/./" : "//") + name;
        REQUIRE(WriteFileAtomically(path, name).ok());
        Sha256 sha;
        sha.Update(name);
        RecordWrittenFile(path, sha.HexDigest());
      }
      CHECK(written.files().size() == 2);
      REQUIRE(WriteRankFileSums(dir, 0, written.files()).ok());
      CHECK(!WriteRankFileSums(dir, 1, {{"/elsewhere/x.pt", std::string(64, '0')}}).ok());
    }
    CHECK(outer.files().empty());  // the innermost scope records
  }
  REQUIRE(WriteFileAtomically(dir + "/run.txt", "seed: 1\n").ok());
  REQUIRE(WriteRankFileSums(dir, 1, {}).ok());
  REQUIRE(JoinFileSums(dir, 2, {"run.txt"}).ok());
  CHECK(!FileExists(RankFileSumsPath(dir, 0)));
  CHECK(!FileExists(RankFileSumsPath(dir, 1)));

  for (int parts : {1, 2, 3}) {
    size_t damaged = 0;
    for (int part = 0; part < parts; ++part) {
      const FileSumsCheck check = CheckFileSums(dir, part, parts);
      CHECK(check.listed);
      damaged += check.damage.size();
    }
    CHECK(damaged == 0);
  }
  REQUIRE(WriteFileAtomically(dir + "/pair1/model.pt", "pair1/model.pT").ok());
  REQUIRE(std::remove((dir + "/run.txt").c_str()) == 0);
  FileSumsCheck check = CheckFileSums(dir, 0, 1);
  REQUIRE(check.damage.size() == 2);
  CHECK(check.damage[0] == "run.txt: missing");
  CHECK(check.damage[1] == "pair1/model.pt: its contents differ from those committed (SHA-256)");

  // A list naming a path outside the folder is itself damage, never followed.
  REQUIRE(WriteFileAtomically(dir + "/SHA256SUMS", std::string(64, 'a') + "  ../x\n").ok());
  check = CheckFileSums(dir, 0, 2);
  REQUIRE(check.damage.size() == 1);
  CHECK(check.damage[0].find("malformed line") != std::string::npos);
  CHECK(CheckFileSums(dir, 1, 2).damage.empty());  // named once, by part 0

  REQUIRE(std::remove((dir + "/SHA256SUMS").c_str()) == 0);
  CHECK(!CheckFileSums(dir, 0, 1).listed);
  CHECK(std::system(("rm -rf " + dir).c_str()) == 0);
}

TEST_CASE("JoinFileSums names the rank whose list is missing") {
  const std::string dir = testing::MakeTempDir("file-sums-test");
  REQUIRE(WriteRankFileSums(dir, 0, {}).ok());
  const Status s = JoinFileSums(dir, 2, {});
  CHECK(!s.ok());
  CHECK(s.message().find("rank 1") != std::string::npos);
  CHECK(std::system(("rm -rf " + dir).c_str()) == 0);
}

}  // namespace
}  // namespace launch::trainer
