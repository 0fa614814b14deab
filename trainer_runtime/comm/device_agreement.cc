#include "trainer_runtime/comm/device_agreement.h"

#include <map>
#include <string>

#include <ATen/ATen.h>

#include "trainer_runtime/compat/torch_compat.h"

namespace launch::trainer {
namespace {

std::string KindName(int64_t code) {
  if (code == static_cast<int64_t>(DeviceKind::kCpu)) return ToString(DeviceKind::kCpu);
  if (code == static_cast<int64_t>(DeviceKind::kCuda)) return ToString(DeviceKind::kCuda);
  return "an unknown device (code " + std::to_string(code) + ")";
}

// "rank 3", "ranks 0-2, 5".
std::string RankList(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!text.empty()) text += ", ";
    text += std::to_string(ranks[i]);
    if (j > i) text += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + text;
}

}  // namespace

Status DeviceKindsAgree(const std::vector<int64_t>& kinds, int rank, const Platform& platform) {
  std::map<int64_t, std::vector<int>> by_kind;
  for (size_t r = 0; r < kinds.size(); ++r) by_kind[kinds[r]].push_back(static_cast<int>(r));
  if (by_kind.size() <= 1) return Status::Ok();
  std::string groups;
  for (const auto& [code, ranks] : by_kind)
    groups += (groups.empty() ? "" : ", ") + RankList(ranks) + " on " + KindName(code);
  std::string self = ToString(platform.device_kind());
  if (!platform.is_cuda()) self += ", " + platform.why_cpu();
  return Status::InvalidConfig("ranks disagree on their device: " + groups + " (this rank, " +
                               std::to_string(rank) + ": " + self + "; " +
                               platform.facts().Describe() +
                               "); every rank must see its GPU (check CUDA_VISIBLE_DEVICES and "
                               "the GPUs on each node), or run launch --cpu");
}

Status CheckDeviceKindsAgree(c10d::ProcessGroup& group, const Platform& platform) {
  const int rank = group.getRank();
  std::vector<int64_t> kinds;
  try {
    // One slot per rank, so that the sum tells every rank what each one is on.
    at::Tensor codes = at::zeros({group.getSize()}, at::kLong);
    codes[rank] = static_cast<int64_t>(platform.device_kind());
    std::vector<at::Tensor> tensors = {codes};
    group.allreduce(tensors)->wait();
    const int64_t* data = codes.data_ptr<int64_t>();
    kinds.assign(data, data + codes.numel());
  } catch (const std::exception& e) {
    return Status::IoError("rank " + std::to_string(rank) +
                           ": comparing the ranks' devices failed: " + compat::ErrorText(e));
  }
  return DeviceKindsAgree(kinds, rank, platform);
}

}  // namespace launch::trainer
