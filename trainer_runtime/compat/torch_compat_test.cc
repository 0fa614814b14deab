// The LibTorch compatibility layer (torch_compat.h) on whichever LibTorch this build uses: each
// function does the same observable thing on 1.13 and 2.x.

#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/version.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "trainer_runtime/compat/torch_compat.h"
#include "trainer_runtime/util/doctest_torch.h"  // last: after every torch header

namespace launch::trainer {
namespace {

TEST_CASE("CompatReportsTheLibTorchItWasBuiltWith") {
  const std::string version = compat::LibTorchVersion();
  CHECK(version.rfind(
            std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ".",
            0) == 0);
}

TEST_CASE("CompatErrorCarriesTheMessageAloneAndRethrowsAsC10Error") {
  const c10::Error error = compat::MakeError("rank 1 exited with signal 9");
  // No backtrace and no source location: the message is what users read (1.13's what() adds
  // one newline, where its empty backtrace string goes).
  CHECK(error.msg() == "rank 1 exited with signal 9");
  std::string what = error.what();
  if (!what.empty() && what.back() == '\n') what.pop_back();
  CHECK(what == "rank 1 exited with signal 9");
  std::exception_ptr ptr = compat::ErrorPtr("peer gone");
  CHECK_THROWS_WITH_AS(std::rethrow_exception(ptr), doctest::Contains("peer gone"), c10::Error);
}

TEST_CASE("CompatTcpStoreServesItsOwnClients") {
  c10d::TCPStoreOptions server_options;
  server_options.port = 0;  // any free port
  server_options.isServer = true;
  server_options.waitWorkers = false;
  server_options.timeout = std::chrono::seconds(10);
  auto server = compat::NewTcpStore("127.0.0.1", server_options);
  c10d::TCPStoreOptions client_options;
  client_options.port = server->getPort();
  client_options.waitWorkers = false;
  client_options.timeout = std::chrono::seconds(10);
  auto client = compat::NewTcpStore("127.0.0.1", client_options);
  client->set("key", std::vector<uint8_t>{1, 2, 3});
  CHECK((server->get("key") == std::vector<uint8_t>{1, 2, 3}));
  CHECK(client->add("counter", 5) == 5);
  CHECK(server->add("counter", 2) == 7);
}

TEST_CASE("CompatProcessGroupRunsGlooCollectivesOnCpuTensors") {
  // Two ranks on threads of this process, meeting through one in-memory store.
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<at::Tensor> sums(2), gathered(2), broadcast(2);
  std::vector<std::string> backends(2);
  std::vector<std::string> errors(2);
  auto rank_main = [&](int rank) {
    try {
      compat::GroupOptions options;
      options.timeout = std::chrono::seconds(30);
      options.gloo_device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
      options.gloo_threads = 1;
      auto group = compat::NewProcessGroup(store, rank, 2, options);
      backends[rank] = group->getBackendName();
      CHECK(group->getRank() == rank);
      CHECK(group->getSize() == 2);

      std::vector<at::Tensor> t = {at::full({5}, static_cast<double>(rank + 1), at::kDouble)};
      group->allreduce(t)->wait();
      sums[rank] = t[0];

      std::vector<at::Tensor> in = {at::full({2}, static_cast<float>(10 * rank))};
      std::vector<std::vector<at::Tensor>> out = {{at::empty({2}), at::empty({2})}};
      group->allgather(out, in)->wait();
      gathered[rank] = at::cat(out[0]);

      std::vector<at::Tensor> b = {at::full({3}, static_cast<float>(rank == 0 ? 42 : -1))};
      c10d::BroadcastOptions root;
      root.rootRank = 0;
      group->broadcast(b, root)->wait();
      broadcast[rank] = b[0];
      group->barrier()->wait();
    } catch (const std::exception& e) {
      errors[rank] = e.what();
    }
  };
  std::thread peer(rank_main, 1);
  rank_main(0);
  peer.join();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    REQUIRE(errors[r] == "");
    CHECK(backends[r] == "gloo");
    CHECK(at::equal(sums[r], at::full({5}, 3.0, at::kDouble)));
    CHECK(at::equal(gathered[r], at::tensor({0.f, 0.f, 10.f, 10.f})));
    CHECK(at::equal(broadcast[r], at::full({3}, 42.f)));
  }
}

TEST_CASE("CompatCpuAutocastSetsAndRestoresThisThreadsState") {
  const bool was_enabled = compat::AutocastEnabled(at::kCPU);
  const at::ScalarType was_dtype = compat::AutocastDtype(at::kCPU);
  compat::SetAutocast(at::kCPU, true, at::kBFloat16);
  CHECK(compat::AutocastEnabled(at::kCPU));
  CHECK((compat::AutocastDtype(at::kCPU) == at::kBFloat16));
  // Another thread's state is its own.
  bool other_enabled = true;
  std::thread([&] { other_enabled = compat::AutocastEnabled(at::kCPU); }).join();
  CHECK_FALSE(other_enabled);
  compat::SetAutocast(at::kCPU, was_enabled, was_dtype);
  CHECK(compat::AutocastEnabled(at::kCPU) == was_enabled);
  CHECK((compat::AutocastDtype(at::kCPU) == was_dtype));
}

TEST_CASE("CompatHasNcclOnlyWhereLibTorchHasCuda") {
#if defined(USE_C10D_NCCL)
  CHECK(compat::HasNccl() == (TORCH_VERSION_MAJOR >= 2));
#else
  CHECK_FALSE(compat::HasNccl());
#endif
}

}  // namespace
}  // namespace launch::trainer
