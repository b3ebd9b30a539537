// The router's backward in one pass per token (router.h): a warp per token as in the forward
// (router.cu), which recomputes the row's scores from its logits in registers and takes the
// gradients of the chosen probabilities, aux_sums, the aux loss, lse and the z-loss through them
// to grad_logits. Beside it the logits' backward's operands, grad_logits as two bf16 halves and
// the weight stacked twice (written by the same launch, or by router_grad_split's own), and
// router_halves_sum, the weight's gradient from its two halves.

#include <cuda_bf16.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/router.h"
#include "torchmoe/kernels/router_choice.cuh"
#include "torchmoe/kernels/router_warp.cuh"

namespace torchmoe::kernels {
namespace {

constexpr int kSplitThreads = 256;  // router_grad_split_kernel's elementwise blocks
using router_choice::kFullMask;

using router_warp::dispatch_per_lane;
using router_warp::kMaxThreads;
using router_warp::kNormEps;
using router_warp::launch;
using router_warp::load_row;
using router_warp::min_blocks;
using router_warp::RowStats;
using router_warp::score_row;

// Row t of hilo [T, 2E]: hi = bf16(g) in column e, lo = bf16(g − hi) in column E + e, both
// rounded to nearest even (router.h's split).
__device__ __forceinline__ void store_halves(__nv_bfloat16* hilo, int64_t experts, int64_t t,
                                             int64_t e, float g) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(g);
  hilo[t * 2 * experts + e] = hi;
  hilo[t * 2 * experts + experts + e] = __float2bfloat16_rn(g - __bfloat162float(hi));
}

// The 16-byte pieces of W [w elements] that copy_stacked copies as such: all of W when its size
// and both addresses allow (the second copy then starts at a piece too), else none.
__host__ __device__ int64_t stacked_pieces(const void* weight, const void* stacked, int64_t w) {
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(stacked)) % 16) == 0;
  return w % 8 == 0 && aligned ? w / 8 : 0;
}

// Threads that copy_stacked keeps busy: one per piece, or per element.
int64_t copy_stacked_threads(const void* weight, const void* stacked, int64_t w) {
  const int64_t pieces = stacked_pieces(weight, stacked, w);
  return pieces > 0 ? pieces : w;
}

// stacked [2E, H] = [W; W] from W's w = E·H bf16 elements, thread `first` of `stride` taking every
// stride-th piece (or element, where W has no pieces).
__device__ __forceinline__ void copy_stacked(const __nv_bfloat16* weight, __nv_bfloat16* stacked,
                                             int64_t w, int64_t first, int64_t stride) {
  const int64_t pieces = stacked_pieces(weight, stacked, w);
  for (int64_t i = first; i < pieces; i += stride) {
    const uint4 v = reinterpret_cast<const uint4*>(weight)[i];
    reinterpret_cast<uint4*>(stacked)[i] = v;
    reinterpret_cast<uint4*>(stacked)[i + pieces] = v;
  }
  for (int64_t i = 8 * pieces + first; i < w; i += stride) {
    const __nv_bfloat16 v = weight[i];
    stacked[i] = v;
    stacked[i + w] = v;
  }
}

// A chosen slot of the forward (index, probability) and its probability's gradient.
struct ChosenSlot {
  int64_t index = -1;
  float prob = 0.0f;
  float grad = 0.0f;
};

__device__ __forceinline__ ChosenSlot load_slot(const RouterParams& p, int64_t slot) {
  float grad = p.grad_probs ? p.grad_probs[slot] : 0.0f;
  if (p.grad_probs_rows) {
    const int64_t row = p.probs_row_map[slot];
    if (row >= 0) grad += p.grad_probs_rows[row];
  }
  return {p.saved_indices[slot], p.saved_probs[slot], grad};
}

template <int kPerLane>
__global__ void __launch_bounds__(kMaxThreads, min_blocks(kPerLane, 3, 1))
    router_backward_kernel(const RouterParams p) {
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  const bool has_gp = p.grad_probs || p.grad_probs_rows;
  // The gradient of aux_sums (every token's aux[t, e] gets it), plus the aux loss's through it:
  // aux_loss = scale · Σ_e aux_sums[e] · counts[e]. The same for every token.
  const bool has_ga = p.grad_aux || p.grad_aux_loss;
  const float loss_grad =
      p.grad_aux_loss ? static_cast<float>(*p.grad_aux_loss * p.aux_loss_scale) : 0.0f;
  // z_loss = scale · Σ_t lse[t]²: d/d lse[t] = 2 · scale · lse[t] times its gradient.
  const float z_grad =
      p.grad_z_loss ? static_cast<float>(2.0 * *p.grad_z_loss * p.z_loss_scale) : 0.0f;
  float ga[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + i * kWarpSize;
    ga[i] = 0.0f;
    if (!has_ga || e >= experts) continue;
    if (p.grad_aux) ga[i] = p.grad_aux[e];
    if (p.grad_aux_loss) ga[i] += loss_grad * static_cast<float>(p.saved_counts[e]);
  }
  auto* hilo = static_cast<__nv_bfloat16*>(p.grad_hilo);  // row t at t · 2E, when given
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    // Loads the row's reductions do not wait for, issued before them: the logsumexp's gradient and
    // lane j's slot (k ≤ 32).
    const float grad_lse = p.grad_lse ? p.grad_lse[t] : 0.0f;
    ChosenSlot c;
    if (has_gp && lane < topk) c = load_slot(p, t * topk + lane);
    float l[kPerLane], s[kPerLane];
    load_row(p.logits + t * experts, experts, lane, l);
    const RowStats stats = score_row(p, l, lane, s);
    const float gl = p.grad_z_loss ? grad_lse + z_grad * stats.lse : grad_lse;
    // d/ds of the aux scores: the identity for softmax; through s / (Σ s + eps) for sigmoid.
    float aux_dot = 0.0f;
    if (has_ga && p.sigmoid) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (lane + i * kWarpSize < experts) aux_dot += ga[i] * s[i] / (stats.score_sum + kNormEps);
      }
      aux_dot = warp_sum(aux_dot);
    }
    float ds[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      ds[i] = !has_ga ? 0.0f : p.sigmoid ? (ga[i] - aux_dot) / (stats.score_sum + kNormEps) : ga[i];
    }
    // d/ds of the chosen probabilities. An index outside [0, experts) (not one router_topk wrote)
    // is never used: it reaches no score (the row's gradient is then not meaningful).
    if (has_gp) {
      const bool valid = c.index >= 0 && c.index < experts;
      const int index = valid ? static_cast<int>(c.index) : -1;
      float chosen_s = 0.0f;  // s at this lane's choice, from the lane that holds it
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const float v = __shfl_sync(kFullMask, s[i], index & (kWarpSize - 1));
        if (valid && index / kWarpSize == i) chosen_s = v;
      }
      // probs = scale · p: p's gradient is scale · grad, and scale · grad · p = grad · prob.
      const float dot = warp_sum(c.grad * c.prob);
      const float chosen_sum = warp_sum(chosen_s);
      const float grad = c.grad * p.scale;
      const float add = p.normalize ? (grad - dot) / (chosen_sum + kNormEps) : grad;
      // Each choice's term to its expert's lane, in order (a repeated expert gets both).
      for (int j = 0; j < topk; ++j) {
        const int e = __shfl_sync(kFullMask, index, j);
        const float a = __shfl_sync(kFullMask, add, j);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          if (lane + i * kWarpSize == e) ds[i] += a;
        }
      }
    }
    // Through the scores to the logits, plus the logsumexp's softmax.
    float s_dot = 0.0f;
    if (!p.sigmoid) {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (lane + i * kWarpSize < experts) s_dot += s[i] * ds[i];
      }
      s_dot = warp_sum(s_dot);
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + i * kWarpSize;
      if (e >= experts) continue;
      const float softmax = p.sigmoid ? expf(l[i] - stats.lse) : s[i];
      const float d = p.sigmoid ? ds[i] * s[i] * (1.0f - s[i]) : s[i] * (ds[i] - s_dot);
      const float g = d + gl * softmax;
      p.grad_logits[t * experts + e] = g;
      if (hilo) store_halves(hilo, experts, t, e, g);
    }
  }
  // [W; W] for the logits' backward, after the tokens (its loads would hold up this thread's first
  // token), over the whole grid (the launch has a thread per piece).
  if (p.stacked) {
    copy_stacked(static_cast<const __nv_bfloat16*>(p.split_weight),
                 static_cast<__nv_bfloat16*>(p.stacked), p.experts * p.hidden,
                 static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
                 static_cast<int64_t>(gridDim.x) * blockDim.x);
  }
}

// hilo from grad, then [W; W].
__global__ void __launch_bounds__(kSplitThreads)
    router_grad_split_kernel(const float* grad, __nv_bfloat16* hilo, int64_t tokens,
                             int64_t experts, const __nv_bfloat16* weight, __nv_bfloat16* stacked,
                             int64_t hidden) {
  const int64_t n = tokens * experts;
  const int64_t first = blockIdx.x * static_cast<int64_t>(kSplitThreads) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSplitThreads;
  for (int64_t i = first; i < n; i += stride) {
    store_halves(hilo, experts, i / experts, i % experts, grad[i]);
  }
  if (weight) copy_stacked(weight, stacked, experts * hidden, first, stride);
}

// Four elements a thread where the halves allow 16-byte loads, the rest one at a time.
__global__ void __launch_bounds__(kSplitThreads)
    router_halves_sum_kernel(const float* halves, __nv_bfloat16* out, int64_t n, bool vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kSplitThreads;
  const int64_t first = blockIdx.x * static_cast<int64_t>(kSplitThreads) + threadIdx.x;
  const int64_t n4 = vectors ? n / 4 : 0;
  const auto* hi4 = reinterpret_cast<const float4*>(halves);
  const auto* lo4 = reinterpret_cast<const float4*>(halves + n);
  for (int64_t i = first; i < n4; i += stride) {
    const float4 a = hi4[i], b = lo4[i];
    const __nv_bfloat162 x = __floats2bfloat162_rn(a.x + b.x, a.y + b.y);
    const __nv_bfloat162 y = __floats2bfloat162_rn(a.z + b.z, a.w + b.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const unsigned*>(&x);
    packed.y = *reinterpret_cast<const unsigned*>(&y);
    *reinterpret_cast<uint2*>(out + 4 * i) = packed;
  }
  for (int64_t i = 4 * n4 + first; i < n; i += stride) {
    out[i] = __float2bfloat16_rn(halves[i] + halves[n + i]);
  }
}

}  // namespace

void launch_router_backward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_backward: unsupported experts/topk");
  TORCH_INTERNAL_ASSERT(!params.grad_probs_rows == !params.probs_row_map,
                        "launch_router_backward: grad_probs_rows needs probs_row_map");
  TORCH_INTERNAL_ASSERT(!params.stacked || (params.split_weight && params.hidden > 0),
                        "launch_router_backward: stacked needs split_weight and hidden");
  TORCH_INTERNAL_ASSERT(params.topk <= kRouterMaxTopK, "launch_router_backward: k > ",
                        kRouterMaxTopK);
  if (params.tokens == 0 && !params.stacked) return;
  // A thread per piece (or element) of [W; W]'s copy too: few tokens must not leave one block
  // copying all of W.
  const int64_t copy_threads = params.stacked
                                   ? copy_stacked_threads(params.split_weight, params.stacked,
                                                          params.experts * params.hidden)
                                   : 0;
  dispatch_per_lane(params.experts, [&](auto per_lane) {
    launch(router_backward_kernel<per_lane>, params, 0, 0, stream, copy_threads);
  });
}

void launch_router_grad_split(const RouterGradSplitParams& p, cudaStream_t stream) {
  const int64_t n =
      std::max(p.tokens * p.experts,
               p.weight ? copy_stacked_threads(p.weight, p.stacked, p.experts * p.hidden) : 0);
  if (n == 0) return;
  const int64_t blocks = (n + kSplitThreads - 1) / kSplitThreads;
  router_grad_split_kernel<<<one_wave_grid(router_grad_split_kernel, kSplitThreads, 0, blocks),
                             kSplitThreads, 0, stream>>>(
      p.grad, static_cast<__nv_bfloat16*>(p.hilo), p.tokens, p.experts,
      static_cast<const __nv_bfloat16*>(p.weight), static_cast<__nv_bfloat16*>(p.stacked),
      p.hidden);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_router_halves_sum(const RouterHalvesSumParams& p, cudaStream_t stream) {
  const int64_t n = p.experts * p.hidden;
  if (n == 0) return;
  // 16-byte loads of both halves (the second starts n floats in) and 8-byte stores.
  const bool vectors = n % 4 == 0 && reinterpret_cast<uintptr_t>(p.halves) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
  const int64_t work = vectors ? n / 4 : n;
  const int64_t blocks = (work + kSplitThreads - 1) / kSplitThreads;
  router_halves_sum_kernel<<<one_wave_grid(router_halves_sum_kernel, kSplitThreads, 0, blocks),
                             kSplitThreads, 0, stream>>>(
      p.halves, static_cast<__nv_bfloat16*>(p.out), n, vectors);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
