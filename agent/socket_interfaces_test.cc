#include "agent/socket_interfaces.h"

#include <doctest/doctest.h>

namespace launch::agent {
namespace {

// Host 1 of a two-host job whose name Debian's /etc/hosts maps to 127.0.1.1.
SocketInterfaceFacts StockHost() {
  SocketInterfaceFacts f;
  f.num_nodes = 2;
  f.master_addr = "10.215.3.1";
  f.hostname = "h1";
  f.hostname_addresses = {"127.0.1.1"};
  f.route = {"10.215.3.2", "eth0"};
  return f;
}

bool Mentions(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("StockHostGetsTheInterfaceOfTheRouteToTheMasterForGlooAndNccl") {
  SocketInterfaceExport e = ChooseSocketInterfaces(StockHost());
  CHECK(e.env == std::map<std::string, std::string>{{"GLOO_SOCKET_IFNAME", "eth0"},
                                                    {"NCCL_SOCKET_IFNAME", "eth0"}});
  CHECK(Mentions(e.message, "GLOO_SOCKET_IFNAME=eth0 NCCL_SOCKET_IFNAME=eth0"));
  CHECK(Mentions(e.message, "h1 resolves to 127.0.1.1 (loopback)"));
  CHECK(Mentions(e.message, "eth0 (10.215.3.2) is the route to MASTER_ADDR 10.215.3.1"));

  SocketInterfaceFacts nothing = StockHost();
  nothing.hostname_addresses.clear();
  e = ChooseSocketInterfaces(nothing);
  CHECK(e.env.size() == 2);
  CHECK(Mentions(e.message, "h1 resolves to nothing"));
}

TEST_CASE("TheUsersOwnSettingWinsVariableByVariable") {
  SocketInterfaceFacts f = StockHost();
  f.worker_env["GLOO_SOCKET_IFNAME"] = "ib0";
  SocketInterfaceExport e = ChooseSocketInterfaces(f);
  CHECK(e.env == std::map<std::string, std::string>{{"NCCL_SOCKET_IFNAME", "eth0"}});
  f.worker_env["NCCL_SOCKET_IFNAME"] = "ib0";
  e = ChooseSocketInterfaces(f);
  CHECK(e.env.empty());
  CHECK(e.message.empty());
  // Set but empty is unset, as PyTorch reads it.
  f.worker_env["GLOO_SOCKET_IFNAME"] = "";
  CHECK(ChooseSocketInterfaces(f).env.count("GLOO_SOCKET_IFNAME") == 1);
}

TEST_CASE("NothingIsExportedWherePyTorchsDefaultIsRight") {
  SocketInterfaceFacts f = StockHost();
  f.num_nodes = 1;
  CHECK(ChooseSocketInterfaces(f).env.empty());
  f = StockHost();
  f.master_addr = "127.0.0.1";  // every node on this host (loopback stand-ins)
  CHECK(ChooseSocketInterfaces(f).env.empty());
  f = StockHost();
  f.hostname_addresses = {"10.215.3.2"};  // the name resolves to a routable address
  SocketInterfaceExport e = ChooseSocketInterfaces(f);
  CHECK(e.env.empty());
  CHECK(e.message.empty());
}

TEST_CASE("NoInterfaceFoundSetsNothingAndSaysWhatToSet") {
  SocketInterfaceFacts f = StockHost();
  f.route = {};
  f.route_error = "no route to 10.215.3.1: Network is unreachable";
  SocketInterfaceExport e = ChooseSocketInterfaces(f);
  CHECK(e.env.empty());
  CHECK(Mentions(e.message, "Network is unreachable"));
  CHECK(Mentions(e.message, "set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME"));
  f = StockHost();
  f.route.interface = "";  // an address no interface holds
  e = ChooseSocketInterfaces(f);
  CHECK(e.env.empty());
  CHECK(Mentions(e.message, "leaves from 10.215.3.2, which no interface holds"));
}

TEST_CASE("ProbeAsksNoResolverForASingleNodeOrLoopbackMaster") {
  SocketInterfaceFacts f = ProbeSocketInterfaceFacts(2, "127.0.0.1", {{"A", "1"}});
  CHECK(f.hostname.empty());
  CHECK(f.route.address.empty());
  CHECK(f.worker_env.at("A") == "1");
}

}  // namespace
}  // namespace launch::agent
