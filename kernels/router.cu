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

constexpr int kSplitThreads = 256;  // router_grad_split_kernel's elementwise blocks
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

// Up to 16 warps per block, as many as kSharedBudget holds: fewer, larger blocks than one per
// four tokens, because each block ends with atomics on the launch's sums (E addresses) and a
// ticket, and those, not the tokens' work, decided the time when 2,048 blocks of 4 warps took
// 8,192 tokens (~80,000 atomics on a few cache lines).
constexpr int kMaxWarpsPerBlock = 16;
constexpr int kMaxThreads = kMaxWarpsPerBlock * kWarpSize;
// What a launch gets without opting in, less room for the forward's static shared memory (its
// flag and the aux loss's partial sums: static and dynamic count together against the 48 KB).
constexpr size_t kSharedBudget = 48 * 1024 - 256;

// Block b adds its sums into replica b % kRouterSumReplicas (router.h): a replica's E addresses
// take 1/8 of the blocks' atomics.
__device__ __host__ constexpr int64_t scratch_replica_words(int64_t experts) {
  return kRouterSumReplicas * experts;
}

// Shared memory of the forward: the last block's sums of the replicas, counts and aux [E] (u64);
// then per warp its own fixed-point aux sums [E] (u64, with aux_sums), counts [E] (u32), scores and
// choice keys [E] (fp32) and chosen experts [k] (i32), padded to 8 bytes. Per-warp sums need no
// atomics: a warp's lanes own distinct experts.
__host__ __device__ size_t forward_block_bytes(int64_t experts) {
  return static_cast<size_t>(2 * experts) * sizeof(unsigned long long);
}
__host__ __device__ size_t forward_warp_bytes(int64_t experts, int64_t topk, bool aux) {
  const size_t bytes = static_cast<size_t>(experts) * ((aux ? 8 : 0) + 4 + 2 * 4) + 4 * topk;
  return (bytes + 7) / 8 * 8;
}

// 4 blocks of 16 warps per SM (32 registers): every warp of the SM resident.
__global__ void __launch_bounds__(kMaxThreads, 4) router_forward_kernel(const RouterParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  const bool aux = p.aux_sums != nullptr;
  const size_t warp_bytes = forward_warp_bytes(experts, topk, aux);
  const auto warp_row = [&](int w) {
    return shared + forward_block_bytes(experts) + w * warp_bytes;
  };
  // This warp's rows; another warp's are at the same offsets from warp_row(w).
  const size_t counts_offset = aux ? experts * sizeof(unsigned long long) : 0;
  auto* aux_own = reinterpret_cast<unsigned long long*>(warp_row(warp));
  auto* counts_own = reinterpret_cast<unsigned*>(warp_row(warp) + counts_offset);
  float* s = reinterpret_cast<float*>(counts_own + experts);
  float* key = s + experts;
  int* chosen = reinterpret_cast<int*>(key + experts);
  for (int e = lane; e < experts; e += kWarpSize) {
    counts_own[e] = 0;
    if (aux) aux_own[e] = 0;
  }
  __syncwarp();
  bool aux_nan = false;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const RowStats stats = score_row(p, p.logits + t * experts, s, lane);
    if (lane == 0) p.lse[t] = stats.lse;
    for (int e = lane; e < experts; e += kWarpSize) {
      key[e] = p.expert_bias ? s[e] + p.expert_bias[e] : s[e];
      if (aux) {
        const float a = p.sigmoid ? s[e] / (stats.score_sum + kNormEps) : s[e];
        if (isnan(a)) {
          aux_nan = true;
        } else {  // a in [0, 1]: a non-negative count
          aux_own[e] += static_cast<unsigned long long>(__float2ll_rn(a * kAuxScale));
        }
      }
    }
    __syncwarp();
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
      __syncwarp();  // every lane's reads of key before lane 0 writes one (racecheck)
      if (lane == 0) {
        chosen[j] = best_e;
        key[best_e] = -FLT_MAX;  // taken: no finite score or bias reaches it
      }
      __syncwarp();
    }
    // The k choices written side by side (no read-back of probs from global memory). The count is
    // a shared atomic: the fallback above can repeat an expert (a row of NaN keys after a choice).
    int64_t* indices = p.indices + t * topk;
    float* probs = p.probs + t * topk;
    for (int j = lane; j < topk; j += kWarpSize) {
      const int e = chosen[j];
      indices[j] = e;
      probs[j] = p.normalize ? s[e] / (chosen_sum + kNormEps) : s[e];
      atomicAdd(&counts_own[e], 1u);
    }
    __syncwarp();
  }

  // The block's counts and sums into its replica (integer adds: any order gives the same bits),
  // then the last block to finish adds the replicas and writes counts and aux_sums.
  auto* scratch = reinterpret_cast<unsigned long long*>(p.scratch);
  const int64_t replica = blockIdx.x % kRouterSumReplicas;
  unsigned long long* count_sums = scratch;                                 // [replicas][E]
  unsigned long long* aux_sums = scratch + scratch_replica_words(experts);  // [replicas][E]
  unsigned long long* nan_flag = aux_sums + scratch_replica_words(experts);
  unsigned long long* finished = nan_flag + 1;
  __shared__ bool last;
  if (aux && __any_sync(0xffffffffu, aux_nan) && lane == 0) atomicOr(nan_flag, 1ull);
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
  __threadfence();  // this block's adds before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(finished, 1ull) == gridDim.x - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // every block's adds (before their counts) are visible
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
  if (!p.aux_loss) return;
  // The load-balancing loss in a fixed order (each warp's shuffles, then the warps in turn).
  __shared__ double warp_parts[kMaxWarpsPerBlock];
  loss_part = warp_sum(loss_part);
  if (lane == 0) warp_parts[warp] = loss_part;
  __syncthreads();
  if (threadIdx.x == 0) {
    double loss = 0.0;
    for (int w = 0; w < warps; ++w) loss += warp_parts[w];
    *p.aux_loss = static_cast<float>(loss * p.aux_loss_scale);
  }
}

// g as hi + lo, both bf16 rounded to nearest even (router.h's split).
struct RouterHalves {
  __nv_bfloat16 hi;
  __nv_bfloat16 lo;
};

__device__ __forceinline__ RouterHalves split_halves(float g) {
  const __nv_bfloat16 hi = __float2bfloat16_rn(g);
  return {hi, __float2bfloat16_rn(g - __bfloat162float(hi))};
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

// The 16-byte pieces of W the backward copies into [W; W] as such: all of W when its size and
// both addresses allow (the second copy then starts at a piece too), else none.
__host__ __device__ int64_t stacked_pieces(const RouterParams& p) {
  const int64_t w = p.experts * p.hidden;
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(p.split_weight) | reinterpret_cast<uintptr_t>(p.stacked)) %
       16) == 0;
  return p.stacked && w % 8 == 0 && aligned ? w / 8 : 0;
}

// Shared memory of the backward: per warp its scores and their gradient [E] each (fp32).
__host__ __device__ size_t backward_warp_bytes(int64_t experts) {
  return static_cast<size_t>(2 * experts) * sizeof(float);
}

// 3 blocks of 16 warps per SM (40 registers; at 32 it spills ~80 bytes a thread).
__global__ void __launch_bounds__(kMaxThreads, 3) router_backward_kernel(const RouterParams p) {
  extern __shared__ __align__(16) unsigned char shared[];
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int experts = static_cast<int>(p.experts), topk = static_cast<int>(p.topk);
  float* s = reinterpret_cast<float*>(shared + warp * backward_warp_bytes(experts));
  float* ds = s + experts;
  const float loss_grad =
      p.grad_aux_loss ? static_cast<float>(*p.grad_aux_loss * p.aux_loss_scale) : 0.0f;
  const bool has_gp = p.grad_probs || p.grad_probs_rows;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * warps + warp; t < p.tokens;
       t += static_cast<int64_t>(gridDim.x) * warps) {
    const float* row = p.logits + t * experts;
    // Loads the row's reductions do not wait for, issued before them: the logsumexp's gradient
    // and, for k <= 32, lane j's slot.
    const float gl = p.grad_lse ? p.grad_lse[t] : 0.0f;
    const bool one_round = topk <= kWarpSize;
    ChosenSlot first;
    if (has_gp && one_round && lane < topk) first = load_slot(p, t * topk + lane);
    // The gradient of aux_sums (every token's aux[t, e] gets it), plus the aux loss's through it:
    // aux_loss = scale · Σ_e aux_sums[e] · counts[e].
    const bool has_ga = p.grad_aux || p.grad_aux_loss;
    const auto load_grad_aux = [&](int e) {
      float g = p.grad_aux ? p.grad_aux[e] : 0.0f;
      if (p.grad_aux_loss) g += loss_grad * static_cast<float>(p.saved_counts[e]);
      return g;
    };
    const float ga_lane = has_ga && lane < experts ? load_grad_aux(lane) : 0.0f;
    const auto grad_aux = [&](int e) { return e == lane ? ga_lane : load_grad_aux(e); };
    const RowStats stats = score_row(p, row, s, lane);
    // d/ds of the aux scores: the identity for softmax; through s / (Σ s + eps) for sigmoid.
    float aux_dot = 0.0f;
    if (has_ga && p.sigmoid) {
      for (int e = lane; e < experts; e += kWarpSize)
        aux_dot += grad_aux(e) * s[e] / (stats.score_sum + kNormEps);
      aux_dot = warp_sum(aux_dot);
    }
    for (int e = lane; e < experts; e += kWarpSize) {
      float g = 0.0f;
      if (has_ga) {
        g = p.sigmoid ? (grad_aux(e) - aux_dot) / (stats.score_sum + kNormEps) : grad_aux(e);
      }
      ds[e] = g;
    }
    __syncwarp();
    // d/ds of the chosen probabilities (distinct experts: each lane owns its j's expert).
    if (has_gp) {
      const auto slot = [&](int j) { return one_round ? first : load_slot(p, t * topk + j); };
      // An index outside [0, experts) (not one router_topk wrote) is never used as an address:
      // it reaches no score past the row's (the row's gradient is then not meaningful).
      const auto valid = [&](const ChosenSlot& c) { return c.index >= 0 && c.index < experts; };
      float dot = 0.0f, chosen_sum = 0.0f;
      for (int j = lane; j < topk; j += kWarpSize) {
        const ChosenSlot c = slot(j);
        dot += c.grad * c.prob;
        if (valid(c)) chosen_sum += s[c.index];
      }
      dot = warp_sum(dot);
      chosen_sum = warp_sum(chosen_sum);
      for (int j = lane; j < topk; j += kWarpSize) {
        const ChosenSlot c = slot(j);
        if (valid(c))
          ds[c.index] += p.normalize ? (c.grad - dot) / (chosen_sum + kNormEps) : c.grad;
      }
      __syncwarp();
    }
    // Through the scores to the logits, plus the logsumexp's softmax.
    float s_dot = 0.0f;
    if (!p.sigmoid) {
      for (int e = lane; e < experts; e += kWarpSize) s_dot += s[e] * ds[e];
      s_dot = warp_sum(s_dot);
    }
    float* out = p.grad_logits + t * experts;
    auto* hilo = static_cast<__nv_bfloat16*>(p.grad_hilo);  // row t at t · 2E, when given
    for (int e = lane; e < experts; e += kWarpSize) {
      const float softmax = p.sigmoid ? expf(row[e] - stats.lse) : s[e];
      const float d = p.sigmoid ? ds[e] * s[e] * (1.0f - s[e]) : s[e] * (ds[e] - s_dot);
      const float g = d + gl * softmax;
      out[e] = g;
      if (p.grad_hilo) {
        const RouterHalves halves = split_halves(g);
        hilo[t * 2 * experts + e] = halves.hi;
        hilo[t * 2 * experts + experts + e] = halves.lo;
      }
    }
    __syncwarp();
  }
  if (p.stacked) {
    // [W; W] for the logits' backward, after the tokens (its loads would hold up this thread's
    // first token): W's E·H elements over the grid, by 16-byte pieces where its size and
    // addresses allow (the launch has enough blocks for them), the rest one at a time.
    const auto* weight = static_cast<const __nv_bfloat16*>(p.split_weight);
    auto* stacked = static_cast<__nv_bfloat16*>(p.stacked);
    const int64_t w = p.experts * p.hidden;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t pieces = stacked_pieces(p);
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
}

__global__ void __launch_bounds__(kSplitThreads)
    router_grad_split_kernel(const float* grad, __nv_bfloat16* hilo, int64_t tokens,
                             int64_t experts, const __nv_bfloat16* weight, __nv_bfloat16* stacked,
                             int64_t hidden) {
  const int64_t n = tokens * experts, w = weight ? experts * hidden : 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kSplitThreads) + threadIdx.x; i < n + w;
       i += static_cast<int64_t>(gridDim.x) * kSplitThreads) {
    if (i < n) {
      const int64_t t = i / experts, e = i % experts;
      const RouterHalves halves = split_halves(grad[i]);
      hilo[t * 2 * experts + e] = halves.hi;
      hilo[t * 2 * experts + experts + e] = halves.lo;
    } else {
      const __nv_bfloat16 v = weight[i - n];
      stacked[i - n] = v;
      stacked[i - n + w] = v;
    }
  }
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
// writes the counts and sums even for zero tokens), one wave at most.
template <typename Kernel>
void launch(Kernel* kernel, const RouterParams& p, size_t block_bytes, size_t warp_bytes,
            cudaStream_t stream, int64_t min_threads = 0) {
  TORCH_INTERNAL_ASSERT(block_bytes + warp_bytes <= kSharedBudget,
                        "router launch: one warp's shared memory exceeds the budget");
  const int warps = static_cast<int>(
      std::min<size_t>(kMaxWarpsPerBlock, (kSharedBudget - block_bytes) / warp_bytes));
  const int threads = warps * kWarpSize;
  const size_t shared = block_bytes + warps * warp_bytes;
  const int64_t blocks =
      std::max<int64_t>({1, (p.tokens + warps - 1) / warps, (min_threads + threads - 1) / threads});
  kernel<<<one_wave_grid(kernel, threads, shared, blocks), threads, shared, stream>>>(p);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

int64_t router_forward_scratch_words(int64_t experts) {
  return 2 * scratch_replica_words(experts) + 2;
}

void launch_router_forward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_forward: unsupported experts/topk");
  TORCH_INTERNAL_ASSERT(params.scratch && params.counts,
                        "launch_router_forward: needs scratch and counts");
  TORCH_INTERNAL_ASSERT(!params.aux_sums || params.tokens < kRouterMaxAuxTokens,
                        "launch_router_forward: aux_sums needs T < 2^31");
  const bool aux = params.aux_sums != nullptr;
  launch(router_forward_kernel, params, forward_block_bytes(params.experts),
         forward_warp_bytes(params.experts, params.topk, aux), stream);
}

void launch_router_backward(const RouterParams& params, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(params.experts > 0 && params.experts <= kRouterMaxExperts &&
                            params.topk >= 1 && params.topk <= params.experts,
                        "launch_router_backward: unsupported experts/topk");
  TORCH_INTERNAL_ASSERT(!params.grad_probs_rows == !params.probs_row_map,
                        "launch_router_backward: grad_probs_rows needs probs_row_map");
  TORCH_INTERNAL_ASSERT(!params.stacked || (params.split_weight && params.hidden > 0),
                        "launch_router_backward: stacked needs split_weight and hidden");
  if (params.tokens == 0 && !params.stacked) return;
  // A thread per piece (or element) of [W; W]'s copy too: few tokens must not leave one block
  // copying all of W.
  const int64_t pieces = stacked_pieces(params);
  const int64_t copy_threads =
      params.stacked ? (pieces > 0 ? pieces : params.experts * params.hidden) : 0;
  launch(router_backward_kernel, params, 0, backward_warp_bytes(params.experts), stream,
         copy_threads);
}

void launch_router_grad_split(const RouterGradSplitParams& p, cudaStream_t stream) {
  const int64_t n = p.tokens * p.experts + (p.weight ? p.experts * p.hidden : 0);
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
