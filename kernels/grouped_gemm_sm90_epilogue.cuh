#pragma once
// The sm90 grouped GEMM's epilogue: what a consumer warpgroup does with a tile's accumulators once
// the main loop (grouped_gemm_sm90_kernel.cuh) has summed them. Scaling (FP8) and the bias,
// conversion to the output type, and the stores: through shared memory and TMA, straight from
// registers, or added into scattered rows. Kept apart so that the kernel file reads as the loads
// and the main loop. Included by grouped_gemm_sm90.cu only (through grouped_gemm_sm90_kernel.cuh).
//
// Each consumer writes its 64 × 256 result into its buffer in boxes of 64 rows × 64 bytes
// (64-byte swizzle: the 8 rows a warp writes at once land in distinct banks), then one thread
// issues a TMA store per box (a TMA add for fp32 accumulation), in rounds of as many boxes as the
// buffer holds (Smem: a whole tile for wgrad, a quarter for fprop/dgrad). The last round's stores
// drain while the next tile's main loop runs; a buffer is rewritten only once they have read it.
// Tiles whose rows end inside the tile (a group's last row tile: the next group's rows follow) and
// outputs no tensor map describes are stored from registers with row masks instead. Scattered rows
// (fprop/dgrad, scatter_rows) are read back from the same buffer and added into their output rows
// in L2, every tile alike.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/kernels/grouped_gemm_sm90_layout.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_ptx.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_schedule.cuh"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels::sm90 {

// Entry `at` of an int32 or int64 row map (gather_rows, scatter_rows).
__device__ __forceinline__ int64_t map_entry(const void* map, bool int32, int64_t at) {
  return int32 ? static_cast<const int32_t*>(map)[at] : static_cast<const int64_t*>(map)[at];
}

// Where an output tile goes and what is added to it (see Tile).
template <typename OutT>
struct TileOutput {
  OutT* out;         // row 0, column 0 of the tile's matrix (y / dx, or dW_g)
  int64_t cols;      // the matrix's columns (its row stride)
  float scale;       // FP8: the group's two scale_inv multiplied; else 1
  const OutT* bias;  // fprop: b_g, else null
  int map_group;     // the tile's group in out_map's coordinates (its rows: Tile::row0)
  int64_t map_rows;  // out_map's rows: boxes starting past them are not issued
};

// The bias of output columns col and col + 1 (zeros without a bias or past the last column).
template <typename OutT>
__device__ __forceinline__ float2 bias_pair(const TileOutput<OutT>& o, int64_t col) {
  if (o.bias == nullptr || col >= o.cols) return make_float2(0.0f, 0.0f);
  return make_float2(to_float(o.bias[col]), to_float(o.bias[col + 1]));
}

// Writes store round `round` of this warpgroup's 64 × 256 accumulators (scaled, the bias added)
// into its shared-memory buffer: kEpilogueBoxes boxes of 64 rows × 64 bytes, 64-byte swizzle
// (16-byte unit u of row r sits at unit u ^ ((r / 2) % 4): the 8 rows a warp writes at once land
// in distinct banks).
template <int kEpilogueBoxes, typename OutT>
__device__ __forceinline__ void stage_round(const TileOutput<OutT>& o, const Tile& tile,
                                            const float (&acc)[128], uint8_t* buffer, int round) {
  constexpr int kChunkCols = kEpilogueRowBytes / static_cast<int>(sizeof(OutT));  // 32 or 16
  constexpr int kBlocksPerChunk = kChunkCols / 8;  // 8-column accumulator blocks
  const int thread = threadIdx.x % 128, warp = thread / kWarpSize, lane = thread % kWarpSize;
#pragma unroll
  for (int box = 0; box < kEpilogueBoxes; ++box) {
    uint8_t* box_base = buffer + box * kEpilogueBoxBytes;
#pragma unroll
    for (int jj = 0; jj < kBlocksPerChunk; ++jj) {
      const int j = (round * kEpilogueBoxes + box) * kBlocksPerChunk + jj;
      const float2 bias = bias_pair(o, tile.col0 + j * 8 + (lane % 4) * 2);
      const int byte = (jj * 8 + (lane % 4) * 2) * static_cast<int>(sizeof(OutT));
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = warp * 16 + half * 8 + lane / 4;
        const int unit = (byte / 16) ^ ((r / 2) % 4);
        store2(reinterpret_cast<OutT*>(box_base + r * kEpilogueRowBytes + unit * 16 + byte % 16),
               acc[4 * j + 2 * half] * o.scale + bias.x,
               acc[4 * j + 2 * half + 1] * o.scale + bias.y);
      }
    }
  }
}

// Stores this warpgroup's 64 × 256 accumulators through its shared-memory buffer of
// kEpilogueBoxes boxes and TMA: the boxes of a round are written, then one thread issues their
// stores (16 boxes for fp32, 8 for 16-bit outputs, in as many rounds as the buffer needs). A
// round waits until the previous round's stores have read the buffer; the last round's drain
// during the next tile's main loop.
template <int kEpilogueBoxes, typename OutT>
__device__ __forceinline__ void store_tile_tma(const KernelArgs& args, const TileOutput<OutT>& o,
                                               const Tile& tile, const float (&acc)[128],
                                               uint8_t* buffer, int consumer) {
  constexpr int kChunkCols = kEpilogueRowBytes / static_cast<int>(sizeof(OutT));
  constexpr int kRounds = kBlockN / kChunkCols / kEpilogueBoxes;
  const bool add = std::is_same_v<OutT, float> && args.p.accumulate;
  const int thread = threadIdx.x % 128;
  const int barrier = 2 + consumer;  // 0: __syncthreads, 1: both consumers (wgrad masking)
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    if (thread == 0) bulk_wait_read<0>();  // earlier stores from this buffer are done reading
    named_barrier(barrier, 128);
    stage_round<kEpilogueBoxes, OutT>(o, tile, acc, buffer, round);
    fence_proxy_async();
    named_barrier(barrier, 128);
    if (thread == 0) {
      const int c1 = tile.row0 + consumer * 64;
#pragma unroll 1
      for (int box = 0; box < kEpilogueBoxes; ++box) {
        const int c0 = tile.col0 + (round * kEpilogueBoxes + box) * kChunkCols;
        if (c0 >= o.cols || c1 >= o.map_rows) continue;  // wholly outside the matrix
        const uint8_t* box_base = buffer + box * kEpilogueBoxBytes;
        if (add) {
          tma_add_3d(&args.out_map, box_base, c0, c1, o.map_group);
        } else {
          tma_store_3d(&args.out_map, box_base, c0, c1, o.map_group);
        }
      }
      bulk_commit();
    }
  }
}

// Scattered rows (Sm90GemmParams::scatter_rows): this warpgroup's 64 × 256 accumulators are added
// into the output rows the map names. Each round is staged as for TMA; then each thread reads back
// 16-byte pieces and adds them in L2 (red_add8). A warp reads four rows of both boxes of a round,
// so that each of its adds covers a row's 128 contiguous bytes (four lines per instruction, half
// the requests of a box at a time; its 512-byte read takes the four shared-memory wavefronts any
// such read needs). Rows past the tile's valid rows and entries -1 or past the
// output are not added, so a group's last tile needs no separate path. A round waits until the
// previous round's pieces have been read back.
constexpr int kScatterUnitsPerRow = 2 * kEpilogueRowBytes / 16;  // a round's row: two boxes
constexpr int kScatterRowsPerPass = 128 / kScatterUnitsPerRow;   // rows a warpgroup reads at once
constexpr int kScatterPasses = 64 / kScatterRowsPerPass;

// Whether a kernel may scatter its rows: fprop and dgrad with 16-bit outputs.
template <GemmKind kKind, typename OutT>
constexpr bool kMayScatter = kKind != GemmKind::kWgrad && !std::is_same_v<OutT, float>;

// This thread's row, of its warpgroup's 64 rows of a tile, in a pass of the scattered epilogue.
__device__ __forceinline__ int scatter_row(int pass, int thread) {
  return pass * kScatterRowsPerPass + thread / kScatterUnitsPerRow;
}

// The map's entries for this thread's rows of a tile, loaded when the tile starts so that their
// latency passes under the main loop rather than at the epilogue's start.
struct ScatterTargets {
  int64_t entry[kScatterPasses];  // -1 for rows past the tile's valid rows
};

__device__ __forceinline__ ScatterTargets load_scatter_targets(const Sm90GemmParams& p,
                                                               const Tile& tile, int consumer) {
  ScatterTargets t;
  const int thread = threadIdx.x % 128;
#pragma unroll
  for (int pass = 0; pass < kScatterPasses; ++pass) {
    const int row = consumer * 64 + scatter_row(pass, thread);
    t.entry[pass] = row < tile.valid_rows ? map_entry(p.scatter_rows, p.scatter_rows_int32,
                                                      static_cast<int64_t>(tile.row0) + row)
                                          : -1;
  }
  return t;
}

template <int kEpilogueBoxes, typename OutT>
__device__ __forceinline__ void scatter_add_tile(const Sm90GemmParams& p, const TileOutput<OutT>& o,
                                                 const Tile& tile, const float (&acc)[128],
                                                 uint8_t* buffer, int consumer,
                                                 const ScatterTargets& targets) {
  constexpr int kChunkCols = kEpilogueRowBytes / static_cast<int>(sizeof(OutT));
  constexpr int kRounds = kBlockN / kChunkCols / kEpilogueBoxes;
  static_assert(kEpilogueBoxes == 2, "a scattered round's row is two boxes' rows");
  const int thread = threadIdx.x % 128, piece_unit = thread % kScatterUnitsPerRow;
  const int box = piece_unit / 4, unit = piece_unit % 4;
  const int barrier = 2 + consumer;
  OutT* dst[kScatterPasses];
#pragma unroll
  for (int pass = 0; pass < kScatterPasses; ++pass) {
    const int64_t target = targets.entry[pass];
    dst[pass] = target >= 0 && target < p.scatter_target_rows
                    ? static_cast<OutT*>(p.output) + target * o.cols
                    : nullptr;
  }
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    named_barrier(barrier, 128);
    stage_round<kEpilogueBoxes, OutT>(o, tile, acc, buffer, round);
    named_barrier(barrier, 128);
    const int64_t col = tile.col0 + (round * kEpilogueBoxes + box) * kChunkCols + unit * 8;
    if (col >= o.cols) continue;  // cols is a multiple of 8: a piece is wholly in or out
#pragma unroll
    for (int pass = 0; pass < kScatterPasses; ++pass) {
      if (dst[pass] == nullptr) continue;
      const int r = scatter_row(pass, thread);
      const uint8_t* piece =
          buffer + box * kEpilogueBoxBytes + r * kEpilogueRowBytes + (unit ^ ((r / 2) % 4)) * 16;
      red_add8(dst[pass] + col, *reinterpret_cast<const uint4*>(piece));
    }
  }
}

// Stores this warpgroup's accumulators straight from registers, masking rows past the tile's
// valid rows (fp32 accumulation: read, add, write).
template <typename OutT>
__device__ __forceinline__ void store_tile_direct(const Sm90GemmParams& p,
                                                  const TileOutput<OutT>& o, const Tile& tile,
                                                  const float (&acc)[128], int consumer) {
  // Accumulator layout of m64nN: warp w holds rows 16w..16w+15; lane l holds rows l/4 and
  // l/4 + 8 of those, columns 8j + 2(l%4) + {0, 1} in registers 4j + {0, 1} / {2, 3}.
  const int thread = threadIdx.x % 128, warp = thread / kWarpSize, lane = thread % kWarpSize;
  const int row_in_tile = consumer * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
    const int64_t col = tile.col0 + j * 8 + (lane % 4) * 2;
    if (col >= o.cols) continue;  // cols is a multiple of 8, so col + 1 is in range too
    const float2 bias = bias_pair(o, col);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row_in_tile + half * 8;
      if (r >= tile.valid_rows) continue;
      OutT* dst = o.out + static_cast<int64_t>(r) * o.cols + col;
      float v0 = acc[4 * j + 2 * half] * o.scale + bias.x;
      float v1 = acc[4 * j + 2 * half + 1] * o.scale + bias.y;
      if constexpr (std::is_same_v<OutT, float>) {
        if (p.accumulate) {
          const float2 old = *reinterpret_cast<const float2*>(dst);
          v0 += old.x;
          v1 += old.y;
        }
      }
      store2(dst, v0, v1);
    }
  }
}

// The epilogue of one tile: where this warpgroup's 64 rows of it go (TileOutput), then the store
// that writes them. kScaled: FP8 with per-tensor scales, the group's two scale_inv multiplied in
// here (block scales were applied in the main loop). `targets`: load_scatter_targets' entries,
// read only when rows are scattered.
template <GemmKind kKind, int kEpilogueBoxes, typename OutT, bool kScaled>
__device__ __forceinline__ void store_tile(const KernelArgs& args, const Tile& tile,
                                           const float (&acc)[128], uint8_t* buffer, int consumer,
                                           const ScatterTargets& targets) {
  const Sm90GemmParams& p = args.p;
  TileOutput<OutT> o{};
  o.scale = kScaled ? args.a_scale_inv[tile.group] * args.b_scale_inv[tile.group] : 1.0f;
  bool tma = args.out_tma;
  if constexpr (kKind == GemmKind::kWgrad) {
    if (tile.k_blocks == 0 && p.accumulate) return;  // empty group: main-grad left untouched
    o.out = const_cast<OutT*>(group_ptr<OutT>(p.weight_grad, tile.group)) +
            static_cast<int64_t>(tile.row0) * p.k;
    o.cols = p.k;
    o.map_group = tile.group;
    o.map_rows = p.n;
  } else {
    o.cols = kKind == GemmKind::kFprop ? p.n : p.k;
    o.out = static_cast<OutT*>(p.output) + static_cast<int64_t>(tile.row0) * o.cols;
    if constexpr (kKind == GemmKind::kFprop) {
      if (p.bias.base != nullptr || p.bias.table != nullptr)
        o.bias = group_ptr<OutT>(p.bias, tile.group);
    }
    o.map_group = 0;
    o.map_rows = p.rows;
    // A TMA store would write whole 64-row boxes: rows of the next group must not be touched.
    tma = tma && tile.valid_rows >= (consumer + 1) * 64;
  }
  if constexpr (kMayScatter<kKind, OutT>) {
    if (p.scatter_rows != nullptr) {
      scatter_add_tile<kEpilogueBoxes, OutT>(p, o, tile, acc, buffer, consumer, targets);
      return;
    }
  }
  if (tma) {
    store_tile_tma<kEpilogueBoxes, OutT>(args, o, tile, acc, buffer, consumer);
  } else {
    store_tile_direct<OutT>(p, o, tile, acc, consumer);
  }
}

}  // namespace torchmoe::kernels::sm90
