// The router's scoring, top-k and the inputs of its losses in one pass per token (router.h).
//
// One warp per token, its row in registers: lane l holds experts l, l + 32, … (kPerLane of them,
// a compile-time count: E ≤ 32 · kPerLane). The row's reductions are shuffles, each top-k round two
// redux.sync (the largest choice key, then the lowest expert holding it), and the chosen expert's
// lane takes it out of its registers, so a token costs one read of its logits and the writes of
// its outputs. The alternative, ATen's softmax, topk, gather, normalisation, bincount and
// logsumexp, is ~25 launches forward and more backward whose time on small-expert MoE layers was
// comparable to the router's GEMM.

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/router.h"
#include "torchmoe/kernels/router_choice.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "kernels/router.cu: the top-k rounds use redux.sync (sm_80 or newer)"
#endif

namespace torchmoe::kernels {
namespace {

constexpr int kSplitThreads = 256;  // router_grad_split_kernel's elementwise blocks
constexpr float kNormEps = static_cast<float>(kRouterNormEps);
using router_choice::choice_key;
using router_choice::kFullMask;
using router_choice::limit_to_groups;

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

// aux_sums' fixed point: a term in [0, 1] counts as round(term · 2^32) (router.h).
constexpr float kAuxScale = 4294967296.0f;  // 2^32
constexpr double kAuxUnit = 1.0 / 4294967296.0;

// Up to 16 warps per block, as many as kSharedBudget holds: fewer, larger blocks than one per
// four tokens, because each block ends with atomics on the launch's sums (E addresses) and a
// ticket, and those, not the tokens' work, decided the time when 2,048 blocks of 4 warps took
// 8,192 tokens (~80,000 atomics on a few cache lines).
constexpr int kMaxWarpsPerBlock = 16;
constexpr int kMaxThreads = kMaxWarpsPerBlock * kWarpSize;
// What a launch gets without opting in, less room for the forward's static shared memory (its
// flag and the losses' per-warp sums: static and dynamic count together against the 48 KB).
constexpr size_t kSharedBudget = 48 * 1024 - 256;

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
    const double loss = block_sum_in_order(loss_part, warp_parts);
    if (threadIdx.x == 0) *p.aux_loss = static_cast<float>(loss * p.aux_loss_scale);
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

// A warp per token, `warps` per block (each needing `warp_bytes` of shared memory after
// `block_bytes`), and at least `min_threads` threads and one block (the forward's last block
// writes the counts and sums even for zero tokens), one wave and max_blocks at most.
int warps_per_block(size_t block_bytes, size_t warp_bytes) {
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
  const bool aux = params.aux_sums != nullptr;
  dispatch_per_lane(params.experts, [&](auto per_lane) {
    // At most a block per Σ lse² word at the scratch's end (router_forward_scratch_words).
    launch(router_forward_kernel<per_lane>, params, forward_block_bytes(params.experts),
           forward_warp_bytes(params.experts, aux), stream, 0, forward_max_blocks(params));
  });
}

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
