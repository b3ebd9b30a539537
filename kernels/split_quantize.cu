// Split-quantize and the delayed-scaling update; contract and layouts in split_quantize.h.
//
// One kernel walks 128×128 tiles of the input, each tile inside one split (a split's row tiles
// start at its first row, so block scales never straddle splits). A persistent grid of one wave
// takes tiles in a grid-stride loop, adjacent blocks on adjacent column tiles of the same rows.
// Every block first derives the split layout (clamped starts and the prefix sums that place
// each split's scales) from the device split sizes into shared memory, with a warp scan: no
// setup launch and no host copy.
//
// Per tile each thread loads P consecutive rows × V columns with 16-byte loads straight into
// registers (V = 16 / sizeof(T); 16 threads per row for 16-bit types, 32 for fp32), so the
// input is read once and never staged. Row amaxes are shuffles among the threads of a row,
// column and tile amaxes go through a small shared-memory reduction. The rowwise copy is stored
// from registers (128 contiguous bytes per row segment); the columnwise copy goes through a
// 128×128-byte shared tile, written as one 8-byte chunk of P rows per column and read back as
// 16-byte row segments of the transposed output. The chunks are XOR-swizzled by column so that
// both the column writes (lanes 8 or 4 columns apart) and the row reads (two output rows per
// half-warp) are free of bank conflicts.
//
// kCurrent needs each split's amax before any of its elements can be cast, so it runs the same
// tile walk twice: an amax-only pass, then the cast pass, which derives the scale from the
// amax. The input is therefore read twice (6 bytes moved per 4 counted for bf16 with both
// copies); the other scalings are a single pass.

#include "torchmoe/kernels/split_quantize.h"

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTile = static_cast<int>(kQuantizeBlock);
constexpr unsigned kFullMask = 0xffffffffu;
// Three blocks per SM (at most 80 registers): up to 96 KB of 16-bit input loads in flight per SM.
// Unbounded, ptxas took ~128 registers (two blocks); at 80 it spills at most 8 bytes.
constexpr int kMinBlocks = 3;

enum class Pass { kAmax, kCast };

// Where each split lives, from the clamped split sizes: G + 1 entries each (entry G: the totals).
struct SplitLayout {
  int64_t* start;   // first row
  int64_t* cstart;  // Σ_{h<g} r16(m_h): where split g's columnwise block starts, in K-element rows
  int32_t* tiles;   // Σ_{h<g} ceil(m_h / 128): row tiles before split g
  int32_t* rows4;   // Σ_{h<g} r4(m_h)
  int32_t* tiles4;  // Σ_{h<g} r4(ceil(m_h / 128))
};

size_t layout_bytes(int groups) {
  return static_cast<size_t>(groups + 1) * (2 * sizeof(int64_t) + 3 * sizeof(int32_t));
}

// Warp 0 scans the split sizes 32 at a time; the block waits for it.
__device__ SplitLayout build_layout(const SplitQuantizeParams& p, char* shared) {
  const int groups = p.num_groups;
  SplitLayout l;
  l.start = reinterpret_cast<int64_t*>(shared);
  l.cstart = l.start + groups + 1;
  l.tiles = reinterpret_cast<int32_t*>(l.cstart + groups + 1);
  l.rows4 = l.tiles + groups + 1;
  l.tiles4 = l.rows4 + groups + 1;
  if (threadIdx.x < kWarpSize) {
    const int lane = threadIdx.x;
    // Sizes are capped at `rows` and the running sum clamped at every step: garbage sizes clamp
    // like the sm90 GEMM's instead of overflowing.
    int64_t carry = 0;
    for (int base = 0; base < groups; base += kWarpSize) {
      const int g = base + lane;
      const int64_t s = g < groups ? min(split_at(p.m_splits, p.splits_int32, g), p.rows) : 0;
      const int64_t inclusive = warp_inclusive_scan(s);
      if (g < groups) l.start[g] = min(carry + inclusive - s, p.rows);
      carry = min(carry + __shfl_sync(kFullMask, inclusive, kWarpSize - 1), p.rows);
    }
    if (lane == 0) l.start[groups] = carry;
    __syncwarp();
    int32_t tiles = 0, rows4 = 0, tiles4 = 0;
    int64_t rows16 = 0;
    for (int base = 0; base < groups; base += kWarpSize) {
      const int g = base + lane;
      int32_t mb = 0, r4 = 0, mb4 = 0;
      int64_t r16 = 0;
      if (g < groups) {
        const int64_t m = l.start[g + 1] - l.start[g];
        r16 = round_up_columnwise(m);
        mb = static_cast<int32_t>((m + kTile - 1) / kTile);
        r4 = static_cast<int32_t>((m + 3) / 4 * 4);
        mb4 = (mb + 3) / 4 * 4;
      }
      const int32_t i_mb = warp_inclusive_scan(mb), i_r4 = warp_inclusive_scan(r4),
                    i_mb4 = warp_inclusive_scan(mb4);
      const int64_t i_r16 = warp_inclusive_scan(r16);
      if (g < groups) {
        l.cstart[g] = rows16 + i_r16 - r16;
        l.tiles[g] = tiles + i_mb - mb;
        l.rows4[g] = rows4 + i_r4 - r4;
        l.tiles4[g] = tiles4 + i_mb4 - mb4;
      }
      tiles += __shfl_sync(kFullMask, i_mb, kWarpSize - 1);
      rows4 += __shfl_sync(kFullMask, i_r4, kWarpSize - 1);
      tiles4 += __shfl_sync(kFullMask, i_mb4, kWarpSize - 1);
      rows16 += __shfl_sync(kFullMask, i_r16, kWarpSize - 1);
    }
    if (lane == 0) {
      l.cstart[groups] = rows16;
      l.tiles[groups] = tiles;
      l.rows4[groups] = rows4;
      l.tiles4[groups] = tiles4;
    }
  }
  __syncthreads();
  return l;
}

// The split owning global row tile `rt`: the last g with tiles[g] <= rt (empty splits share
// their successor's prefix and are skipped).
__device__ __forceinline__ int split_of_tile(const SplitLayout& l, int groups, int64_t rt) {
  int lo = 0, hi = groups;  // tiles[lo] <= rt < tiles[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (l.tiles[mid] <= rt) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename T>
struct InputLimits;
template <>
struct InputLimits<float> {
  static constexpr float kMax = FLT_MAX;
};
template <>
struct InputLimits<__half> {
  static constexpr float kMax = 65504.0f;
};
template <>
struct InputLimits<__nv_bfloat16> {
  static constexpr float kMax = 3.38953139e38f;  // 0x7f7f
};

// TE's compute_scale_from_amax (recipe/recipe_common.cuh).
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max, bool pow2,
                                                 float epsilon, float value_for_inf) {
  if (amax < epsilon) amax = epsilon;
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(fp8_max, amax);
  if (isinf(scale)) scale = value_for_inf;
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xff800000u);
  return scale;
}

// max into a float holding a non-negative value: as integers, non-negative floats (inf
// included) order like their values, and the max of a set does not depend on the order.
__device__ __forceinline__ void atomic_max_nonnegative(float* address, float value) {
  if (value > 0.0f) atomicMax(reinterpret_cast<int*>(address), __float_as_int(value));
}

// fmaxf drops NaN: a NaN element never becomes the amax (TE's amax kernels do the same).
__device__ __forceinline__ float abs_max(float m, float x) { return fmaxf(m, fabsf(x)); }

template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint16_t cast2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, F);
}

// Max over the block; every thread gets it. `scratch`: kWarps floats. Ends with the block
// synchronized, so scratch may be reused at once.
__device__ __forceinline__ float block_max(float v, float* scratch) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  }
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float m = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

// The 8-byte chunk of output row c (tile column c) that holds tile rows [8·q, 8·q + 8) sits at
// chunk q ^ swizzle(c). Column writes come from lanes V columns apart (c / V distinct), row reads
// from two adjacent columns per half-warp (c & 1 distinct): both spread over all banks.
template <int V>
__device__ __forceinline__ int swizzle(int c) {
  return ((c / V) ^ (c & 1)) & 15;
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, Pass kPass>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    split_quantize_kernel(const SplitQuantizeParams p, float max_fp8) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  constexpr int kRowThreads = kTile / V;               // threads sharing a row: 16 or 32
  constexpr int kRowGroups = kThreads / kRowThreads;   // 16 or 8
  constexpr int P = kTile / kRowGroups;                // rows per thread: 8 or 16
  constexpr bool kPerTensor = S == QuantizeScaling::kCurrent || S == QuantizeScaling::kDelayed;
  static_assert(P % 8 == 0 && V % 2 == 0, "whole 8-byte chunks and fp8 pairs");

  extern __shared__ __align__(16) char dynamic_shared[];
  __shared__ __align__(16) uint8_t transposed[kTile * kTile];
  __shared__ float column_partial[kWarps][kTile];
  __shared__ float column_scale[kTile];
  __shared__ float scratch[kWarps];

  const int groups = p.num_groups;
  const SplitLayout layout = build_layout(p, dynamic_shared);
  const float value_for_inf = kPerTensor ? FLT_MAX : InputLimits<T>::kMax;

  // One scale_inv per split, empty splits included (they own no tile).
  if constexpr (kPass == Pass::kCast && kPerTensor) {
    if (blockIdx.x == 0) {
      for (int g = threadIdx.x; g < groups; g += kThreads) {
        const float scale = S == QuantizeScaling::kDelayed
                                ? p.scale[g]
                                : scale_from_amax(p.amax[g], max_fp8, p.power_of_2_scales,
                                                  p.epsilon, value_for_inf);
        p.scale_inv[g] = __frcp_rn(scale);
      }
    }
  }
  const bool writes_amax =
      kPass == Pass::kAmax || (S != QuantizeScaling::kCurrent && p.amax != nullptr);

  const T* input = static_cast<const T*>(p.input);
  uint8_t* rowwise = static_cast<uint8_t*>(p.rowwise);
  uint8_t* columnwise = static_cast<uint8_t*>(p.columnwise);
  const int64_t k = p.k;
  const int64_t col_tiles = (k + kTile - 1) / kTile;
  const int64_t total_tiles = static_cast<int64_t>(layout.tiles[groups]) * col_tiles;
  const int lane_col = threadIdx.x % kRowThreads;
  const int c0 = lane_col * V;                   // first tile column of this thread
  const int r0 = threadIdx.x / kRowThreads * P;  // first tile row of this thread
  const int warp = threadIdx.x / kWarpSize;

  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    const int64_t rt = tile / col_tiles;
    const int kb = static_cast<int>(tile - rt * col_tiles);
    const int g = split_of_tile(layout, groups, rt);
    const int64_t start = layout.start[g];
    const int64_t m = layout.start[g + 1] - start;
    const int mb = static_cast<int>(rt - layout.tiles[g]);
    const int64_t row0 = start + static_cast<int64_t>(mb) * kTile;  // global row of tile row 0
    const int rows_valid =
        static_cast<int>(min(static_cast<int64_t>(kTile), m - static_cast<int64_t>(mb) * kTile));
    const int64_t col0 = static_cast<int64_t>(kb) * kTile;
    const int cols_valid = static_cast<int>(min(static_cast<int64_t>(kTile), k - col0));
    const bool col_ok = c0 < cols_valid;  // k % 16 == 0: a vector is wholly in or out

    // Row 0 of the tile: in the one input, or in split g's own tensor.
    const T* tile_input = input + row0 * k;
    if (p.split_inputs.base != nullptr || p.split_inputs.table != nullptr) {
      const void* split = p.split_inputs.table != nullptr
                              ? p.split_inputs.table[g]
                              : static_cast<const T*>(p.split_inputs.base) +
                                    static_cast<int64_t>(g) * p.split_inputs.group_stride;
      tile_input = static_cast<const T*>(split) + static_cast<int64_t>(mb) * kTile * k;
    }
    Vec<T, V> x[P];
#pragma unroll
    for (int i = 0; i < P; ++i) {
      if (col_ok && r0 + i < rows_valid) {
        x[i] = load<T, V>(tile_input + (r0 + i) * k + col0 + c0);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) x[i].v[j] = from_float<T>(0.0f);
      }
    }

    float thread_amax = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) {
#pragma unroll
      for (int j = 0; j < V; ++j) thread_amax = abs_max(thread_amax, to_float(x[i].v[j]));
    }
    float tile_amax = 0.0f;
    if (writes_amax || S == QuantizeScaling::kBlock128x128) {
      tile_amax = block_max(thread_amax, scratch);
      if (writes_amax && threadIdx.x == 0) atomic_max_nonnegative(p.amax + g, tile_amax);
    }
    if constexpr (kPass == Pass::kAmax) continue;

    // ---- rowwise scales, then the rowwise copy (also the columnwise bytes when one scale
    // serves both copies) ----
    Vec<uint8_t, V> q[P];
    float tensor_scale = 1.0f;  // the one scale of this tile unless kBlock1x128
    if constexpr (S == QuantizeScaling::kDelayed) {
      tensor_scale = p.scale[g];
    } else if constexpr (S == QuantizeScaling::kCurrent) {
      tensor_scale =
          scale_from_amax(p.amax[g], max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
    } else if constexpr (S == QuantizeScaling::kBlock128x128) {
      tensor_scale =
          scale_from_amax(tile_amax, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
      if (threadIdx.x == 0) {
        const float inv = __frcp_rn(tensor_scale);
        const int64_t kb4 = round_up4(col_tiles);
        const int64_t mb4 = layout.tiles4[g + 1] - layout.tiles4[g];
        if (rowwise != nullptr) p.scale_inv[kb4 * layout.tiles[g] + mb * kb4 + kb] = inv;
        if (columnwise != nullptr) {
          p.columnwise_scale_inv[col_tiles * layout.tiles4[g] + kb * mb4 + mb] = inv;
        }
      }
    }
    if (rowwise != nullptr || S != QuantizeScaling::kBlock1x128) {
      const int64_t m4 = layout.rows4[g + 1] - layout.rows4[g];
#pragma unroll
      for (int i = 0; i < P; ++i) {
        float scale = tensor_scale;
        if constexpr (S == QuantizeScaling::kBlock1x128) {
          float row_amax = 0.0f;
#pragma unroll
          for (int j = 0; j < V; ++j) row_amax = abs_max(row_amax, to_float(x[i].v[j]));
#pragma unroll
          for (int offset = kRowThreads / 2; offset > 0; offset /= 2) {
            row_amax = fmaxf(row_amax, __shfl_xor_sync(kFullMask, row_amax, offset));
          }
          scale = scale_from_amax(row_amax, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
          if (lane_col == 0 && r0 + i < rows_valid) {
            p.scale_inv[col_tiles * layout.rows4[g] + kb * m4 + mb * kTile + r0 + i] =
                __frcp_rn(scale);
          }
        }
#pragma unroll
        for (int j = 0; j < V; j += 2) {
          const uint16_t pair =
              cast2<F>(to_float(x[i].v[j]) * scale, to_float(x[i].v[j + 1]) * scale);
          q[i].v[j] = static_cast<uint8_t>(pair & 0xff);
          q[i].v[j + 1] = static_cast<uint8_t>(pair >> 8);
        }
        if (rowwise != nullptr && col_ok && r0 + i < rows_valid) {
          store<uint8_t, V>(rowwise + (row0 + r0 + i) * k + col0 + c0, q[i]);
        }
      }
    }
    if (columnwise == nullptr) continue;

    // ---- columnwise copy: column scales (kBlock1x128), the transposed tile, its rows ----
    if constexpr (S == QuantizeScaling::kBlock1x128) {
      float col_amax[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        col_amax[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < P; ++i) col_amax[j] = abs_max(col_amax[j], to_float(x[i].v[j]));
          // The other row groups of this warp that hold the same columns.
#pragma unroll
        for (int offset = kRowThreads; offset < kWarpSize; offset *= 2) {
          col_amax[j] = fmaxf(col_amax[j], __shfl_xor_sync(kFullMask, col_amax[j], offset));
        }
        if (threadIdx.x % kWarpSize < kRowThreads) column_partial[warp][c0 + j] = col_amax[j];
      }
      __syncthreads();
      if (threadIdx.x < kTile) {
        const int c = threadIdx.x;
        float a = column_partial[0][c];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) a = fmaxf(a, column_partial[w][c]);
        const float scale =
            scale_from_amax(a, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
        column_scale[c] = scale;
        if (c < cols_valid) {
          const int64_t k4 = round_up4(k);
          p.columnwise_scale_inv[k4 * layout.tiles[g] + mb * k4 + col0 + c] = __frcp_rn(scale);
        }
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float scale = column_scale[c0 + j];
        Vec<uint8_t, P> chunk;
#pragma unroll
        for (int i = 0; i < P; i += 2) {
          const uint16_t pair =
              cast2<F>(to_float(x[i].v[j]) * scale, to_float(x[i + 1].v[j]) * scale);
          chunk.v[i] = static_cast<uint8_t>(pair & 0xff);
          chunk.v[i + 1] = static_cast<uint8_t>(pair >> 8);
        }
        const int c = c0 + j;
#pragma unroll
        for (int h = 0; h < P / 8; ++h) {
          const int chunk_index = (r0 / 8 + h) ^ swizzle<V>(c);
          *reinterpret_cast<Vec<uint8_t, 8>*>(transposed + c * kTile + chunk_index * 8) =
              *reinterpret_cast<const Vec<uint8_t, 8>*>(chunk.v + 8 * h);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const int c = c0 + j;
#pragma unroll
        for (int h = 0; h < P / 8; ++h) {
          Vec<uint8_t, 8> chunk;
#pragma unroll
          for (int i = 0; i < 8; ++i) chunk.v[i] = q[8 * h + i].v[j];
          const int chunk_index = (r0 / 8 + h) ^ swizzle<V>(c);
          *reinterpret_cast<Vec<uint8_t, 8>*>(transposed + c * kTile + chunk_index * 8) = chunk;
        }
      }
    }
    __syncthreads();
    // Output row col0 + c of split g's [K, r16(m)] block, bytes [128·mb, 128·mb + rows_padded):
    // 8 threads per row, 16 bytes each. Rows of the tile past the split were loaded as zeros, so
    // the padding columns of the block are written as zeros.
    const int64_t ld = round_up_columnwise(m);
    const int rows_padded =
        static_cast<int>(min(static_cast<int64_t>(kTile), ld - static_cast<int64_t>(mb) * kTile));
    uint8_t* block = columnwise + k * layout.cstart[g] + static_cast<int64_t>(mb) * kTile;
    for (int item = threadIdx.x; item < kTile * 8; item += kThreads) {
      const int c = item / 8, segment = item % 8;
      if (c >= cols_valid || 16 * segment >= rows_padded) continue;
      const int s = swizzle<V>(c);
      Vec<uint8_t, 16> bytes;
      *reinterpret_cast<Vec<uint8_t, 8>*>(bytes.v) = *reinterpret_cast<const Vec<uint8_t, 8>*>(
          transposed + c * kTile + ((2 * segment) ^ s) * 8);
      *reinterpret_cast<Vec<uint8_t, 8>*>(bytes.v + 8) = *reinterpret_cast<const Vec<uint8_t, 8>*>(
          transposed + c * kTile + ((2 * segment + 1) ^ s) * 8);
      store<uint8_t, 16>(block + (col0 + c) * ld + 16 * segment, bytes);
    }
    __syncthreads();  // the next tile rewrites `transposed`
  }
}

// The delayed-scaling update, one block per split (TE's amax_and_scale_update).
__global__ void __launch_bounds__(kThreads)
    update_delayed_scaling_kernel(const DelayedScalingUpdateParams p) {
  __shared__ float scratch[kWarps];
  const int g = blockIdx.x;
  const int64_t groups = p.num_groups, length = p.history_length;
  float* history = p.amax_history + g;
  const float newest = p.amax[g];  // read before row 0 is rewritten (it may alias it)
  float amax = 0.0f;
  // Row i takes row i + 1 (the last row takes the newest amax) and row 0 is cleared. Chunks of
  // kThreads rows: every read of a chunk precedes its writes, and row i + 1 of the last thread
  // is only written in the next chunk, after its read.
  for (int64_t offset = 0; offset < length; offset += kThreads) {
    const int64_t i = offset + threadIdx.x;
    float a = 0.0f;
    if (i < length) {
      a = i + 1 < length ? history[(i + 1) * groups] : newest;
      amax = fmaxf(amax, a);
    }
    __syncthreads();
    if (i < length) history[i * groups] = i > 0 ? a : 0.0f;
  }
  amax = block_max(amax, scratch);
  if (p.algo == AmaxComputeAlgo::kMostRecent) amax = newest;
  if (threadIdx.x == 0) {
    float scale = p.scale[g];
    if (isfinite(amax) && amax > 0.0f) scale = __fdiv_rn(p.scaled_max, amax);
    if (isinf(scale)) scale = FLT_MAX;
    p.scale[g] = scale;
    p.scale_inv[g] = __frcp_rn(scale);
  }
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, Pass kPass>
void launch_pass(const SplitQuantizeParams& p, cudaStream_t stream) {
  auto* kernel = split_quantize_kernel<T, F, S, kPass>;
  const size_t shared = layout_bytes(p.num_groups);
  // The kernel's static shared memory (about 21 KB) plus the layout may pass the 48 KB default.
  TORCHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared)));
  const int64_t tiles_bound =
      (p.rows / kTile + p.num_groups) * ((p.k + kTile - 1) / kTile);  // Σ_g ceil(m_g / 128)
  const unsigned grid = one_wave_grid(kernel, kThreads, shared, tiles_bound);
  kernel<<<grid, kThreads, shared, stream>>>(p, fp8_max(p.format));
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S>
void launch_scaling(const SplitQuantizeParams& p, cudaStream_t stream) {
  if constexpr (S == QuantizeScaling::kCurrent) launch_pass<T, F, S, Pass::kAmax>(p, stream);
  launch_pass<T, F, S, Pass::kCast>(p, stream);
}

template <typename T, __nv_fp8_interpretation_t F>
void launch_format(const SplitQuantizeParams& p, cudaStream_t stream) {
  switch (p.scaling) {
    case QuantizeScaling::kCurrent:
      return launch_scaling<T, F, QuantizeScaling::kCurrent>(p, stream);
    case QuantizeScaling::kDelayed:
      return launch_scaling<T, F, QuantizeScaling::kDelayed>(p, stream);
    case QuantizeScaling::kBlock1x128:
      return launch_scaling<T, F, QuantizeScaling::kBlock1x128>(p, stream);
    case QuantizeScaling::kBlock128x128:
      return launch_scaling<T, F, QuantizeScaling::kBlock128x128>(p, stream);
  }
}

}  // namespace

void launch_split_quantize(const SplitQuantizeParams& p, cudaStream_t stream) {
  if (p.num_groups == 0) return;
  TORCH_INTERNAL_ASSERT(p.k % kQuantizeFeatureMultiple == 0,
                        "launch_split_quantize: k must be a multiple of 16");
  TORCH_INTERNAL_ASSERT(p.scaling != QuantizeScaling::kDelayed || p.scale != nullptr,
                        "launch_split_quantize: kDelayed needs scale");
  TORCH_INTERNAL_ASSERT(is_block_scaling(p.scaling) || p.amax != nullptr,
                        "launch_split_quantize: kCurrent and kDelayed need amax");
  TORCH_INTERNAL_ASSERT(p.scale_inv != nullptr || (is_block_scaling(p.scaling) && !p.rowwise),
                        "launch_split_quantize: scale_inv is required");
  TORCH_INTERNAL_ASSERT(!is_block_scaling(p.scaling) || !p.columnwise || p.columnwise_scale_inv,
                        "launch_split_quantize: columnwise block scales are required");
  TORCH_INTERNAL_ASSERT(aligned16({p.input, p.rowwise, p.columnwise}),
                        "launch_split_quantize: buffers must be 16-byte aligned");
  if (p.amax != nullptr && !(p.scaling == QuantizeScaling::kDelayed && p.accumulate_amax)) {
    TORCHMOE_CUDA_CHECK(
        cudaMemsetAsync(p.amax, 0, static_cast<size_t>(p.num_groups) * sizeof(float), stream));
  }
  dispatch_type(p.input_type, [&](auto tag) {
    using T = decltype(tag);
    if (p.format == Fp8Format::kE4M3) {
      launch_format<T, __NV_E4M3>(p, stream);
    } else {
      launch_format<T, __NV_E5M2>(p, stream);
    }
  });
}

void launch_update_delayed_scaling(const DelayedScalingUpdateParams& p, cudaStream_t stream) {
  if (p.num_groups == 0) return;
  TORCH_INTERNAL_ASSERT(p.history_length >= 1,
                        "launch_update_delayed_scaling: the history needs a row");
  update_delayed_scaling_kernel<<<p.num_groups, kThreads, 0, stream>>>(p);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
