#pragma once
// Which output tiles each block of the persistent sm90 grouped GEMM computes, and in what order:
// the per-block group table built from the device split sizes, the order of the tile list
// (panels), and the ring through which the producer hands tile indices to the consumers. Kept
// apart from the kernel because this is the scheduling policy (tuned on skewed splits;
// docs/performance.md), not the data path. Included by grouped_gemm_sm90.cu only (through
// grouped_gemm_sm90_kernel.cuh).
//
// The persistent grid walks a global tile list, group after group: round-robin for fprop and
// dgrad, claimed from a global counter for wgrad (claim_tiles); each block's producer passes its
// tile indices to its consumers and gathering warps (receive_tiles). Per-group row offsets and tile
// counts are computed once per block from the device split sizes.

#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/kernels/grouped_gemm_sm90_layout.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_ptx.cuh"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels::sm90 {

// Per-block view of the groups: clamped row offsets and sizes, and the first tile of each group.
struct GroupTable {
  int* start;  // [G + 1]: clamped row offsets; start[G] is where the last group ends
  int* tiles;  // [G + 1]: tile prefix
  // FP8 block scales only (else null), [G]: where group g's scales start, in units of the
  // layouts of kernels/split_quantize.h: Σ_{h<g} r4(m_h) (fprop/dgrad, A's rowwise 1x128 scales)
  // or Σ_{h<g} ceil(m_h / 128) (wgrad, both operands' columnwise 1x128 scales).
  int* scale_units;

  // Group g's clamped size.
  __device__ __forceinline__ int count(int g) const { return start[g + 1] - start[g]; }
};

// One warp: chunked exclusive scans of the split sizes (rows) and of the tiles per group.
template <GemmKind kKind>
__device__ void build_group_table(const Sm90GemmParams& p, GroupTable t) {
  const int lane = threadIdx.x % kWarpSize;
  const int G = p.num_groups;
  const int per_lane = (G + kWarpSize - 1) / kWarpSize;
  const int first = min(G, lane * per_lane), last = min(G, first + per_lane);
  const int out_tiles_n =
      static_cast<int>(((kKind == GemmKind::kFprop ? p.n : p.k) + kBlockN - 1) / kBlockN);
  const int wgrad_tiles =
      static_cast<int>(((p.n + kBlockM - 1) / kBlockM) * ((p.k + kBlockN - 1) / kBlockN));
  // Output tiles of a group of `size` rows: wgrad's output does not depend on the group's size.
  auto tiles_of = [&](int64_t size) {
    return kKind == GemmKind::kWgrad
               ? wgrad_tiles
               : static_cast<int>((size + kBlockM - 1) / kBlockM) * out_tiles_n;
  };

  // Clamped starts: group g ends where g + 1 starts (sizes are non-negative), the last at start[G].
  int64_t rows = 0;
  for (int g = first; g < last; ++g) rows += split_at(p.m_splits, p.splits_int32, g, p.rows);
  const int64_t row_prefix = warp_inclusive_scan(rows);
  int64_t row = row_prefix - rows;
  for (int g = first; g < last; ++g) {
    t.start[g] = static_cast<int>(min(row, p.rows));
    row += split_at(p.m_splits, p.splits_int32, g, p.rows);
  }
  if (lane == kWarpSize - 1) t.start[G] = static_cast<int>(min(row_prefix, p.rows));
  __syncwarp();
  int tiles = 0;
  for (int g = first; g < last; ++g) tiles += tiles_of(t.count(g));
  const int tile_prefix = warp_inclusive_scan(tiles);
  int tile = tile_prefix - tiles;
  for (int g = first; g < last; ++g) {
    t.tiles[g] = tile;
    tile += tiles_of(t.count(g));
  }
  if (lane == kWarpSize - 1) t.tiles[G] = tile_prefix;
  if (t.scale_units != nullptr) {
    auto units_of = [](int size) {
      return static_cast<int>(kKind == GemmKind::kWgrad ? block_count(size) : round_up4(size));
    };
    int units = 0;
    for (int g = first; g < last; ++g) units += units_of(t.count(g));
    int unit = warp_inclusive_scan(units) - units;
    for (int g = first; g < last; ++g) {
      t.scale_units[g] = unit;
      unit += units_of(t.count(g));
    }
  }
}

// One output tile: its group, where its rows and columns start, and how many reduction blocks.
struct Tile {
  int group;
  int row0;        // fprop/dgrad: first row of x/dy (absolute); wgrad: first row of dW_g
  int valid_rows;  // rows of the tile inside the group (fprop/dgrad) or inside dW_g (wgrad)
  int col0;        // first output column
  int k_blocks;
  int reduction_rows;  // wgrad: rows of the group (for the masked last block)
};

// A group's output is a grid of row tiles × column tiles, walked in panels of up to kPanelRows
// row tiles: down a panel's rows first, then across its columns, then the next panel.
// Consecutive tiles run at the same time on neighbouring blocks, so a wave of ~132 tiles covers
// about 16 row tiles × 8 column tiles (128 and 256 wide): close to square in operand bytes, which
// minimises what one wave reads. Outputs of at most kPanelRows row tiles (most fprop/dgrad
// groups) are walked rows first; tall ones (fc1's wgrad, dW[28672, 4096] on mixtral) do not put
// 132 row tiles of dy into one wave.
constexpr int kPanelRows = 16;

// kBlockRed: the reduction elements of one block (kBlockKOf of the operand type).
template <GemmKind kKind, int kBlockRed>
__device__ __forceinline__ Tile tile_at(const Sm90GemmParams& p, const GroupTable& t, int g,
                                        int index) {
  const int local = index - t.tiles[g];
  const int64_t out_rows = kKind == GemmKind::kWgrad ? p.n : t.count(g);
  const int64_t out_cols = kKind == GemmKind::kFprop ? p.n : p.k;
  const int row_tiles = static_cast<int>((out_rows + kBlockM - 1) / kBlockM);
  const int col_tiles = static_cast<int>((out_cols + kBlockN - 1) / kBlockN);
  const int panel = local / (kPanelRows * col_tiles), in_panel = local % (kPanelRows * col_tiles);
  const int panel_rows = min(kPanelRows, row_tiles - panel * kPanelRows);
  const int m = panel * kPanelRows + in_panel % panel_rows, c = in_panel / panel_rows;
  Tile tile;
  tile.group = g;
  tile.valid_rows = static_cast<int>(min(static_cast<int64_t>(kBlockM), out_rows - m * kBlockM));
  tile.col0 = c * kBlockN;
  if constexpr (kKind == GemmKind::kWgrad) {
    tile.row0 = m * kBlockM;
    tile.reduction_rows = t.count(g);
    tile.k_blocks = (t.count(g) + kBlockRed - 1) / kBlockRed;
  } else {
    tile.row0 = t.start[g] + m * kBlockM;
    const int64_t reduction = kKind == GemmKind::kFprop ? p.k : p.n;
    tile.k_blocks = static_cast<int>((reduction + kBlockRed - 1) / kBlockRed);
    tile.reduction_rows = 0;
  }
  return tile;
}

// A block's first tile is blockIdx.x. fprop and dgrad tiles all reduce over the same length, so
// the next one is gridDim.x further on (a fixed round-robin). wgrad tiles reduce over their
// group's rows: with skewed splits, round-robin leaves the blocks that draw the big groups' tiles
// working while the others idle (modelled on the benchmark's qwen3 splits: 13-16% over an even
// share), so wgrad blocks claim the lowest index nobody has taken from a global counter that the
// launcher zeroes (modelled: 0-1%; measured +20% on qwen3 skewed wgrad). fprop and dgrad skip the
// counter: claiming measured the same there, and zeroing it costs a memset per call. Blocks take
// neighbouring indices at about the same time either way, so the panel order keeps its L2 reuse.
//
// The producer warp decides (its lane 0 claims one index ahead, so the atomic's latency overlaps
// the current tile's loads) and passes each index to the consumers, and to the producer
// warpgroup's other warps when they gather rows, through kTileSlots shared-memory slots with
// full/empty mbarriers, as it passes operands; an index past the last tile ends every loop. The
// whole warp runs the loop because gathered rows are loaded by all its lanes
// (grouped_gemm_sm90_kernel.cuh).
struct TileRing {
  int* index;       // [kTileSlots]
  uint64_t* full;   // [kTileSlots]: one arrival, the producer's
  uint64_t* empty;  // [kTileSlots]: one arrival per consumer warp (and per other gathering warp)
};

template <GemmKind kKind, int kBlockRed, typename Fn>
__device__ __forceinline__ void claim_tiles(const Sm90GemmParams& p, const GroupTable& t,
                                            const TileRing& ring, Fn&& fn) {
  const int total = t.tiles[p.num_groups];
  const int lane = threadIdx.x % kWarpSize;
  int slot = 0, g = 0;
  uint32_t phase = 0;
  for (int index = blockIdx.x;;) {
    int next;
    if constexpr (kKind == GemmKind::kWgrad) {
      // Lane 0 claims; the others learn the index at the end of the tile, after its loads.
      next = total;
      if (lane == 0 && index < total) {
        next = static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1);
      }
    } else {
      next = index + static_cast<int>(gridDim.x);
    }
    mbar_wait(&ring.empty[slot], phase ^ 1);
    if (lane == 0) {
      ring.index[slot] = index;
      mbar_arrive(&ring.full[slot]);
    }
    if (++slot == kTileSlots) {
      slot = 0;
      phase ^= 1;
    }
    if (index >= total) return;
    while (index >= t.tiles[g + 1]) ++g;  // a block's indices only grow
    fn(tile_at<kKind, kBlockRed>(p, t, g, index));
    index = kKind == GemmKind::kWgrad ? __shfl_sync(0xffffffffu, next, 0) : next;
  }
}

template <GemmKind kKind, int kBlockRed, typename Fn>
__device__ __forceinline__ void receive_tiles(const Sm90GemmParams& p, const GroupTable& t,
                                              const TileRing& ring, Fn&& fn) {
  const int total = t.tiles[p.num_groups];
  const int lane = threadIdx.x % kWarpSize;
  int slot = 0, g = 0;
  uint32_t phase = 0;
  while (true) {
    mbar_wait(&ring.full[slot], phase);
    const int index = ring.index[slot];
    __syncwarp();  // every lane has read the slot before it is handed back
    if (lane == 0) mbar_arrive(&ring.empty[slot]);
    if (++slot == kTileSlots) {
      slot = 0;
      phase ^= 1;
    }
    if (index >= total) return;
    while (index >= t.tiles[g + 1]) ++g;
    fn(tile_at<kKind, kBlockRed>(p, t, g, index));
  }
}

}  // namespace torchmoe::kernels::sm90
