#include "config/hostfile.h"

#include <doctest/doctest.h>

namespace launch::config {

TEST_CASE("HostfileReadsDeepSpeedLinesCommentsAndBlankLines") {
  auto hosts =
      ParseHostfile("# cluster\nworker-1 slots=4   # gpus\n\n\tuser@worker-2\tslots=2\n", "h");
  REQUIRE(hosts.ok());
  REQUIRE(hosts->size() == 2);
  CHECK((*hosts)[0].host == "worker-1");
  CHECK((*hosts)[0].slots == 4);
  CHECK((*hosts)[0].where == "h:2");
  CHECK((*hosts)[1].host == "user@worker-2");
  CHECK((*hosts)[1].slots == 2);
}

TEST_CASE("HostfileErrorsNameFileAndLine") {
  CHECK(ParseHostfile("a slots=2\nb\n", "h").status().message() ==
        "h:2: expected `HOST slots=N`, got 'b'");
  CHECK(ParseHostfile("a slots=-1\n", "h").status().message() ==
        "h:1: slots must be an integer from 1 to 4096, got '-1'");
  CHECK(ParseHostfile("a slots=2\nx@A slots=1\n", "h").status().message() ==
        "h:2: host 'x@A' is already listed at h:1 (give one line per host with all its slots)");
  CHECK(ParseHostfile("\n# none\n", "h").status().message() ==
        "h:2: no host in the file (expected `HOST slots=N` lines)");
  CHECK(!ParseHostfile("-oProxyCommand=x slots=1\n", "h").ok());
}

TEST_CASE("HostListIsHorovodsDashH") {
  auto hosts = ParseHostList("h1:2, h2");
  REQUIRE(hosts.ok());
  REQUIRE(hosts->size() == 2);
  CHECK((*hosts)[0].slots == 2);
  CHECK((*hosts)[1].host == "h2");
  CHECK((*hosts)[1].slots == 1);  // Horovod's default
  CHECK(ParseHostList("h1:0").status().message() ==
        "entry 1 ('h1:0'): slots must be an integer from 1 to 4096, got '0'");
  CHECK(!ParseHostList("h1:2,,h2:2").ok());
}

}  // namespace launch::config
