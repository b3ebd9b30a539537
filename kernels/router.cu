// The router's scoring, top-k and the inputs of its losses in one pass per token (router.h).
//
// One warp per token: its lanes stride over the E logits, keep the row in shared memory and reduce
// with shuffles (max, sum of exponentials, each top-k round's argmax), so a token costs one read of
// its logits and the writes of its outputs. The alternative, ATen's softmax, topk, gather,
// normalisation, bincount and logsumexp, is ~25 launches forward and more backward whose time on
// small-expert MoE layers was comparable to the router's GEMM.

#include <cfloat>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/router.h"

namespace torchmoe::kernels {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kThreads = kWarpsPerBlock * kWarpSize;
constexpr float kNormEps = static_cast<float>(kRouterNormEps);

// The larger value, the lower index on ties; returned to every lane.
__device__ __forceinline__ void warp_argmax(float& value, int& index) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, value, offset);
    const int i = __shfl_xor_sync(0xffffffffu, index, offset);
    if (v > value || (v == value && i < index)) {
      value = v;
      index = i;
    }
  }
}

struct RowStats {
  float lse;        // log Σ exp(logits)
  float score_sum;  // Σ_e s (sigmoid's normaliser)
};

// Loads token t's logits, writes its scores into `s` (shared) and returns the row's statistics.
__device__ RowStats score_row(const RouterParams& p, const float* row, float* s, int lane) {
  const int experts = static_cast<int>(p.experts);
  float m = -FLT_MAX;
  for (int e = lane; e < experts; e += kWarpSize) {
    s[e] = row[e];
    m = fmaxf(m, s[e]);
  }
  m = warp_max(m);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += kWarpSize) sum += expf(s[e] - m);
  sum = warp_sum(sum);
  float score_sum = 0.0f;
  for (int e = lane; e < experts; e += kWarpSize) {
    const float score = p.sigmoid ? 1.0f / (1.0f + expf(-s[e])) : expf(s[e] - m) / sum;
    s[e] = score;
    score_sum += score;
  }
  score_sum = warp_sum(score_sum);
  __syncwarp();
  return {m + logf(sum), score_sum};
}

__global__ void __launch_bounds__(kThreads) router_forward_kernel(const RouterParams p) {
  __shared__ float scores[kWarpsPerBlock][kRouterMaxExperts];
  __shared__ float keys[kWarpsPerBlock][kRouterMaxExperts];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  float* s = scores[warp];
  float* key = keys[warp];
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const RowStats stats = score_row(p, p.logits + t * experts, s, lane);
    if (lane == 0) p.lse[t] = stats.lse;
    for (int e = lane; e < experts; e += kWarpSize) {
      key[e] = p.expert_bias ? s[e] + p.expert_bias[e] : s[e];
      if (p.aux) {
        p.aux[t * experts + e] = p.sigmoid ? s[e] / (stats.score_sum + kNormEps) : s[e];
      }
    }
    __syncwarp();
    int64_t* indices = p.indices + t * topk;
    float* probs = p.probs + t * topk;
    float chosen_sum = 0.0f;  // Σ of the chosen scores, on every lane
    for (int j = 0; j < topk; ++j) {
      float best = -FLT_MAX;
      int best_e = experts;
      for (int e = lane; e < experts; e += kWarpSize) {
        if (key[e] > best) {  // lanes scan in increasing e: the first of equals stays
          best = key[e];
          best_e = e;
        }
      }
      warp_argmax(best, best_e);
      if (best_e == experts) best_e = j;  // a row of NaN scores: any valid expert (NaN probs)
      chosen_sum += s[best_e];
      if (lane == 0) {
        indices[j] = best_e;
        probs[j] = s[best_e];
        key[best_e] = -FLT_MAX;  // taken: no finite score or bias reaches it
        atomicAdd(reinterpret_cast<unsigned long long*>(p.counts + best_e), 1ull);
      }
      __syncwarp();
    }
    if (p.normalize) {
      for (int j = lane; j < topk; j += kWarpSize) probs[j] = probs[j] / (chosen_sum + kNormEps);
    }
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kThreads) router_backward_kernel(const RouterParams p) {
  __shared__ float scores[kWarpsPerBlock][kRouterMaxExperts];
  __shared__ float grads[kWarpsPerBlock][kRouterMaxExperts];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  float* s = scores[warp];
  float* ds = grads[warp];
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const float* row = p.logits + t * experts;
    const RowStats stats = score_row(p, row, s, lane);
    // d/ds of the aux scores: the identity for softmax; through s / (Σ s + eps) for sigmoid.
    const float* ga = p.grad_aux ? p.grad_aux + t * experts : nullptr;
    float aux_dot = 0.0f;
    if (ga && p.sigmoid) {
      for (int e = lane; e < experts; e += kWarpSize)
        aux_dot += ga[e] * s[e] / (stats.score_sum + kNormEps);
      aux_dot = warp_sum(aux_dot);
    }
    for (int e = lane; e < experts; e += kWarpSize) {
      float g = 0.0f;
      if (ga) g = p.sigmoid ? (ga[e] - aux_dot) / (stats.score_sum + kNormEps) : ga[e];
      ds[e] = g;
    }
    __syncwarp();
    // d/ds of the chosen probabilities (distinct experts: each lane owns its j's expert).
    if (p.grad_probs) {
      const int64_t* indices = p.saved_indices + t * topk;
      const float* probs = p.saved_probs + t * topk;
      const float* gp = p.grad_probs + t * topk;
      float dot = 0.0f, chosen_sum = 0.0f;
      // An index outside [0, experts) (not one router_topk wrote) is never used as an address:
      // it reaches no score past the row's (the row's gradient is then not meaningful).
      const auto chosen = [&](int j) { return indices[j] >= 0 && indices[j] < experts; };
      for (int j = lane; j < topk; j += kWarpSize) {
        dot += gp[j] * probs[j];
        if (chosen(j)) chosen_sum += s[indices[j]];
      }
      dot = warp_sum(dot);
      chosen_sum = warp_sum(chosen_sum);
      for (int j = lane; j < topk; j += kWarpSize) {
        if (chosen(j))
          ds[indices[j]] += p.normalize ? (gp[j] - dot) / (chosen_sum + kNormEps) : gp[j];
      }
      __syncwarp();
    }
    // Through the scores to the logits, plus the logsumexp's softmax.
    float s_dot = 0.0f;
    if (!p.sigmoid) {
      for (int e = lane; e < experts; e += kWarpSize) s_dot += s[e] * ds[e];
      s_dot = warp_sum(s_dot);
    }
    const float gl = p.grad_lse ? p.grad_lse[t] : 0.0f;
    float* out = p.grad_logits + t * experts;
    for (int e = lane; e < experts; e += kWarpSize) {
      const float softmax = p.sigmoid ? expf(row[e] - stats.lse) : s[e];
      const float d = p.sigmoid ? ds[e] * s[e] * (1.0f - s[e]) : s[e] * (ds[e] - s_dot);
      out[e] = d + gl * softmax;
    }
    __syncwarp();
  }
}

__global__ void __launch_bounds__(kThreads)
    router_grad_split_kernel(const float* grad, __nv_bfloat16* hilo, int64_t tokens,
                             int64_t experts) {
  const int64_t n = tokens * experts;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t t = i / experts, e = i % experts;
    const float g = grad[i];
    const __nv_bfloat16 hi = __float2bfloat16_rn(g);
    hilo[t * 2 * experts + e] = hi;
    hilo[t * 2 * experts + experts + e] = __float2bfloat16_rn(g - __bfloat162float(hi));
  }
}

template <typename Kernel>
void launch(Kernel* kernel, const RouterParams& p, cudaStream_t stream) {
  if (p.tokens == 0) return;
  const int64_t blocks = (p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  kernel<<<one_wave_grid(kernel, kThreads, 0, blocks), kThreads, 0, stream>>>(p);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_router_forward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_forward: unsupported experts/topk");
  launch(router_forward_kernel, params, stream);
}

void launch_router_backward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_backward: unsupported experts/topk");
  launch(router_backward_kernel, params, stream);
}

void launch_router_grad_split(const float* grad, void* hilo, int64_t tokens, int64_t experts,
                              cudaStream_t stream) {
  const int64_t n = tokens * experts;
  if (n == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  router_grad_split_kernel<<<one_wave_grid(router_grad_split_kernel, kThreads, 0, blocks), kThreads,
                             0, stream>>>(grad, static_cast<__nv_bfloat16*>(hilo), tokens, experts);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
