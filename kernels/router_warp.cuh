#pragma once
// What the router's kernels share (router.cu's forward and router_backward.cu's backward, its only
// includers): a warp per token, the token's row in its registers (the dispatch on experts per lane,
// the row's load and scores), and the blocks of such warps that a launch runs.

#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#include <c10/util/Exception.h>

#include "torchmoe/kernels/cuda_check.h"
#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/router.h"

namespace torchmoe::kernels::router_warp {

// router.h's kRouterNormEps as the kernels' float.
constexpr float kNormEps = static_cast<float>(kRouterNormEps);

// Calls f(std::integral_constant<int, kPerLane>) with the fewest experts per lane that hold E.
template <typename F>
void dispatch_per_lane(int64_t experts, F&& f) {
  static_assert(kRouterMaxExperts == 32 * kWarpSize, "dispatch_per_lane: kPerLane up to 32");
  if (experts <= kWarpSize) {
    f(std::integral_constant<int, 1>{});
  } else if (experts <= 2 * kWarpSize) {
    f(std::integral_constant<int, 2>{});
  } else if (experts <= 4 * kWarpSize) {
    f(std::integral_constant<int, 4>{});
  } else if (experts <= 8 * kWarpSize) {
    f(std::integral_constant<int, 8>{});
  } else if (experts <= 16 * kWarpSize) {
    f(std::integral_constant<int, 16>{});
  } else {
    f(std::integral_constant<int, 32>{});
  }
}

// Blocks of 16 warps per SM that each instantiation asks registers for: `small` blocks for rows of
// up to `small_lanes` experts per lane, fewer as the row's registers grow (kPerLane of each
// per-expert array). ptxas -v: a word or two spilled at 2 (forward) and 8 (backward) experts per
// lane, 200 bytes at 32 (backward, E > 512).
constexpr int min_blocks(int per_lane, int small, int small_lanes) {
  return per_lane <= small_lanes ? small : per_lane <= 8 ? 2 : 1;
}

// Token t's logits into l (experts past E: -FLT_MAX, never read as scores).
template <int kPerLane>
__device__ __forceinline__ void load_row(const float* row, int experts, int lane,
                                         float (&l)[kPerLane]) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + i * kWarpSize;
    l[i] = e < experts ? row[e] : -FLT_MAX;
  }
}

struct RowStats {
  float lse;        // log Σ exp(logits)
  float score_sum;  // Σ_e s (sigmoid's normaliser)
};

// The scores of the logits l into s, and the row's statistics (every lane).
template <int kPerLane>
__device__ __forceinline__ RowStats score_row(const RouterParams& p, const float (&l)[kPerLane],
                                              int lane, float (&s)[kPerLane]) {
  const int experts = static_cast<int>(p.experts);
  float m = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) m = fmaxf(m, l[i]);
  m = warp_max(m);
  float ex[kPerLane];
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    ex[i] = expf(l[i] - m);
    if (lane + i * kWarpSize < experts) sum += ex[i];
  }
  sum = warp_sum(sum);
  float score_sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    s[i] = p.sigmoid ? 1.0f / (1.0f + expf(-l[i])) : ex[i] / sum;
    if (lane + i * kWarpSize < experts) score_sum += s[i];
  }
  score_sum = warp_sum(score_sum);
  return {m + logf(sum), score_sum};
}

// Up to 16 warps per block, as many as kSharedBudget holds: fewer, larger blocks than one per
// four tokens, because each block ends with atomics on the launch's sums (E addresses) and a
// ticket, and those, not the tokens' work, decided the time when 2,048 blocks of 4 warps took
// 8,192 tokens (~80,000 atomics on a few cache lines).
constexpr int kMaxWarpsPerBlock = 16;
constexpr int kMaxThreads = kMaxWarpsPerBlock * kWarpSize;
// What a launch gets without opting in, less room for the forward's static shared memory (its
// flag and the losses' per-warp sums: static and dynamic count together against the 48 KB).
constexpr size_t kSharedBudget = 48 * 1024 - 256;

// A warp per token, `warps` per block (each needing `warp_bytes` of shared memory after
// `block_bytes`), and at least `min_threads` threads and one block (the forward's last block
// writes the counts and sums even for zero tokens), one wave and max_blocks at most.
inline int warps_per_block(size_t block_bytes, size_t warp_bytes) {
  TORCH_INTERNAL_ASSERT(block_bytes + warp_bytes <= kSharedBudget,
                        "router launch: one warp's shared memory exceeds the budget");
  return warp_bytes == 0 ? kMaxWarpsPerBlock
                         : static_cast<int>(std::min<size_t>(
                               kMaxWarpsPerBlock, (kSharedBudget - block_bytes) / warp_bytes));
}

template <typename Kernel>
void launch(Kernel* kernel, const RouterParams& p, size_t block_bytes, size_t warp_bytes,
            cudaStream_t stream, int64_t min_threads = 0,
            int64_t max_blocks = std::numeric_limits<int64_t>::max()) {
  const int warps = warps_per_block(block_bytes, warp_bytes);
  const int threads = warps * kWarpSize;
  const size_t shared = block_bytes + warps * warp_bytes;
  const int64_t blocks =
      std::max<int64_t>({1, (p.tokens + warps - 1) / warps, (min_threads + threads - 1) / threads});
  kernel<<<one_wave_grid(kernel, threads, shared, std::min(blocks, max_blocks)), threads, shared,
           stream>>>(p);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels::router_warp
