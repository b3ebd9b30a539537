#pragma once
// What split-quantize writes per tile (split_quantize.h's layouts): the tile's amax report, the
// block scales' scale_inv entries, the rowwise copy stored from registers, and the columnwise
// copy through a 128×128-byte shared tile. Kept apart from the kernel so that its body reads as
// the steps of a tile; the element maths is split_quantize_math.cuh's. Included by
// split_quantize.cu only.
//
// Row amaxes are shuffles among the threads of a row, column amaxes go through a small
// shared-memory reduction. The rowwise copy is V contiguous bytes per thread and row. The
// columnwise copy's shared tile is written as one 8-byte chunk of P rows per column (a 4×4 byte
// transpose in registers, or the column cast for 1×128 blocks: both in the kernel, store_chunk
// here) and read back as 16-byte row segments of the transposed output. The chunks are XOR-swizzled
// by column so that both the column writes (lanes 8 or 4 columns apart) and the row reads (two
// output rows per half-warp) are free of bank conflicts.

#include <cuda_fp8.h>

#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/fp8_cast.cuh"
#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/kernels/split_quantize_layout.cuh"
#include "torchmoe/kernels/split_quantize_math.cuh"
#include "torchmoe/kernels/split_quantize_scheduler.cuh"

namespace torchmoe::kernels::split_quantize {

// The tile's amax (zero rows and columns past the tile add nothing) when it is reported or the
// tile needs it whole (128×128 blocks: the return value, every thread; else 0). Unless the tile
// needs it whole, each warp maxes its part into the split's amax itself: no block barrier.
// kCurrent's amax visits instead leave the warps' parts in warp_amaxes for thread 0, which
// announces the tile (CurrentScheduler::announce_tile); a cast waits for every tile of its split.
template <typename T, QuantizeScaling S, int P>
__device__ __forceinline__ float reduce_tile_amax(const SplitQuantizeParams& p, int g,
                                                  const uint32_t (&x)[P][4], bool reports_amax,
                                                  float* scratch, float (&warp_amaxes)[kWarps],
                                                  int warp) {
  constexpr bool kCurrent = S == QuantizeScaling::kCurrent;
  float tile_amax = 0.0f;
  if (reports_amax || S == QuantizeScaling::kBlock128x128) {
    const float thread_amax = pieces_amax<T>(x);
    if constexpr (S == QuantizeScaling::kBlock128x128) {
      tile_amax = block_max(thread_amax, scratch);
      if (reports_amax && threadIdx.x == 0) atomic_max_nonnegative(p.amax + g, tile_amax);
    } else if (reports_amax) {
      const float warp_amax = warp_max(thread_amax);
      if (threadIdx.x % kWarpSize == 0) {
        if (kCurrent) {
          warp_amaxes[warp] = warp_amax;
        } else {
          atomic_max_nonnegative(p.amax + g, warp_amax);
        }
      }
    }
  }
  return tile_amax;
}

// kBlock128x128: the tile's scale from its amax; thread 0 writes its scale_inv to both copies'
// arrays (the same value, transposed layouts).
template <typename T>
__device__ __forceinline__ float tile_block_scale(const SplitQuantizeParams& p,
                                                  const SplitLayout& layout,
                                                  const TileSpot<T>& spot, int64_t col_tiles,
                                                  const uint8_t* rowwise, const uint8_t* columnwise,
                                                  float tile_amax, float max_fp8,
                                                  float value_for_inf) {
  const float scale =
      scale_from_amax(tile_amax, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
  if (threadIdx.x == 0) {
    const float inv = __frcp_rn(scale);
    const int64_t kb4 = round_up4(col_tiles);
    const int64_t mb4 = layout.tiles4[spot.g + 1] - layout.tiles4[spot.g];
    if (rowwise != nullptr) p.scale_inv[kb4 * layout.tiles[spot.g] + spot.mb * kb4 + spot.kb] = inv;
    if (columnwise != nullptr) {
      p.columnwise_scale_inv[col_tiles * layout.tiles4[spot.g] + spot.kb * mb4 + spot.mb] = inv;
    }
  }
  return scale;
}

// The tile's one scale (kBlock1x128 has none: its scales are per row and per column). kDelayed:
// the given one; kCurrent: its split's, once complete (thread 0 waits unless an amax visit's swap
// found it), and the split's first tile writes scale_inv; kBlock128x128: tile_block_scale.
template <typename T, QuantizeScaling S, typename Scheduler>
__device__ __forceinline__ float tile_scale(const SplitQuantizeParams& p, const SplitLayout& layout,
                                            const TileSpot<T>& spot, Visit visit,
                                            Scheduler& scheduler, const float& split_scale,
                                            int64_t col_tiles, const uint8_t* rowwise,
                                            const uint8_t* columnwise, float tile_amax,
                                            float max_fp8, float value_for_inf) {
  float tensor_scale = 1.0f;
  if constexpr (S == QuantizeScaling::kDelayed) {
    tensor_scale = p.scale[spot.g];
  } else if constexpr (S == QuantizeScaling::kCurrent) {
    if (visit != Visit::kAmax) scheduler.await_split_scale(spot.g);
    if (threadIdx.x == 0 && spot.mb == 0 && spot.kb == 0) {
      p.scale_inv[spot.g] = __frcp_rn(split_scale);
    }
    tensor_scale = split_scale;
  } else if constexpr (S == QuantizeScaling::kBlock128x128) {
    tensor_scale = tile_block_scale(p, layout, spot, col_tiles, rowwise, columnwise, tile_amax,
                                    max_fp8, value_for_inf);
  }
  return tensor_scale;
}

// The rowwise scales (kBlock1x128: one per row, `tensor_scale` otherwise), then the pieces cast
// into q and the rowwise copy stored when there is one. q is also the columnwise copy's bytes
// when one scale serves both copies. row_amax: own_row_amax's scratch (the kernel's array).
template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, int P>
__device__ __forceinline__ void cast_rowwise(const SplitQuantizeParams& p,
                                             const SplitLayout& layout, const TileSpot<T>& spot,
                                             const ThreadPlace& t, int64_t k, uint8_t* rowwise,
                                             bool col_ok, int64_t col_tiles, float tensor_scale,
                                             float max_fp8, float value_for_inf,
                                             const uint32_t (&x)[P][4], float (&row_amax)[P],
                                             uint32_t (&q)[P][PieceShape<T>::kVector / 4]) {
  constexpr int kOutWords = PieceShape<T>::kVector / 4;  // FP8 words per piece
  const int g = spot.g;
  const int64_t m4 = layout.rows4[g + 1] - layout.rows4[g];
  uint8_t* out_row =
      rowwise != nullptr ? rowwise + (spot.row0 + t.r0) * k + spot.col0 + t.c0 : nullptr;
  // kBlock1x128: lanes 2i and 2i + 1 of a row group turn row i's amax into its scale, which the
  // others fetch.
  float own_row_scale = 1.0f;
  if constexpr (S == QuantizeScaling::kBlock1x128) {
    const float own = own_row_amax<T>(x, t.lane_col, row_amax);
    own_row_scale = scale_from_amax(own, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
    const int own_row = t.lane_col / 2;
    if (t.lane_col % 2 == 0 && t.r0 + own_row < spot.rows_valid) {
      p.scale_inv[col_tiles * layout.rows4[g] + spot.kb * m4 + spot.mb * kTile + t.r0 + own_row] =
          __frcp_rn(own_row_scale);
    }
  }
  const int group_lane0 = threadIdx.x % kWarpSize - t.lane_col;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    float scale = tensor_scale;
    if constexpr (S == QuantizeScaling::kBlock1x128) {
      scale = __shfl_sync(kFullMask, own_row_scale, group_lane0 + 2 * i);
    }
    cast_piece<T, F>(x[i], scale, q[i]);
    if (rowwise != nullptr && col_ok && t.r0 + i < spot.rows_valid) {
      if constexpr (kOutWords == 2) {
        *reinterpret_cast<uint2*>(out_row + i * k) = make_uint2(q[i][0], q[i][1]);
      } else {
        *reinterpret_cast<uint32_t*>(out_row + i * k) = q[i][0];
      }
    }
  }
}

// The 8-byte chunk of output row c (tile column c) that holds tile rows [8·q, 8·q + 8) sits at
// chunk q ^ swizzle(c). Column writes come from lanes V columns apart (c / V distinct), row reads
// from two adjacent columns per half-warp (c & 1 distinct): both spread over all banks.
template <int V>
__device__ __forceinline__ int swizzle(int c) {
  return ((c / V) ^ (c & 1)) & 15;
}

// Column c0 + j of this thread's P rows is P / 8 chunks of 8 bytes (two words each) at chunk
// (r0 / 8 + h) ^ swizzle(c) of the shared tile's row c.
template <int V>
__device__ __forceinline__ void store_chunk(uint8_t* transposed, const ThreadPlace& t, int j, int h,
                                            uint32_t lo, uint32_t hi) {
  const int c = t.c0 + j;
  const int chunk_index = (t.r0 / 8 + h) ^ swizzle<V>(c);
  *reinterpret_cast<uint2*>(transposed + c * kTile + chunk_index * 8) = make_uint2(lo, hi);
}

// kBlock1x128's columnwise scales from this thread's column amaxes (over its rows and its warp's
// row groups): the tile's column amaxes over the warps through column_partial, one scale per
// column into column_scale, scale_inv for the columns in the split; col_scale gets this thread's
// V. Two block barriers.
template <typename T>
__device__ __forceinline__ void column_scales(
    const SplitQuantizeParams& p, const SplitLayout& layout, const TileSpot<T>& spot,
    const ThreadPlace& t, int64_t k, float max_fp8, float value_for_inf,
    const float (&col_amax)[PieceShape<T>::kVector], float (&column_partial)[kWarps][kTile],
    float (&column_scale)[kTile], float (&col_scale)[PieceShape<T>::kVector]) {
  constexpr int V = PieceShape<T>::kVector;
  constexpr int kRowThreads = PieceShape<T>::kRowThreads;
  if (threadIdx.x % kWarpSize < kRowThreads) {
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      *reinterpret_cast<float4*>(&column_partial[t.warp][t.c0 + j]) =
          make_float4(col_amax[j], col_amax[j + 1], col_amax[j + 2], col_amax[j + 3]);
    }
  }
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int c = threadIdx.x;
    float a = column_partial[0][c];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) a = fmaxf(a, column_partial[w][c]);
    const float scale = scale_from_amax(a, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
    column_scale[c] = scale;
    if (c < spot.cols_valid) {
      const int64_t k4 = round_up4(k);
      p.columnwise_scale_inv[k4 * layout.tiles[spot.g] + spot.mb * k4 + spot.col0 + c] =
          __frcp_rn(scale);
    }
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < V; j += 4) {
    const float4 v = *reinterpret_cast<const float4*>(&column_scale[t.c0 + j]);
    col_scale[j] = v.x;
    col_scale[j + 1] = v.y;
    col_scale[j + 2] = v.z;
    col_scale[j + 3] = v.w;
  }
}

// After the shared tile is complete (a block barrier): output row col0 + c of split g's [K, r16(m)]
// block, bytes [128·mb, 128·mb + rows_padded): 8 threads per row, 16 bytes each. Rows of the tile
// past the split were loaded as zeros, so the padding columns of the block are written as zeros.
template <typename T>
__device__ __forceinline__ void store_columnwise(const SplitLayout& layout, const TileSpot<T>& spot,
                                                 int64_t k, uint8_t* columnwise,
                                                 const uint8_t* transposed) {
  constexpr int V = PieceShape<T>::kVector;
  const int64_t ld = round_up_columnwise(spot.m);
  const int rows_padded = static_cast<int>(
      min(static_cast<int64_t>(kTile), ld - static_cast<int64_t>(spot.mb) * kTile));
  uint8_t* block = columnwise + k * layout.cstart[spot.g] + static_cast<int64_t>(spot.mb) * kTile;
  for (int item = threadIdx.x; item < kTile * 8; item += kThreads) {
    const int c = item / 8, segment = item % 8;
    if (c >= spot.cols_valid || 16 * segment >= rows_padded) continue;
    const int s = swizzle<V>(c);
    const uint2 a =
        *reinterpret_cast<const uint2*>(transposed + c * kTile + ((2 * segment) ^ s) * 8);
    const uint2 b =
        *reinterpret_cast<const uint2*>(transposed + c * kTile + ((2 * segment + 1) ^ s) * 8);
    *reinterpret_cast<uint4*>(block + (spot.col0 + c) * ld + 16 * segment) =
        make_uint4(a.x, a.y, b.x, b.y);
  }
}

}  // namespace torchmoe::kernels::split_quantize
