// Token permutation kernels. Layout and semantics: token_permutation.h.
//
// Routing map: a stable counting sort of the slots by expert (dropped slots after every expert) in
// two launches: each block counts its chunk of slots per expert, then each block places its chunk
// after the earlier experts' and earlier chunks' slots (routing_scatter_kernel). Only the counts
// go back to the host (the caller needs them as m_splits), so there is no other synchronisation.
//
// Row kernels: warps take work items (grid-stride), a few chunks of one token's row (permute), one
// chunk of a token's output row (unpermute) or an output row (unpermute's backward), their lanes
// striding over the hidden dimension in 16-byte vectors when H and the pointers allow, else one
// element at a time. Each output element is written by one warp, so nothing needs atomics, and a
// warp per row keeps the probability gradient's dot product a shuffle reduction. Rows start at
// different chunks (chunk_start; docs/experiments.md has the measurements without it), except in
// permute, whose full grid spreads them (permute_kernel).

#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/token_permutation.h"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;

// ---- routing map -----------------------------------------------------------------------------

// Bins of the counting sort: E experts, then dropped slots (-1), then indices outside [-1, E).
__host__ __device__ int64_t routing_bins(int64_t experts) { return experts + 2; }

template <typename Index>
__device__ __forceinline__ int32_t routing_key(const Index* indices, int64_t slot,
                                               int32_t experts) {
  const int64_t e = static_cast<int64_t>(indices[slot]);
  return (e >= 0 && e < experts) ? static_cast<int32_t>(e) : e == -1 ? experts : experts + 1;
}

// How the slots are cut: each block takes `warps` consecutive spans of `span` slots (one per
// warp). Each block reads every block's counts (chunks x bins), so the chunk count is kept to
// about sqrt(kMapCountReads / bins): more blocks for parallelism, fewer for that quadratic read.
constexpr int kMaxMapWarps = 4;  // 8 left half of the SMs idle on moe-lm (64 blocks)
constexpr int64_t kMapCountReads = int64_t{1} << 22;
constexpr size_t kMapSharedBudget = 32 * 1024;  // of the 48 KB a launch gets without opting in

struct MapChunking {
  int warps = 1;       // per block
  int64_t span = 0;    // slots per warp, a multiple of 32
  int64_t chunks = 0;  // blocks
  size_t scatter_shared_bytes = 0;
};

MapChunking map_chunking(int64_t slots, int64_t experts) {
  const int64_t bins = routing_bins(experts);
  MapChunking c;
  // The scatter's shared memory: each bin's first position, then each warp's next positions.
  c.warps = static_cast<int>(std::min<int64_t>(
      kMaxMapWarps, static_cast<int64_t>(kMapSharedBudget / (sizeof(int32_t) * bins)) - 1));
  TORCH_INTERNAL_ASSERT(c.warps >= 1, "routing map: ", experts,
                        " experts exceed the kernel's bins");
  const auto max_chunks = std::max<int64_t>(
      1, static_cast<int64_t>(std::sqrt(static_cast<double>(kMapCountReads) / bins)));
  const int64_t per_warp = (slots + c.warps * max_chunks - 1) / (c.warps * max_chunks);
  c.span = std::max<int64_t>(kWarpSize, (per_warp + kWarpSize - 1) / kWarpSize * kWarpSize);
  c.chunks = (slots + c.warps * c.span - 1) / (c.warps * c.span);
  c.scatter_shared_bytes = sizeof(int32_t) * bins * (1 + c.warps);
  return c;
}

// Block c counts its chunk's slots per bin into chunk_counts[bin][c] (a bin's counts side by
// side, for the scatter's reads across chunks).
template <typename Index>
__global__ void routing_histogram_kernel(const Index* __restrict__ indices, int64_t slots,
                                         int32_t experts, int64_t chunk,
                                         int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t hist[];
  allow_dependent_launch();
  const int32_t bins = static_cast<int32_t>(routing_bins(experts));
  for (int32_t b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
  wait_for_prior_grid();
  __syncthreads();
  const int64_t lo = blockIdx.x * chunk, hi = std::min(slots, lo + chunk);
  for (int64_t s = lo + threadIdx.x; s < hi; s += blockDim.x) {
    atomicAdd(&hist[routing_key(indices, s, experts)], 1);
  }
  __syncthreads();
  for (int32_t b = threadIdx.x; b < bins; b += blockDim.x) {
    chunk_counts[b * static_cast<int64_t>(gridDim.x) + blockIdx.x] = hist[b];
  }
}

// In-place exclusive prefix sums of a[0, n) in shared memory, by the whole block: each thread a
// contiguous run, the runs' totals scanned across the warps. Synchronizes at the end.
__device__ void block_exclusive_scan(int32_t* a, int32_t n, int32_t* warp_totals) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int32_t per = (n + blockDim.x - 1) / blockDim.x;
  const int32_t lo = min(n, static_cast<int32_t>(threadIdx.x) * per), hi = min(n, lo + per);
  int32_t run = 0;
  for (int32_t i = lo; i < hi; ++i) run += a[i];
  const int32_t inclusive = warp_inclusive_scan(run);
  if (lane == kWarpSize - 1) warp_totals[warp] = inclusive;
  __syncthreads();
  int32_t offset = inclusive - run;
  for (int w = 0; w < warp; ++w) offset += warp_totals[w];
  for (int32_t i = lo; i < hi; ++i) {
    const int32_t v = a[i];
    a[i] = offset;
    offset += v;
  }
  __syncthreads();
}

// Block c places its chunk: each bin starts after the earlier bins' slots and the earlier chunks'
// slots of that bin; within the chunk, warp w's span after warps 0..w-1, and within a warp's 32
// slots, peers of one bin in lane order (match_any): a stable counting sort in two launches.
template <typename Index>
__global__ void routing_scatter_kernel(
    const Index* __restrict__ indices, int64_t slots, int32_t experts, int64_t span,
    const int32_t* __restrict__ chunk_counts, int64_t chunks, int64_t topk,
    int64_t* __restrict__ counts, int64_t* __restrict__ row_map, int64_t* __restrict__ sorted_slots,
    int64_t* __restrict__ row_tokens, const float* __restrict__ probs,
    float* __restrict__ row_probs) {
  extern __shared__ int32_t map_shared[];
  __shared__ int32_t warp_totals[kMaxMapWarps];
  allow_dependent_launch();
  wait_for_prior_grid();
  const int warps = blockDim.x / kWarpSize;
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int32_t bins = static_cast<int32_t>(routing_bins(experts));
  int32_t* first = map_shared;        // [bins]: the chunk's first position per bin
  int32_t* next = map_shared + bins;  // [warps][bins]: each warp's next position per bin
  const int64_t c = blockIdx.x;
  // Per bin (a warp each, its lanes across the chunks): the total, then scanned into the bin's
  // start, and the earlier chunks' count, kept in next[] until the scan is done.
  for (int32_t b = warp; b < bins; b += warps) {
    int32_t total = 0, before = 0;
    for (int64_t k = lane; k < chunks; k += kWarpSize) {
      const int32_t n = chunk_counts[b * chunks + k];
      total += n;
      if (k < c) before += n;
    }
    total = warp_sum(total);
    before = warp_sum(before);
    if (lane == 0) {
      first[b] = total;
      next[b] = before;
      if (c == 0) counts[b] = total;
    }
  }
  __syncthreads();
  block_exclusive_scan(first, bins, warp_totals);
  for (int32_t b = threadIdx.x; b < bins; b += blockDim.x) first[b] += next[b];
  __syncthreads();
  for (int32_t i = threadIdx.x; i < warps * bins; i += blockDim.x) next[i] = 0;
  __syncthreads();
  const int64_t lo = (c * warps + warp) * span, hi = std::min(slots, lo + span);
  int32_t* own = next + warp * bins;
  // This warp's count per bin (a group's lowest lane adds for its peers: no two lanes one bin).
  for (int64_t s0 = lo; s0 < hi; s0 += kWarpSize) {
    const int64_t s = s0 + lane;
    const unsigned active = __ballot_sync(0xffffffffu, s < hi);
    if (s < hi) {
      const int32_t key = routing_key(indices, s, experts);
      const unsigned peers = __match_any_sync(active, key);
      if (lane == __ffs(peers) - 1) own[key] += __popc(peers);
    }
    __syncwarp();  // this round's adds before the next round's
  }
  __syncthreads();
  for (int32_t b = threadIdx.x; b < bins; b += blockDim.x) {
    int32_t position = first[b];
    for (int w = 0; w < warps; ++w) {
      const int32_t n = next[w * bins + b];
      next[w * bins + b] = position;
      position += n;
    }
  }
  __syncthreads();
  for (int64_t s0 = lo; s0 < hi; s0 += kWarpSize) {
    const int64_t s = s0 + lane;
    const unsigned active = __ballot_sync(0xffffffffu, s < hi);
    int32_t key = 0;
    unsigned peers = 0;
    if (s < hi) {
      key = routing_key(indices, s, experts);
      peers = __match_any_sync(active, key);
      const int32_t position = own[key] + __popc(peers & ((1u << lane) - 1u));
      sorted_slots[position] = s;
      row_tokens[position] = s / topk;
      if (row_probs != nullptr) row_probs[position] = probs[s];
      row_map[s] = key < experts ? position : -1;
    }
    __syncwarp();
    if (s < hi && lane == __ffs(peers) - 1) own[key] += __popc(peers);
    __syncwarp();
  }
}

// ---- row kernels -----------------------------------------------------------------------------

template <typename S>
__device__ __forceinline__ float prob_at(const S* probs, int64_t slot) {
  return probs ? to_float(probs[slot]) : 1.0f;
}

// One warp writes zeros over a row of `hidden` elements.
template <typename T, int V>
__device__ __forceinline__ void store_zero_row(T* row, int lane, int64_t hidden) {
  Vec<T, V> zero;
#pragma unroll
  for (int i = 0; i < V; ++i) zero.v[i] = from_float<T>(0.0f);
  for (int64_t c = lane * V; c < hidden; c += kWarpSize * V) store<T, V>(row + c, zero);
}

// A store that asks L2 to evict its lines first (st.global.cs): unpermute's backward writes M rows
// once while each of its T gradient rows is read k times, and those reads hit L2 only if the
// written rows do not push the sources out.
template <typename T, int V>
__device__ __forceinline__ void store_streaming(T* p, const Vec<T, V>& x) {
  if constexpr (sizeof(Vec<T, V>) == 16) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&x));
  } else {
    store<T, V>(p, x);
  }
}

// A warp's work item is kPermuteBatch chunks of one token's row: loaded once (all of them before
// any store, so that each lane has that many loads in flight) and written to each permuted row its
// slots name. (A warp per permuted row read each token row k times, and the written rows pushed
// the sources out of L2: qwen3-30b-a3b's gather read 174 MB from DRAM for a 34 MB source.) A
// token's items are consecutive, so its row is read once from DRAM either way. The grid has a
// block per eight items (full_grid), and consecutive warps take consecutive chunks of a row, so
// the stores spread over the row without chunk_start. Measured on the H100 with a standalone copy,
// taking turns (% of copy, five benchmark shapes): 89-95 against 85-88 for the one-wave loop with
// rotated chunks it replaced, 88-93 for the full grid with them (bench_moe_layer, taking turns
// with the loop: 90-94 against 84-90). Then the rows no slot names (padding: sorted_slots -1) get
// zeros, a warp checking 32 rows at a time.
constexpr int kPermuteBatch = 2;

template <typename T, typename S, int V>
__global__ void permute_kernel(const T* __restrict__ input, const int64_t* __restrict__ row_map,
                               const int64_t* __restrict__ sorted_slots,
                               const S* __restrict__ probs, T* __restrict__ output, int64_t tokens,
                               int64_t rows, int64_t topk, int64_t hidden) {
  wait_for_prior_grid();
  const int64_t chunks = chunk_count<V>(hidden);
  const int64_t batches = (chunks + kPermuteBatch - 1) / kPermuteBatch;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t item = first_warp; item < tokens * batches; item += warps) {
    const int64_t t = item / batches;
    const int64_t chunk0 = (item - t * batches) * kPermuteBatch;
    const T* src = input + t * hidden;
    Vec<T, V> x[kPermuteBatch];
    int64_t c[kPermuteBatch];
#pragma unroll
    for (int b = 0; b < kPermuteBatch; ++b) {
      c[b] = chunk0 + b < chunks ? (chunk0 + b) * kWarpSize * V + lane * V : hidden;
      if (c[b] < hidden) x[b] = load<T, V>(src + c[b]);
    }
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t row = row_map[t * topk + j];
      if (row < 0 || row >= rows) continue;  // a dropped slot (or a map out of contract)
      const float p = prob_at(probs, t * topk + j);
#pragma unroll
      for (int b = 0; b < kPermuteBatch; ++b) {
        if (c[b] >= hidden) continue;
        Vec<T, V> y = x[b];
        if (probs) {
#pragma unroll
          for (int i = 0; i < V; ++i) y.v[i] = from_float<T>(p * to_float(y.v[i]));
        }
        store<T, V>(output + row * hidden + c[b], y);
      }
    }
  }
  for (int64_t r0 = first_warp * kWarpSize; r0 < rows; r0 += warps * kWarpSize) {
    unsigned padding = __ballot_sync(0xffffffffu, r0 + lane < rows && sorted_slots[r0 + lane] < 0);
    for (; padding != 0; padding &= padding - 1) {
      store_zero_row<T, V>(output + (r0 + __ffs(padding) - 1) * hidden, lane, hidden);
    }
  }
}

// A warp's work item is one chunk of one token's output row, consecutive warps on consecutive
// chunks: the k slots' rows loaded kUnpermuteBatch at a time, each batch before any of it is
// added (in slot order, as one at a time would, so the sum does not depend on the batching).
// Measured on the H100, taking turns (% of copy on the five benchmark shapes): 72-98 as here;
// four or eight slots a batch 54-93 and 48-87 (more registers, fewer warps resident); two chunks
// an item 61-84. In another run against the warp per token it replaced: 72-92 vs 65-85.
constexpr int kUnpermuteBatch = 2;

template <typename T, typename S, int V>
__global__ void unpermute_kernel(const T* __restrict__ input, const int64_t* __restrict__ row_map,
                                 const S* __restrict__ probs, T* __restrict__ output,
                                 int64_t tokens, int64_t rows, int64_t topk, int64_t hidden) {
  const int64_t chunks = chunk_count<V>(hidden);
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       item < tokens * chunks; item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t t = item / chunks;
    const int64_t c = chunk_start<V>(item - t * chunks, t, chunks) + lane * V;
    if (c >= hidden) continue;
    float acc[V] = {};
    for (int64_t j0 = 0; j0 < topk; j0 += kUnpermuteBatch) {
      Vec<T, V> x[kUnpermuteBatch];
      bool kept[kUnpermuteBatch];
#pragma unroll
      for (int b = 0; b < kUnpermuteBatch; ++b) {
        const int64_t row = j0 + b < topk ? row_map[t * topk + j0 + b] : -1;
        kept[b] = row >= 0 && row < rows;  // else a dropped slot (or a map out of contract)
        if (kept[b]) x[b] = load<T, V>(input + row * hidden + c);
      }
#pragma unroll
      for (int b = 0; b < kUnpermuteBatch; ++b) {
        if (!kept[b]) continue;
        const float p = prob_at(probs, t * topk + j0 + b);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += p * to_float(x[b].v[i]);
      }
    }
    Vec<T, V> y;
#pragma unroll
    for (int i = 0; i < V; ++i) y.v[i] = from_float<T>(acc[i]);
    store<T, V>(output + t * hidden + c, y);
  }
}

// Rows of one element (e.g. the rows' probabilities, permuted as k = 1 token rows): a thread per
// token or row rather than a warp, 31 of whose lanes would idle. The same arithmetic as the warp
// kernels above (the same bits).
template <typename T, typename S>
__global__ void permute_scalar_kernel(const T* __restrict__ input,
                                      const int64_t* __restrict__ row_map,
                                      const int64_t* __restrict__ sorted_slots,
                                      const S* __restrict__ probs, T* __restrict__ output,
                                      int64_t tokens, int64_t rows, int64_t topk) {
  const int64_t n = std::max(tokens, rows);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (i < tokens) {
      const T x = input[i];
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t row = row_map[i * topk + j];
        if (row < 0 || row >= rows) continue;
        output[row] = probs ? from_float<T>(prob_at(probs, i * topk + j) * to_float(x)) : x;
      }
    }
    if (i < rows && sorted_slots[i] < 0) output[i] = from_float<T>(0.0f);
  }
}

template <typename T, typename S>
__global__ void unpermute_scalar_kernel(const T* __restrict__ input,
                                        const int64_t* __restrict__ row_map,
                                        const S* __restrict__ probs, T* __restrict__ output,
                                        int64_t tokens, int64_t rows, int64_t topk) {
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t row = row_map[t * topk + j];
      if (row >= 0 && row < rows) acc += prob_at(probs, t * topk + j) * to_float(input[row]);
    }
    output[t] = from_float<T>(acc);
  }
}

template <typename T, typename S, int V>
__global__ void unpermute_backward_kernel(
    const T* __restrict__ grad_out, const int64_t* __restrict__ sorted_slots,
    const S* __restrict__ probs, const T* __restrict__ permuted, T* __restrict__ grad_permuted,
    S* __restrict__ grad_probs, int64_t slots, int64_t rows, int64_t topk, int64_t hidden) {
  const int64_t chunks = chunk_count<V>(hidden);
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       r < rows; r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t slot = sorted_slots[r];
    // A row no slot maps to (padding; or a slot out of contract): zero gradient, no probability.
    if (slot < 0 || slot >= slots) {
      store_zero_row<T, V>(grad_permuted + r * hidden, lane, hidden);
      continue;
    }
    const T* g_row = grad_out + (slot / topk) * hidden;
    const float p = prob_at(probs, slot);
    float dot = 0.0f;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t c = chunk_start<V>(chunk, r, chunks) + lane * V;
      if (c >= hidden) continue;
      const Vec<T, V> g = load<T, V>(g_row + c);
      const Vec<T, V> x = load<T, V>(permuted + r * hidden + c);
      Vec<T, V> d;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float gi = to_float(g.v[i]);
        d.v[i] = from_float<T>(p * gi);
        dot += gi * to_float(x.v[i]);
      }
      store_streaming<T, V>(grad_permuted + r * hidden + c, d);
    }
    dot = warp_sum(dot);
    if (lane == 0) grad_probs[slot] = from_float<S>(dot);
  }
}

// One wave of warp-per-row blocks, or fewer when there are fewer rows.
template <typename Kernel>
unsigned row_grid(Kernel* kernel, int64_t rows) {
  return one_wave_grid(kernel, kThreads, 0, (rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// One wave of thread-per-row blocks, or fewer when there are fewer rows.
template <typename Kernel>
unsigned thread_grid(Kernel* kernel, int64_t rows) {
  return one_wave_grid(kernel, kThreads, 0, (rows + kThreads - 1) / kThreads);
}

// Resolves data type T, probability type S and vector width V (16 bytes when H and `pointers`
// allow), then calls launch(T{}, S{}, V tag) and checks the launch.
template <typename Launch>
void dispatch(const PermuteParams& params, int64_t out_rows,
              std::initializer_list<const void*> pointers, Launch&& launch) {
  if (out_rows == 0 || params.hidden == 0) return;
  dispatch_type(params.data_type, [&](auto data_tag) {
    dispatch_type(params.prob_type, [&](auto prob_tag) {
      constexpr int kVec = 16 / sizeof(decltype(data_tag));
      if (params.hidden % kVec == 0 && aligned16(pointers)) {
        launch(data_tag, prob_tag, std::integral_constant<int, kVec>{});
      } else {
        launch(data_tag, prob_tag, std::integral_constant<int, 1>{});
      }
    });
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t routing_map_workspace_bytes(int64_t slots, int64_t experts) {
  return sizeof(int32_t) * map_chunking(slots, experts).chunks * routing_bins(experts);
}

void launch_routing_map(const RoutingMapParams& params, cudaStream_t stream) {
  const int64_t slots = params.tokens * params.topk;
  const int64_t bins = routing_bins(params.experts);
  TORCH_INTERNAL_ASSERT(params.experts <= kRoutingMapMaxExperts,
                        "launch_routing_map: more experts than the kernel's bins");
  if (slots == 0) {
    TORCHMOE_CUDA_CHECK(cudaMemsetAsync(params.counts, 0, bins * sizeof(int64_t), stream));
    return;
  }
  TORCH_INTERNAL_ASSERT(
      params.workspace_bytes >= routing_map_workspace_bytes(slots, params.experts),
      "launch_routing_map: workspace too small");
  const MapChunking c = map_chunking(slots, params.experts);
  const auto experts = static_cast<int32_t>(params.experts);
  auto* chunk_counts = static_cast<int32_t*>(params.workspace);
  const int threads = c.warps * kWarpSize;
  auto launch = [&](auto index_tag) {
    using Index = decltype(index_tag);
    const auto* indices = static_cast<const Index*>(params.indices);
    // Each launch may start while the kernel before it finishes (the router's, then the
    // histogram): its blocks wait at wait_for_prior_grid, so only the launch latency overlaps.
    launch_dependent(routing_histogram_kernel<Index>, static_cast<unsigned>(c.chunks), threads,
                     bins * sizeof(int32_t), stream, indices, slots, experts, c.warps * c.span,
                     chunk_counts);
    launch_dependent(routing_scatter_kernel<Index>, static_cast<unsigned>(c.chunks), threads,
                     c.scatter_shared_bytes, stream, indices, slots, experts, c.span, chunk_counts,
                     c.chunks, params.topk, params.counts, params.row_map, params.sorted_slots,
                     params.row_tokens, params.probs, params.row_probs);
  };
  if (params.indices_int32) {
    launch(int32_t{});
  } else {
    launch(int64_t{});
  }
}

void launch_permute(const PermuteParams& params, cudaStream_t stream) {
  dispatch(
      params, params.rows, {params.input, params.output},
      [&](auto data_tag, auto prob_tag, auto vec) {
        using T = decltype(data_tag);
        using S = decltype(prob_tag);
        if (params.hidden == 1) {
          auto* kernel = permute_scalar_kernel<T, S>;
          kernel<<<thread_grid(kernel, std::max(params.tokens, params.rows)), kThreads, 0,
                   stream>>>(static_cast<const T*>(params.input), params.row_map,
                             params.sorted_slots, static_cast<const S*>(params.probs),
                             static_cast<T*>(params.output), params.tokens, params.rows,
                             params.topk);
          return;
        }
        // May start while the routing map's scatter finishes (wait_for_prior_grid).
        auto* kernel = permute_kernel<T, S, decltype(vec)::value>;
        const int64_t items =
            params.tokens *
            ((chunk_count<decltype(vec)::value>(params.hidden) + kPermuteBatch - 1) /
             kPermuteBatch);
        launch_dependent(
            kernel,
            full_grid(std::max(items, (params.rows + kWarpSize - 1) / kWarpSize), kWarpsPerBlock),
            kThreads, 0, stream, static_cast<const T*>(params.input), params.row_map,
            params.sorted_slots, static_cast<const S*>(params.probs),
            static_cast<T*>(params.output), params.tokens, params.rows, params.topk, params.hidden);
      });
}

void launch_unpermute(const PermuteParams& params, cudaStream_t stream) {
  dispatch(params, params.tokens, {params.input, params.output},
           [&](auto data_tag, auto prob_tag, auto vec) {
             using T = decltype(data_tag);
             using S = decltype(prob_tag);
             if (params.hidden == 1) {
               auto* kernel = unpermute_scalar_kernel<T, S>;
               kernel<<<thread_grid(kernel, params.tokens), kThreads, 0, stream>>>(
                   static_cast<const T*>(params.input), params.row_map,
                   static_cast<const S*>(params.probs), static_cast<T*>(params.output),
                   params.tokens, params.rows, params.topk);
               return;
             }
             auto* kernel = unpermute_kernel<T, S, decltype(vec)::value>;
             const int64_t items = params.tokens * chunk_count<decltype(vec)::value>(params.hidden);
             kernel<<<row_grid(kernel, items), kThreads, 0, stream>>>(
                 static_cast<const T*>(params.input), params.row_map,
                 static_cast<const S*>(params.probs), static_cast<T*>(params.output), params.tokens,
                 params.rows, params.topk, params.hidden);
           });
}

void launch_unpermute_backward(const PermuteParams& params, cudaStream_t stream) {
  dispatch(params, params.rows, {params.input, params.output, params.permuted},
           [&](auto data_tag, auto prob_tag, auto vec) {
             using T = decltype(data_tag);
             using S = decltype(prob_tag);
             auto* kernel = unpermute_backward_kernel<T, S, decltype(vec)::value>;
             kernel<<<row_grid(kernel, params.rows), kThreads, 0, stream>>>(
                 static_cast<const T*>(params.input), params.sorted_slots,
                 static_cast<const S*>(params.probs), static_cast<const T*>(params.permuted),
                 static_cast<T*>(params.output), static_cast<S*>(params.grad_probs),
                 params.tokens * params.topk, params.rows, params.topk, params.hidden);
           });
}

}  // namespace torchmoe::kernels
