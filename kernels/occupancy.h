#pragma once
// Launch sizes the kernels' launchers ask the CUDA runtime for, asked once per device and cached:
// an occupancy query or a function-attribute call costs host time at every launch otherwise, and
// a MoE layer's forward makes a dozen launches.

#include <cstddef>
#include <cstdint>

namespace torchmoe::kernels {

// Multiprocessors of the current device.
int sm_count();

// Blocks of `kernel` that run at once on the current device (at least one per multiprocessor),
// given its registers and `shared_bytes` of dynamic shared memory per block of `threads`.
int64_t resident_blocks(const void* kernel, int threads, size_t shared_bytes);

// Lets `kernel` launch with `shared_bytes` of dynamic shared memory on the current device (the
// opt-in above the default 48 KiB is per kernel and per device); a runtime call only when the
// size exceeds what was allowed before.
void allow_dynamic_shared(const void* kernel, size_t shared_bytes);

}  // namespace torchmoe::kernels
