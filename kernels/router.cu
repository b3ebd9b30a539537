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

// aux_sums' fixed point: a term in [0, 1] counts as round(term · 2^32) (router.h).
constexpr float kAuxScale = 4294967296.0f;  // 2^32
constexpr double kAuxUnit = 1.0 / 4294967296.0;

// Shared memory of the forward: with aux_sums first each warp's fixed-point sums (lane l owns
// experts l, l + 32, ...: no conflicts, no atomics), then each warp's scores and choice keys.
__host__ __device__ size_t aux_block_bytes(int64_t experts, bool aux) {
  return aux ? static_cast<size_t>(kWarpsPerBlock * experts) * sizeof(long long) : 0;
}
size_t forward_shared_bytes(int64_t experts, bool aux) {
  return aux_block_bytes(experts, aux) +
         static_cast<size_t>(2 * kWarpsPerBlock * experts) * sizeof(float);
}

__global__ void __launch_bounds__(kThreads) router_forward_kernel(const RouterParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  long long* aux_block = reinterpret_cast<long long*>(shared);  // [kWarpsPerBlock][E] with aux
  float* rows = reinterpret_cast<float*>(shared + aux_block_bytes(experts, p.aux_sums != nullptr));
  float* s = rows + warp * experts;
  float* key = rows + (kWarpsPerBlock + warp) * experts;
  long long* aux_sum = aux_block + warp * experts;
  bool aux_nan = false;
  if (p.aux_sums) {
    for (int e = lane; e < experts; e += kWarpSize) aux_sum[e] = 0;
  }
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const RowStats stats = score_row(p, p.logits + t * experts, s, lane);
    if (lane == 0) p.lse[t] = stats.lse;
    for (int e = lane; e < experts; e += kWarpSize) {
      key[e] = p.expert_bias ? s[e] + p.expert_bias[e] : s[e];
      if (p.aux_sums) {
        const float a = p.sigmoid ? s[e] / (stats.score_sum + kNormEps) : s[e];
        if (isnan(a)) {
          aux_nan = true;
        } else {
          aux_sum[e] += __float2ll_rn(a * kAuxScale);
        }
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
  if (!p.aux_sums) return;

  // The block's sums into the launch's (integer adds: any order gives the same bits), then the
  // last block to finish converts them.
  auto* sums = reinterpret_cast<unsigned long long*>(p.aux_scratch);
  unsigned long long* nan_flag = sums + experts;
  unsigned long long* finished = sums + experts + 1;
  __shared__ bool last;
  if (__any_sync(0xffffffffu, aux_nan) && lane == 0) atomicOr(nan_flag, 1ull);
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += kThreads) {
    long long v = 0;
    for (int w = 0; w < kWarpsPerBlock; ++w) v += aux_block[w * experts + e];
    if (v != 0) atomicAdd(sums + e, static_cast<unsigned long long>(v));
  }
  __threadfence();  // this block's adds before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(finished, 1ull) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // every block's adds (before their counts) are visible
  const bool any_nan = __ldcg(reinterpret_cast<const long long*>(nan_flag)) != 0;
  for (int e = threadIdx.x; e < experts; e += kThreads) {
    const long long v = __ldcg(reinterpret_cast<const long long*>(sums + e));
    p.aux_sums[e] = any_nan ? NAN : static_cast<float>(static_cast<double>(v) * kAuxUnit);
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
    const float* ga = p.grad_aux;  // of aux_sums: every token's aux[t, e] gets it
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
void launch(Kernel* kernel, const RouterParams& p, size_t shared, cudaStream_t stream) {
  const int64_t blocks = (p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock;
  kernel<<<one_wave_grid(kernel, kThreads, shared, blocks), kThreads, shared, stream>>>(p);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_router_forward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_forward: unsupported experts/topk");
  TORCH_INTERNAL_ASSERT(
      !params.aux_sums || (params.aux_scratch && params.tokens < kRouterMaxAuxTokens),
      "launch_router_forward: aux_sums needs aux_scratch and T < 2^31");
  // No tokens: nothing to choose, and the sums are zeros (the last block writes them).
  if (params.tokens == 0 && !params.aux_sums) return;
  const size_t shared = forward_shared_bytes(params.experts, params.aux_sums != nullptr);
  // Up to 64 KB (1024 experts with aux_sums): past the 48 KB a launch gets without asking.
  if (shared > size_t{48} * 1024) {
    TORCHMOE_CUDA_CHECK(cudaFuncSetAttribute(router_forward_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(shared)));
  }
  launch(router_forward_kernel, params, shared, stream);
}

void launch_router_backward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_backward: unsupported experts/topk");
  if (params.tokens == 0) return;
  launch(router_backward_kernel, params, 0, stream);
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
