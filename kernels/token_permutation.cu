// Token permutation kernels. Layout and semantics: token_permutation.h.
//
// Routing map: one pass turns expert indices into sort keys (dropped slots sort after every
// expert) and counts them per expert in shared memory; a stable CUB radix sort by key orders the
// slots; a last pass writes each slot's permuted row. Only the counts go back to the host (the
// caller needs them as m_splits), so there is no other synchronisation.
//
// Row kernels: one warp per token or per output row (grid-stride), its lanes striding over the
// hidden dimension in 16-byte vectors when H and the pointers allow, else one element at a time.
// Each output row is written by one warp, so nothing needs atomics, and a warp per row keeps the
// probability gradient's dot product a shuffle reduction. Rows start at different chunks
// (chunk_start; docs/performance.md has the measurements without it).

#include <cub/device/device_radix_sort.cuh>

#include <initializer_list>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/token_permutation.h"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// Histogram bins (E + 2) kept in shared memory up to this many; beyond, global atomics.
constexpr int64_t kMaxSharedBins = 8192;

// ---- routing map -----------------------------------------------------------------------------

template <typename Index>
__global__ void routing_keys_kernel(const Index* __restrict__ indices, int64_t slots,
                                    int32_t experts, int32_t* __restrict__ keys,
                                    int64_t* __restrict__ values, int32_t* __restrict__ counts) {
  extern __shared__ int32_t bins[];
  const int32_t num_bins = experts + 2;
  const bool shared = num_bins <= kMaxSharedBins;
  if (shared) {
    for (int32_t b = threadIdx.x; b < num_bins; b += blockDim.x) bins[b] = 0;
    __syncthreads();
  }
  for (int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; s < slots;
       s += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = static_cast<int64_t>(indices[s]);
    const int32_t key = (e >= 0 && e < experts) ? static_cast<int32_t>(e)
                        : e == -1               ? experts
                                                : experts + 1;
    keys[s] = key;
    values[s] = s;
    atomicAdd(shared ? &bins[key] : &counts[key], 1);
  }
  if (shared) {
    __syncthreads();
    for (int32_t b = threadIdx.x; b < num_bins; b += blockDim.x) {
      if (bins[b]) atomicAdd(&counts[b], bins[b]);
    }
  }
}

__global__ void row_map_kernel(const int32_t* __restrict__ sorted_keys,
                               const int64_t* __restrict__ sorted_slots, int64_t slots,
                               int32_t experts, int64_t* __restrict__ row_map) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < slots;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    row_map[sorted_slots[i]] = sorted_keys[i] < experts ? i : -1;
  }
}

// Workspace: keys in/out, slot values in, then CUB's temporary storage, each 256-byte aligned.
struct RoutingWorkspace {
  int32_t* keys_in;
  int32_t* keys_out;
  int64_t* values_in;
  void* cub_storage;
  size_t cub_bytes;
};

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

int end_bit(int64_t experts) {
  int bits = 1;
  while ((int64_t{1} << bits) <= experts + 1) ++bits;  // keys go up to E + 1
  return bits;
}

size_t cub_sort_bytes(int64_t slots, int64_t experts) {
  size_t bytes = 0;
  TORCHMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int64_t*>(nullptr), static_cast<int64_t*>(nullptr), static_cast<int>(slots),
      0, end_bit(experts)));
  return bytes;
}

RoutingWorkspace carve(void* base, int64_t slots, size_t cub_bytes) {
  auto* p = static_cast<char*>(base);
  RoutingWorkspace w;
  w.keys_in = reinterpret_cast<int32_t*>(p);
  p += align256(slots * sizeof(int32_t));
  w.keys_out = reinterpret_cast<int32_t*>(p);
  p += align256(slots * sizeof(int32_t));
  w.values_in = reinterpret_cast<int64_t*>(p);
  p += align256(slots * sizeof(int64_t));
  w.cub_storage = p;
  w.cub_bytes = cub_bytes;
  return w;
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

// One warp per token: the token's row is read once and written to each permuted row its slots
// name. (A warp per permuted row read each token row k times, and the written rows pushed the
// sources out of L2: qwen3-30b-a3b's gather read 174 MB from DRAM for a 34 MB source.) kBatch
// chunks are loaded before any is stored, so that each lane has that many loads in flight. Then
// the rows no slot names (padding: sorted_slots -1) get zeros, a warp checking 32 rows at a time.
template <typename T, typename S, int V>
__global__ void permute_kernel(const T* __restrict__ input, const int64_t* __restrict__ row_map,
                               const int64_t* __restrict__ sorted_slots,
                               const S* __restrict__ probs, T* __restrict__ output, int64_t tokens,
                               int64_t rows, int64_t topk, int64_t hidden) {
  constexpr int kBatch = 4;
  const int64_t chunks = chunk_count<V>(hidden);
  const int lane = threadIdx.x % kWarpSize;
  const int64_t first_warp =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = first_warp; t < tokens; t += warps) {
    const T* src = input + t * hidden;
    for (int64_t chunk0 = 0; chunk0 < chunks; chunk0 += kBatch) {
      Vec<T, V> x[kBatch];
      int64_t c[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        c[b] = chunk0 + b < chunks ? chunk_start<V>(chunk0 + b, t, chunks) + lane * V : hidden;
        if (c[b] < hidden) x[b] = load<T, V>(src + c[b]);
      }
      for (int64_t j = 0; j < topk; ++j) {
        const int64_t row = row_map[t * topk + j];
        if (row < 0 || row >= rows) continue;  // a dropped slot (or a map out of contract)
        const float p = prob_at(probs, t * topk + j);
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
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
  }
  for (int64_t r0 = first_warp * kWarpSize; r0 < rows; r0 += warps * kWarpSize) {
    unsigned padding = __ballot_sync(0xffffffffu, r0 + lane < rows && sorted_slots[r0 + lane] < 0);
    for (; padding != 0; padding &= padding - 1) {
      store_zero_row<T, V>(output + (r0 + __ffs(padding) - 1) * hidden, lane, hidden);
    }
  }
}

template <typename T, typename S, int V>
__global__ void unpermute_kernel(const T* __restrict__ input, const int64_t* __restrict__ row_map,
                                 const S* __restrict__ probs, T* __restrict__ output,
                                 int64_t tokens, int64_t rows, int64_t topk, int64_t hidden) {
  const int64_t chunks = chunk_count<V>(hidden);
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
       t < tokens; t += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const int64_t c = chunk_start<V>(chunk, t, chunks) + lane * V;
      if (c >= hidden) continue;
      // kBatch slots' rows are loaded before any is added (in slot order, as one at a time would),
      // so that each lane has that many loads in flight.
      constexpr int kBatch = 4;
      float acc[V] = {};
      for (int64_t j0 = 0; j0 < topk; j0 += kBatch) {
        Vec<T, V> x[kBatch];
        bool kept[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int64_t row = j0 + b < topk ? row_map[t * topk + j0 + b] : -1;
          kept[b] = row >= 0 && row < rows;  // else a dropped slot (or a map out of contract)
          if (kept[b]) x[b] = load<T, V>(input + row * hidden + c);
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
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
  return align256(slots * sizeof(int32_t)) * 2 + align256(slots * sizeof(int64_t)) +
         cub_sort_bytes(slots, experts);
}

void launch_routing_map(const RoutingMapParams& params, cudaStream_t stream) {
  const int64_t slots = params.tokens * params.topk;
  const auto experts = static_cast<int32_t>(params.experts);
  TORCHMOE_CUDA_CHECK(
      cudaMemsetAsync(params.counts, 0, (params.experts + 2) * sizeof(int32_t), stream));
  if (slots == 0) return;
  const size_t cub_bytes = cub_sort_bytes(slots, params.experts);
  TORCH_INTERNAL_ASSERT(
      params.workspace_bytes >= routing_map_workspace_bytes(slots, params.experts),
      "launch_routing_map: workspace too small");
  const RoutingWorkspace w = carve(params.workspace, slots, cub_bytes);

  const int64_t bins = params.experts + 2;
  const size_t shared_bytes = bins <= kMaxSharedBins ? bins * sizeof(int32_t) : 0;
  const int64_t blocks_needed = (slots + kThreads - 1) / kThreads;
  auto keys = [&](auto index_tag) {
    using Index = decltype(index_tag);
    auto* kernel = routing_keys_kernel<Index>;
    kernel<<<one_wave_grid(kernel, kThreads, shared_bytes, blocks_needed), kThreads, shared_bytes,
             stream>>>(static_cast<const Index*>(params.indices), slots, experts, w.keys_in,
                       w.values_in, params.counts);
  };
  if (params.indices_int32) {
    keys(int32_t{});
  } else {
    keys(int64_t{});
  }
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
  size_t bytes = w.cub_bytes;
  TORCHMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      w.cub_storage, bytes, w.keys_in, w.keys_out, w.values_in, params.sorted_slots,
      static_cast<int>(slots), 0, end_bit(params.experts), stream));
  row_map_kernel<<<one_wave_grid(row_map_kernel, kThreads, 0, blocks_needed), kThreads, 0,
                   stream>>>(w.keys_out, params.sorted_slots, slots, experts, params.row_map);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_permute(const PermuteParams& params, cudaStream_t stream) {
  dispatch(params, params.rows, {params.input, params.output},
           [&](auto data_tag, auto prob_tag, auto vec) {
             using T = decltype(data_tag);
             using S = decltype(prob_tag);
             auto* kernel = permute_kernel<T, S, decltype(vec)::value>;
             kernel<<<row_grid(kernel, std::max(params.tokens, params.rows / kWarpSize)), kThreads,
                      0, stream>>>(static_cast<const T*>(params.input), params.row_map,
                                   params.sorted_slots, static_cast<const S*>(params.probs),
                                   static_cast<T*>(params.output), params.tokens, params.rows,
                                   params.topk, params.hidden);
           });
}

void launch_unpermute(const PermuteParams& params, cudaStream_t stream) {
  dispatch(params, params.tokens, {params.input, params.output},
           [&](auto data_tag, auto prob_tag, auto vec) {
             using T = decltype(data_tag);
             using S = decltype(prob_tag);
             auto* kernel = unpermute_kernel<T, S, decltype(vec)::value>;
             kernel<<<row_grid(kernel, params.tokens), kThreads, 0, stream>>>(
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
