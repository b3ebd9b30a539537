#pragma once
// Where split-quantize works (split_quantize.cu's kernel): the block's shape, the split layout
// that each block derives from the device split sizes into shared memory, the units a block takes
// and the 128×128 tiles they stand for, and where a tile lies (its split, rows and columns, input
// address). Kept apart from the kernel because every other piece (the sources, the scheduler, the
// outputs) places its loads and stores by these. Included by split_quantize.cu only (directly and
// through the other split_quantize_*.cuh).
//
// A split's row tiles start at its first row, so a tile (and a block scale) never straddles two
// splits: global row tile rt belongs to the last split g with Σ_{h<g} ceil(m_h / 128) <= rt.

#include <cstddef>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/split_quantize.h"

namespace torchmoe::kernels::split_quantize {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTile = static_cast<int>(kQuantizeBlock);
constexpr unsigned kFullMask = 0xffffffffu;

// How a block's threads cover a tile: each loads P consecutive rows × V columns with 16-byte
// loads, V = 16 / sizeof(T), so 16 threads share a row of a 16-bit type and 32 one of fp32.
template <typename T>
struct PieceShape {
  static constexpr int kVector = 16 / static_cast<int>(sizeof(T));  // V: elements per piece
  static constexpr int kRowThreads = kTile / kVector;               // threads sharing a row
  static constexpr int kRowGroups = kThreads / kRowThreads;         // 16 or 8
  static constexpr int kRows = kTile / kRowGroups;                  // P: rows per thread, 8 or 16
};

// This thread's place in every tile (fixed for the launch).
struct ThreadPlace {
  int lane_col;  // which of the kRowThreads threads of its row
  int c0;        // first tile column
  int r0;        // first tile row
  int warp;
};

template <typename T>
__device__ __forceinline__ ThreadPlace thread_place() {
  using Shape = PieceShape<T>;
  ThreadPlace t;
  t.lane_col = threadIdx.x % Shape::kRowThreads;
  t.c0 = t.lane_col * Shape::kVector;
  t.r0 = threadIdx.x / Shape::kRowThreads * Shape::kRows;
  t.warp = threadIdx.x / kWarpSize;
  return t;
}

// Where each split lives, from the clamped split sizes: G + 1 entries each (entry G: the totals).
struct SplitLayout {
  int64_t* start;   // first row
  int64_t* cstart;  // Σ_{h<g} r16(m_h): where split g's columnwise block starts, in K-element rows
  int32_t* tiles;   // Σ_{h<g} ceil(m_h / 128): row tiles before split g
  int32_t* rows4;   // Σ_{h<g} r4(m_h)
  int32_t* tiles4;  // Σ_{h<g} r4(ceil(m_h / 128))
};

__host__ __device__ inline size_t layout_bytes(int groups) {
  return static_cast<size_t>(groups + 1) * (2 * sizeof(int64_t) + 3 * sizeof(int32_t));
}

// The stash of a paired GLU gradient source, or kCurrent's (split_quantize_scheduler.cuh), follows
// the layout in dynamic shared memory: one 16-byte piece per row of each thread, P = 8 rows for
// 16-bit types. With it, the block's 57 KB of shared memory still let three blocks share an SM
// (four for a delayed-scaling GLU forward source with few splits).
constexpr size_t kStashBytes = size_t{8} * kThreads * 16;
__host__ __device__ inline size_t stash_offset(int groups) {
  return (layout_bytes(groups) + 15) / 16 * 16;
}

// Warp 0 scans the split sizes 32 at a time; the block waits for it. Every block derives the
// layout itself: no setup launch and no host copy.
__device__ inline SplitLayout build_layout(const SplitQuantizeParams& p, char* shared) {
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
      const int64_t s = g < groups ? split_at(p.m_splits, p.splits_int32, g, p.rows) : 0;
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
        mb = static_cast<int32_t>(block_count(m));
        r4 = static_cast<int32_t>(round_up4(m));
        mb4 = static_cast<int32_t>(round_up4(mb));
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
__device__ __forceinline__ int split_of_tile(const SplitLayout& l, int groups, int32_t rt) {
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

// A unit is what a block takes in one step: one tile, or, for a GLU gradient source whose a and b
// blocks are whole tiles (`paired`), a tile of a columns and the tile of b columns with the same
// j, so that a, b and dy are loaded and the activation's terms computed once for the two
// (split_quantize_sources.cuh). Units run row tile by row tile, unit_cols per row tile.
struct UnitGrid {
  bool paired;
  int64_t col_tiles;    // tiles per row tile: ceil(K / 128)
  int64_t block_tiles;  // paired: tiles per a (or b) block
  int64_t unit_cols;    // units per row tile
  int64_t units;

  // The tile of `unit` that half `half` (0: a's; 1: b's, paired only) works on.
  __device__ __forceinline__ int64_t tile(int64_t unit, int half) const {
    if (!paired) return unit;
    const int64_t rt = unit / unit_cols, pair = unit % unit_cols;
    return rt * col_tiles + pair / block_tiles * 2 * block_tiles + pair % block_tiles +
           half * block_tiles;
  }
};

// Where a 128×128 tile lies: its split, its place in the split, and its first input row.
template <typename T>
struct TileSpot {
  int g;
  int mb, kb;          // row tile within the split, column tile
  int64_t m;           // rows of the split
  int64_t row0, col0;  // global row (in the outputs) and column of element (0, 0)
  int rows_valid, cols_valid;
  const T* input;  // element (0, 0) in the input or in split g's own tensor
};

template <typename T>
__device__ __forceinline__ TileSpot<T> locate(const SplitQuantizeParams& p, const SplitLayout& l,
                                              int64_t tile, int64_t col_tiles) {
  TileSpot<T> s;
  // 32-bit: a 64-bit division is several times the cost, and the launch checks the count fits.
  const auto rt =
      static_cast<int32_t>(static_cast<uint32_t>(tile) / static_cast<uint32_t>(col_tiles));
  s.kb = static_cast<int>(tile - static_cast<int64_t>(rt) * col_tiles);
  s.g = split_of_tile(l, p.num_groups, rt);
  const int64_t start = l.start[s.g];
  s.m = l.start[s.g + 1] - start;
  s.mb = static_cast<int>(rt - l.tiles[s.g]);
  s.row0 = start + static_cast<int64_t>(s.mb) * kTile;
  s.rows_valid =
      static_cast<int>(min(static_cast<int64_t>(kTile), s.m - static_cast<int64_t>(s.mb) * kTile));
  s.col0 = static_cast<int64_t>(s.kb) * kTile;
  s.cols_valid = static_cast<int>(min(static_cast<int64_t>(kTile), p.k - s.col0));
  // Gathered rows are found per row (load_pieces): from the input's first row.
  const T* input = static_cast<const T*>(p.input) + (p.gather_rows ? 0 : s.row0 * p.k);
  if (p.split_inputs.base != nullptr || p.split_inputs.table != nullptr) {
    input = group_ptr<T>(p.split_inputs, s.g) + static_cast<int64_t>(s.mb) * kTile * p.k;
  }
  s.input = input + s.col0;
  return s;
}

}  // namespace torchmoe::kernels::split_quantize
