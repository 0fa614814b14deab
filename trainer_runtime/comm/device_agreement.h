#pragma once

// Whether the ranks of a job compute on the same kind of device. Each rank decides its own
// Platform (compat/platform.h) from what its process sees; a job whose ranks decided differently
// (one on cuda:0 with NCCL, another on the CPU with Gloo, after a CUDA_VISIBLE_DEVICES that
// differs between nodes, or a node without GPUs) would wait forever in its first collective of
// device tensors. This check, at start, turns that into an error naming the ranks.
//
// Internal to trainer_runtime (includes LibTorch).

#include <cstdint>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "base/status.h"
#include "trainer_runtime/compat/platform.h"

namespace launch::trainer {

// All-reduces (sum, on CPU tensors: the group's Gloo, whatever the ranks' devices) a vector of
// the group's size in which this rank writes platform.device_kind() at its own index, then
// checks it with DeviceKindsAgree. COLLECTIVE over `group`: every rank calls it once at the same
// point, before any tensor of the device travels (after the world group formed; not when an
// in-place recovery's replacement joins survivors that are past it). Pass the group that carries
// control traffic (CountingProcessGroup::inner(), so that no step's counts see it).
// OK when every rank is on the same kind; InvalidConfig as DeviceKindsAgree says; IoError
// naming the check when the all-reduce fails (a peer died), with the backend's message.
Status CheckDeviceKindsAgree(c10d::ProcessGroup& group, const Platform& platform);

// The verdict on `kinds` (rank r's DeviceKind as an integer at index r, 0 where a rank wrote
// nothing), seen from rank `rank` on `platform`: OK when all are equal; otherwise InvalidConfig
// "ranks disagree on their device: ranks 0-1 on cuda, ranks 2-3 on cpu (this rank, 2: cpu, no
// CUDA device visible; <facts>); every rank must see its GPU (check CUDA_VISIBLE_DEVICES and
// the GPUs on each node), or run launch --cpu".
Status DeviceKindsAgree(const std::vector<int64_t>& kinds, int rank, const Platform& platform);

}  // namespace launch::trainer
