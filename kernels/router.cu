// The router's scoring, top-k and the inputs of its losses in one pass per token (router.h).
//
// One warp per token, its row in registers: lane l holds experts l, l + 32, … (kPerLane of them,
// a compile-time count: E ≤ 32 · kPerLane). The row's reductions are shuffles, each top-k round two
// redux.sync (the largest choice key, then the lowest expert holding it), and the chosen expert's
// lane takes it out of its registers, so a token costs one read of its logits and the writes of
// its outputs. The alternative, ATen's softmax, topk, gather, normalisation, bincount and
// logsumexp, is ~25 launches forward and more backward whose time on small-expert MoE layers was
// comparable to the router's GEMM.
//
// This file holds the forward; router_backward.cu the backward and the logits' backward's
// operands; router_warp.cuh what both kernels share.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/router.h"
#include "torchmoe/kernels/router_choice.cuh"
#include "torchmoe/kernels/router_warp.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels/router.cu: the top-k rounds use redux.sync (sm_80 or newer)"
#endif

namespace torchmoe::kernels {
namespace {

using router_choice::choice_key;
using router_choice::kFullMask;
using router_choice::limit_to_groups;
using router_warp::dispatch_per_lane;
using router_warp::kMaxThreads;
using router_warp::kMaxWarpsPerBlock;
using router_warp::kNormEps;
using router_warp::launch;
using router_warp::load_row;
using router_warp::min_blocks;
using router_warp::RowStats;
using router_warp::score_row;
using router_warp::warps_per_block;

// aux_sums' fixed point: a term in [0, 1] counts as round(term · 2^32) (router.h).
constexpr float kAuxScale = 4294967296.0f;  // 2^32
constexpr double kAuxUnit = 1.0 / 4294967296.0;

// Block b adds its sums into replica b % kRouterSumReplicas (router.h): a replica's E addresses
// take 1/8 of the blocks' atomics.
__device__ __host__ constexpr int64_t scratch_replica_words(int64_t experts) {
  return kRouterSumReplicas * experts;
}

// Shared memory of the forward: the last block's sums of the replicas, counts and aux [E] (u64);
// then per warp its own fixed-point aux sums [E] (u64, with aux_sums) and counts [E] (u32), padded
// to 8 bytes. Per-warp sums need no atomics: expert e's entries are only ever touched by lane
// e % 32 of their warp.
__host__ __device__ size_t forward_block_bytes(int64_t experts) {
  return static_cast<size_t>(2 * experts) * sizeof(unsigned long long);
}
__host__ __device__ size_t forward_warp_bytes(int64_t experts, bool aux) {
  const size_t bytes = static_cast<size_t>(experts) * ((aux ? 8 : 0) + 4);
  return (bytes + 7) / 8 * 8;
}

// *p += v at the GPU's scope with acquire and release semantics; returns the old value.
__device__ __forceinline__ unsigned long long add_acq_rel(unsigned long long* p,
                                                          unsigned long long v) {
  unsigned long long old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], %2;"
               : "=l"(old)
               : "l"(p), "l"(v)
               : "memory");
  return old;
}

// The block's sum of v in a fixed order (each warp's shuffles, then the warps in turn), on thread
// 0; `parts` holds a double per warp. Every thread of the block calls it.
__device__ double block_sum_in_order(double v, double* parts) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  v = warp_sum(v);
  __syncthreads();  // parts' earlier reads done
  if (lane == 0) parts[warp] = v;
  __syncthreads();
  double sum = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < static_cast<int>(blockDim.x / kWarpSize); ++w) sum += parts[w];
  }
  return sum;
}

template <int kPerLane>
__global__ void __launch_bounds__(kMaxThreads, min_blocks(kPerLane, 4, 2))
    router_forward_kernel(const RouterParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  allow_dependent_launch();  // the routing map's histogram (token_permutation.cu) waits for it
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  const bool aux = p.aux_sums != nullptr;
  const size_t warp_bytes = forward_warp_bytes(experts, aux);
  const auto warp_row = [&](int w) {
    return shared + forward_block_bytes(experts) + w * warp_bytes;
  };
  // This warp's rows; another warp's are at the same offsets from warp_row(w).
  const size_t counts_offset = aux ? experts * sizeof(unsigned long long) : 0;
  auto* aux_own = reinterpret_cast<unsigned long long*>(warp_row(warp));
  auto* counts_own = reinterpret_cast<unsigned*>(warp_row(warp) + counts_offset);
  for (int e = lane; e < experts; e += kWarpSize) {
    counts_own[e] = 0;
    if (aux) aux_own[e] = 0;
  }
  bool aux_nan = false;
  double z_part = 0.0;  // lane 0: Σ lse² over this warp's tokens, in their order
  const bool z_sum = p.z_loss && p.z_loss_scale > 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    float l[kPerLane], s[kPerLane];
    load_row(p.logits + t * experts, experts, lane, l);
    const RowStats stats = score_row(p, l, lane, s);
    if (lane == 0) {
      p.lse[t] = stats.lse;
      if (z_sum) z_part += static_cast<double>(stats.lse) * static_cast<double>(stats.lse);
    }
    unsigned key[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + i * kWarpSize;
      key[i] = 0u;
      if (e >= experts) continue;
      key[i] = choice_key(p.expert_bias ? s[i] + p.expert_bias[e] : s[i]);
      if (aux) {
        const float a = p.sigmoid ? s[i] / (stats.score_sum + kNormEps) : s[i];
        if (isnan(a)) {
          aux_nan = true;
        } else {  // a in [0, 1]: a non-negative count
          aux_own[e] += static_cast<unsigned long long>(__float2ll_rn(a * kAuxScale));
        }
      }
    }
    if (p.num_groups > 1) limit_to_groups(p, lane, key);
    // Round j: the largest key over the warp, the lowest expert holding it; its lane takes it
    // out and counts it. Lane j keeps choice j.
    float chosen_sum = 0.0f;  // Σ of the chosen scores, on every lane
    int own_e = 0;
    float own_s = 0.0f;
    for (int j = 0; j < topk; ++j) {
      unsigned best = 0u;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) best = max(best, key[i]);
      best = __reduce_max_sync(kFullMask, best);
      int chosen = j;  // a row of no choosable key (NaN scores): any valid expert (NaN probs)
      if (best != 0u) {
        unsigned first = static_cast<unsigned>(experts);
#pragma unroll
        for (int i = kPerLane - 1; i >= 0; --i) {
          if (key[i] == best) first = static_cast<unsigned>(lane + i * kWarpSize);
        }
        chosen = static_cast<int>(__reduce_min_sync(kFullMask, first));
      }
      float held = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (lane + i * kWarpSize == chosen) {
          held = s[i];
          key[i] = 0u;
          ++counts_own[chosen];  // the fallback above can repeat an expert: counted twice
        }
      }
      const float chosen_s = __shfl_sync(kFullMask, held, chosen % kWarpSize);
      chosen_sum += chosen_s;
      if (lane == j) {
        own_e = chosen;
        own_s = chosen_s;
      }
    }
    if (lane < topk) {
      p.indices[t * topk + lane] = own_e;
      p.probs[t * topk + lane] = (p.normalize ? own_s / (chosen_sum + kNormEps) : own_s) * p.scale;
    }
  }

  // The block's counts and sums into its replica (integer adds: any order gives the same bits)
  // and its Σ lse² into its own word, then the last block to finish adds the replicas and the
  // blocks' words (in a fixed order for a given grid: the same bits run to run on one device) and
  // writes counts, aux_sums and the losses.
  auto* scratch = reinterpret_cast<unsigned long long*>(p.scratch);
  const int64_t replica = blockIdx.x % kRouterSumReplicas;
  unsigned long long* count_sums = scratch;                                 // [replicas][E]
  unsigned long long* aux_sums = scratch + scratch_replica_words(experts);  // [replicas][E]
  unsigned long long* nan_flag = aux_sums + scratch_replica_words(experts);
  unsigned long long* finished = nan_flag + 1;
  auto* z_sums = reinterpret_cast<double*>(finished + 1);  // [gridDim.x]
  __shared__ bool last;
  __shared__ double warp_parts[kMaxWarpsPerBlock];
  if (aux && __any_sync(kFullMask, aux_nan) && lane == 0) atomicOr(nan_flag, 1ull);
  if (z_sum) {
    const double block_z = block_sum_in_order(z_part, warp_parts);
    if (threadIdx.x == 0) z_sums[blockIdx.x] = block_z;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    unsigned long long count = 0, sum = 0;
    for (int w = 0; w < warps; ++w) {
      count += reinterpret_cast<const unsigned*>(warp_row(w) + counts_offset)[e];
      if (aux) sum += reinterpret_cast<const unsigned long long*>(warp_row(w))[e];
    }
    if (count != 0) atomicAdd(count_sums + replica * experts + e, count);
    if (sum != 0) atomicAdd(aux_sums + replica * experts + e, sum);
  }
  // The block's adds (before the barrier) are visible before its count, every earlier block's
  // after it: thread 0's add releases what the barrier ordered before it, and its acquire half,
  // passed on by the next barrier, orders the last block's reads (a release alone would not).
  // A __threadfence by every thread made each wait for its own atomics.
  __syncthreads();
  if (threadIdx.x == 0) last = add_acq_rel(finished, 1ull) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  // The replicas summed in shared memory, every (replica, expert) load in flight at once rather
  // than a replica at a time.
  auto* total_counts = reinterpret_cast<unsigned long long*>(shared);
  unsigned long long* total_aux = total_counts + experts;
  for (int e = threadIdx.x; e < 2 * experts; e += blockDim.x) total_counts[e] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < scratch_replica_words(experts); i += blockDim.x) {
    const int e = static_cast<int>(i % experts);
    atomicAdd(&total_counts[e], __ldcg(count_sums + i));
    if (aux) atomicAdd(&total_aux[e], __ldcg(aux_sums + i));
  }
  __syncthreads();
  const bool any_nan = aux && __ldcg(nan_flag) != 0;
  double loss_part = 0.0;  // this thread's terms of Σ_e aux_sums[e] · counts[e]
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    p.counts[e] = static_cast<int64_t>(total_counts[e]);
    if (aux) {
      const float sum =
          any_nan ? NAN : static_cast<float>(static_cast<double>(total_aux[e]) * kAuxUnit);
      p.aux_sums[e] = sum;
      loss_part += static_cast<double>(sum) * static_cast<double>(total_counts[e]);
    }
  }
  if (p.aux_loss) {
    // A zero scale gives 0 (NaN sums would make the product NaN).
    const double loss = block_sum_in_order(loss_part, warp_parts);
    if (threadIdx.x == 0) {
      *p.aux_loss = p.aux_loss_scale > 0 ? static_cast<float>(loss * p.aux_loss_scale) : 0.0f;
    }
  }
  if (p.z_loss) {
    // A zero scale gives 0 without the sum (an infinite logsumexp would make it NaN).
    double part = 0.0;
    if (z_sum) {
      for (int64_t b = threadIdx.x; b < gridDim.x; b += blockDim.x) part += __ldcg(z_sums + b);
    }
    const double loss = block_sum_in_order(part, warp_parts);
    if (threadIdx.x == 0) *p.z_loss = z_sum ? static_cast<float>(loss * p.z_loss_scale) : 0.0f;
  }
}

// The forward's grid has at most one block per `warps` tokens (arithmetic only: no device query
// on the host path; a word per block of a grid the wave would cut is 8 bytes of the scratch's
// memset).
int64_t forward_max_blocks(const RouterParams& p) {
  const int warps = warps_per_block(forward_block_bytes(p.experts),
                                    forward_warp_bytes(p.experts, p.aux_sums != nullptr));
  return std::max<int64_t>(1, (p.tokens + warps - 1) / warps);
}

}  // namespace

int64_t router_forward_scratch_words(const RouterParams& params) {
  return 2 * scratch_replica_words(params.experts) + 2 + forward_max_blocks(params);
}

void launch_router_forward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_forward: unsupported experts/topk");
  TORCH_INTERNAL_ASSERT(params.scratch && params.counts,
                        "launch_router_forward: needs scratch and counts");
  TORCH_INTERNAL_ASSERT(!params.aux_sums || params.tokens < kRouterMaxAuxTokens,
                        "launch_router_forward: aux_sums needs T < 2^31");
  TORCH_INTERNAL_ASSERT(params.topk <= kRouterMaxTopK, "launch_router_forward: k > ",
                        kRouterMaxTopK);
  TORCH_INTERNAL_ASSERT(params.num_groups >= 1 && params.num_groups <= kRouterMaxGroups &&
                            params.experts % params.num_groups == 0 && params.topk_groups >= 1 &&
                            params.topk_groups <= params.num_groups,
                        "launch_router_forward: num_groups ", params.num_groups,
                        " and topk_groups ", params.topk_groups, " for ", params.experts,
                        " experts");
  // A memset rather than the caller's fill: an ATen zeros costs the host a tensor and a kernel.
  TORCHMOE_CUDA_CHECK(cudaMemsetAsync(
      params.scratch, 0, router_forward_scratch_words(params) * sizeof(int64_t), stream));
  const bool aux = params.aux_sums != nullptr;
  dispatch_per_lane(params.experts, [&](auto per_lane) {
    // At most a block per Σ lse² word at the scratch's end (router_forward_scratch_words).
    launch(router_forward_kernel<per_lane>, params, forward_block_bytes(params.experts),
           forward_warp_bytes(params.experts, aux), stream, 0, forward_max_blocks(params));
  });
}

}  // namespace torchmoe::kernels
