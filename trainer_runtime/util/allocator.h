#pragma once

// The C allocator's trade between a worker's speed and its memory between steps.
//
// glibc gives memory back to the kernel as soon as it is freed: the top of the heap above
// M_TRIM_THRESHOLD, and every chunk above M_MMAP_THRESHOLD (which it raises only as far as
// 32 MiB). A training step frees its activations and gradients' temporaries and the next step
// allocates the same sizes again, so every step faulted its pages back in, page by page: for a
// 3.3M-parameter transformer in one process (batch 8 x 128 tokens, one thread) 20,000 page faults
// a step and 60% of its time (scripts/bench/tensor_parallel). A Python training loop escapes
// most of it by luck: the interpreter's small objects pin the heap's top.
//
// KeepFreedMemoryForReuse keeps what is freed for reuse: chunks up to 32 MiB come from the heap
// and the heap is not trimmed below 2 GiB of free top. The peak a worker reaches (VmHWM) is the
// same; its resident memory no longer falls back between steps. Thread-safe and idempotent.

namespace launch::trainer {

// Applies the setting unless the user chose the allocator's thresholds (MALLOC_TRIM_THRESHOLD_,
// MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES naming glibc.malloc), or LAUNCH_KEEP_FREED_MEMORY=0
// asks for glibc's defaults. Returns whether it applied it (false too where the C library is
// not glibc).
bool KeepFreedMemoryForReuse();

}  // namespace launch::trainer
