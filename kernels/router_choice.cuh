#pragma once
// The router kernels' choice (router.cu; router_backward.cu takes its warp mask): each expert's
// choice score as an order-preserving integer key for redux.sync, and the group-limited choice
// over those keys (router.h). Device functions of a warp that holds one token's row: lane l the
// experts l, l + 32,
// ...

#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/router.h"

namespace torchmoe::kernels::router_choice {

constexpr unsigned kFullMask = 0xffffffffu;

// A choice key as an unsigned integer of the same order, for redux.sync: 0 for a key that is never
// chosen (NaN, -inf, -FLT_MAX: the value that marks a taken expert), and -0 as +0 so that equal
// keys tie (the lower expert wins).
__device__ __forceinline__ unsigned choice_key(float k) {
  if (!(k > -FLT_MAX)) return 0u;
  const unsigned bits = __float_as_uint(k == 0.0f ? 0.0f : k);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The choice score a key stands for (choice_key's inverse); -inf for the never-chosen key 0.
__device__ __forceinline__ float key_value(unsigned key) {
  if (key == 0u) return -INFINITY;
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Group-limited choice (router.h): zeroes the keys of every expert outside the token's
// topk_groups best groups. Lane g holds group g's score, the sum of its two highest choice
// scores, as the ATen path sums them (the larger first: the same bits).
template <int kPerLane>
__device__ __forceinline__ void limit_to_groups(const RouterParams& p, int lane,
                                                unsigned (&key)[kPerLane]) {
  const int groups = static_cast<int>(p.num_groups);
  const int group_size = static_cast<int>(p.experts) / groups;
  int group[kPerLane];  // each held expert's group (past E: a group no round visits)
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) group[i] = (lane + i * kWarpSize) / group_size;
  float own_score = -INFINITY;
  for (int g = 0; g < groups; ++g) {
    unsigned first = 0u, second = 0u;  // this lane's two highest keys in group g
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (group[i] != g) continue;
      if (key[i] > first) {
        second = first;
        first = key[i];
      } else if (key[i] > second) {
        second = key[i];
      }
    }
    const unsigned best = __reduce_max_sync(kFullMask, first);
    // The group's second key: the best again where two lanes hold it, else the highest of the
    // other lanes' first and the best lane's second.
    const bool holds_best = first == best;
    const unsigned next = __popc(__ballot_sync(kFullMask, holds_best)) > 1
                              ? best
                              : __reduce_max_sync(kFullMask, holds_best ? second : first);
    if (lane == g) own_score = key_value(best) + key_value(next);
  }
  // topk_groups rounds: the highest group score, the lowest group holding it.
  unsigned group_key = lane < groups ? choice_key(own_score) : 0u;
  bool kept = false;
  for (int r = 0; r < static_cast<int>(p.topk_groups); ++r) {
    const unsigned best = __reduce_max_sync(kFullMask, group_key);
    if (best == 0u) break;  // no choosable group left (NaN or -inf scores)
    const unsigned chosen =
        __reduce_min_sync(kFullMask, group_key == best ? static_cast<unsigned>(lane) : 32u);
    if (static_cast<unsigned>(lane) == chosen) {
      kept = true;
      group_key = 0u;
    }
  }
  const unsigned kept_groups = __ballot_sync(kFullMask, kept);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (group[i] >= groups || !((kept_groups >> group[i]) & 1u)) key[i] = 0u;
  }
}

}  // namespace torchmoe::kernels::router_choice
