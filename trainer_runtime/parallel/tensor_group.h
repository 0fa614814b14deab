#pragma once

// The tensor group of model/tensor_parallel.h over a process group: this rank's group along the
// layout's tensor axis (layout.h), whose ranks split each layer's weights, or along its context
// axis, whose ranks split each sequence.
//
// Sums go through the group's all-reduce (shared memory when its ranks share a host), gathers,
// reduce-scatters and all-to-alls through its flat collectives (process_group.h); a
// reduced-precision tensor (bf16 under autocast) is summed in float32 and rounded once, as Gloo
// cannot add bf16 on every LibTorch. Every operation waits for its result: the layers need it at
// once.
//
// Internal to trainer_runtime (includes LibTorch).

#include "trainer_runtime/comm/process_group.h"
#include "trainer_runtime/model/tensor_parallel.h"

namespace launch::trainer {

// Null for a null group (one rank: the layers are whole).
TensorGroupPtr ProcessTensorGroup(c10::intrusive_ptr<CountingProcessGroup> pg);

// In-place recovery: `group` (ProcessTensorGroup's) goes on over `pg`, its group re-formed in a
// new generation, so the layers and strategies that hold `group` keep it. Call between steps
// (no forward or backward running). REQUIRES: `group` came from ProcessTensorGroup, `pg` has
// its size and this rank's place.
void ReformTensorGroup(const TensorGroupPtr& group, c10::intrusive_ptr<CountingProcessGroup> pg);

}  // namespace launch::trainer
