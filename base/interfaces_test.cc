#include "base/interfaces.h"

#include <doctest/doctest.h>

namespace launch {
namespace {

const std::vector<InterfaceAddress> kHost = {{"lo", "127.0.0.1"},
                                             {"eth0", "10.215.3.2"},
                                             {"lo", "::1"},
                                             {"eth0", "fe80::1"},
                                             {"eth1", "192.168.7.4"}};

TEST_CASE("InterfaceHoldingFindsTheInterfaceOfAnAddress") {
  CHECK(InterfaceHolding(kHost, "10.215.3.2") == "eth0");
  CHECK(InterfaceHolding(kHost, "192.168.7.4") == "eth1");
  CHECK(InterfaceHolding(kHost, "127.0.0.1") == "lo");
  CHECK(InterfaceHolding(kHost, "::1") == "lo");
  // Compared as addresses, not as text.
  CHECK(InterfaceHolding(kHost, "::ffff:10.215.3.2") == "eth0");
  CHECK(InterfaceHolding(kHost, "FE80:0::1") == "eth0");
}

TEST_CASE("InterfaceHoldingIsEmptyForAnAddressNoInterfaceHolds") {
  CHECK(InterfaceHolding(kHost, "10.215.3.1").empty());
  CHECK(InterfaceHolding(kHost, "127.0.1.1").empty());  // in lo's range, not on it
  CHECK(InterfaceHolding(kHost, "eth0").empty());       // not an address
  CHECK(InterfaceHolding(kHost, "").empty());
  CHECK(InterfaceHolding({}, "10.215.3.2").empty());
}

TEST_CASE("InterfaceNamesListsEachNameOnceInOrder") {
  CHECK(InterfaceNames(kHost) == "lo, eth0, eth1");
  CHECK(InterfaceNames({}) == "none");
  CHECK(HasInterface(kHost, "eth1"));
  CHECK(AddressOf(kHost, "eth0") == "10.215.3.2");
  CHECK(AddressOf(kHost, "lo") == "127.0.0.1");
  CHECK(AddressOf(kHost, "eth2").empty());
  CHECK_FALSE(HasInterface(kHost, "eth"));
}

TEST_CASE("HostnameBindsLoopbackWhenItResolvesToNothingOrFirstToLoopback") {
  CHECK(HostnameBindsLoopback({}));
  CHECK(HostnameBindsLoopback({"127.0.1.1"}));  // Debian's /etc/hosts
  CHECK(HostnameBindsLoopback({"127.0.0.1", "10.0.0.2"}));
  CHECK(HostnameBindsLoopback({"::1"}));
  CHECK_FALSE(HostnameBindsLoopback({"10.0.0.2"}));
  CHECK_FALSE(HostnameBindsLoopback({"10.0.0.2", "127.0.1.1"}));
}

// The kernel's answers on this machine: loopback routes from loopback, and the interface found
// is one getifaddrs lists.
TEST_CASE("RouteToLoopbackLeavesFromLoopback") {
  StatusOr<Route> route = RouteTo("127.0.0.1");
  REQUIRE(route.ok());
  CHECK(route->address == "127.0.0.1");
  CHECK(route->interface == "lo");
  CHECK(HasInterface(ListInterfaceAddresses(), "lo"));
}

TEST_CASE("RouteToAnUnresolvableNameIsNotFoundNamingIt") {
  StatusOr<Route> route = RouteTo("no-such-host.invalid");
  REQUIRE_FALSE(route.ok());
  CHECK(route.status().code() == Status::Code::kNotFound);
  CHECK(route.status().message().find("no-such-host.invalid") != std::string::npos);
  CHECK(ResolveHost("no-such-host.invalid").empty());
  CHECK(ResolveHost("127.0.0.1") == std::vector<std::string>{"127.0.0.1"});
}

}  // namespace
}  // namespace launch
