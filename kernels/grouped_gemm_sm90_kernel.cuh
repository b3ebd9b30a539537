#pragma once
// The sm90 grouped GEMM kernel: the producer's TMA loads, the consumers' wgmma main loop, and
// the __global__ entry that lays out shared memory and splits the block into warpgroups. This is
// the data path; the block's shape is in grouped_gemm_sm90_layout.cuh, the order of the tiles in
// grouped_gemm_sm90_schedule.cuh, what becomes of a tile's accumulators (scaling, bias, stores)
// in grouped_gemm_sm90_epilogue.cuh and the instructions in grouped_gemm_sm90_ptx.cuh. Included
// by grouped_gemm_sm90.cu only, which instantiates and launches the kernel.
//
// FP8 (operand types E4M3/E5M2): the same blocks, with 128 FP8 elements per reduction block (the
// same 128 bytes) and k32 instructions. wgmma reads FP8 K-major only, so wgrad takes the
// columnwise copies: both operands K-major, loaded as fprop's are, each group through its own
// pair of tensor maps (its block's width differs). The epilogue multiplies each group's
// accumulators by its two scale_inv; with block scales each 128-deep block's sums are multiplied
// by their scales as they are added instead (consume).

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/kernels/grouped_gemm_sm90_epilogue.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_layout.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_ptx.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_schedule.cuh"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels::sm90 {

// Gathered rows (Sm90GemmParams::gather_rows): one TMA load per row and 128-byte box, through a
// map of the source with boxes of one row (a_map in fprop, b_map in wgrad), each box placed at
// its row of a 1024-byte swizzle atom. TMA's 128-byte swizzle is a function of the destination's
// shared-memory address bits (bits 4-6 XOR bits 7-9), so a one-row box at atom row r lands as
// row r of a whole-atom box would: the layout wgmma's descriptors read. The gathered tests
// compare every product with the one on the gathered copy bit for bit, which holds that.
// A row without a source (-1: past the group's rows, or a padding row) is loaded from row -1,
// and columns past k from column k on: out of range, so TMA writes zeros and still counts the
// box's bytes. Each gathering warp's lane 0 adds the warp's bytes to the stage's full barrier
// (one arrival per warp, before any of the warp's loads) and its lanes then issue the loads;
// the barrier completes once every warp has arrived and every byte has landed.
// Whether this kernel gathers rows: fprop's A rows or wgrad's x rows, 16-bit operands only.
template <GemmKind kKind, typename T>
__device__ __forceinline__ bool gathers_rows(const Sm90GemmParams& p) {
  return !kIsFp8<T> && kKind != GemmKind::kDgrad && p.gather_rows != nullptr;
}

__device__ __forceinline__ int gather_row(const Sm90GemmParams& p, int64_t row, bool valid) {
  if (!valid) return -1;
  return static_cast<int>(map_entry(p.gather_rows, p.gather_rows_int32, row));
}

// The gathered loads are shared by the producer warpgroup's kGatherWarps warps (warp 0 also
// issues the other operand's loads and claims the tiles; the others follow its tiles through the
// tile ring): one lane per 128-byte box keeps the issue off any one warp's path.
constexpr int kGatherWarps = 4;

// The gathered bytes of one stage that each gathering warp loads.
template <GemmKind kKind, typename T>
constexpr uint32_t kGatherWarpBytes =
    (kKind == GemmKind::kFprop ? kABytes : kBBytes) / kGatherWarps;

// fprop's A block: the tile's 128 rows (K-major: row i at i·128 B) × 64 reduction elements from
// `r` on; lane l of warp w loads row 32w + l, whose source `rows` holds.
template <typename T>
__device__ __forceinline__ void gather_fprop_a(const KernelArgs& args, uint64_t* bar, int rows,
                                               int r, uint8_t* a, int warp) {
  static_assert(kBlockM == kGatherWarps * kWarpSize, "one fprop row per gathering lane");
  const int row = warp * kWarpSize + threadIdx.x % kWarpSize;
  tma_load_3d(a + row * 128, &args.a_map, bar, r, rows, 0);
}

// wgrad's B block: 64 reduction rows × the tile's 256 columns from col0 on, as 4 MN-major boxes
// (box h: columns col0 + 64h .. + 63, reduction row j at j·128 B); warp w loads rows 16w ..
// 16w + 15, lane l row 16w + l % 16 of boxes l / 16 and l / 16 + 2. `rows` holds the source of
// reduction row 32·(w / 2) + l.
template <typename T>
__device__ __forceinline__ void gather_wgrad_b(const KernelArgs& args, uint64_t* bar, int rows,
                                               int col0, uint8_t* b, int warp) {
  constexpr int kRowsPerWarp = kBlockKOf<T> / kGatherWarps;
  constexpr int kBoxesPerLane = kBlockN / 64 * kRowsPerWarp / kWarpSize;
  static_assert(kBoxesPerLane * kWarpSize == kBlockN / 64 * kRowsPerWarp, "whole boxes per lane");
  const int lane = threadIdx.x % kWarpSize;
  const int j = warp * kRowsPerWarp + lane % kRowsPerWarp;
  const int src = __shfl_sync(0xffffffffu, rows, j % kWarpSize);
#pragma unroll
  for (int i = 0; i < kBoxesPerLane; ++i) {
    const int h = lane / kRowsPerWarp + i * (kWarpSize / kRowsPerWarp);
    tma_load_3d(b + h * kBoxBytes + j * 128, &args.b_map, bar, col0 + 64 * h, src, 0);
  }
}

// The sources of the rows warp `warp` gathers: fprop, once per tile (tile row 32w + lane); wgrad,
// once per reduction block kb (reduction row 32·(w / 2) + lane of the block).
template <GemmKind kKind, typename T>
__device__ __forceinline__ int gather_sources(const Sm90GemmParams& p, const GroupTable& t,
                                              const Tile& tile, int kb, int warp) {
  const int lane = threadIdx.x % kWarpSize;
  if constexpr (kKind == GemmKind::kFprop) {
    const int i = warp * kWarpSize + lane;
    return gather_row(p, static_cast<int64_t>(tile.row0) + i, i < tile.valid_rows);
  } else {
    const int j = kb * kBlockKOf<T> + (warp / 2) * kWarpSize + lane;
    return gather_row(p, static_cast<int64_t>(t.start[tile.group]) + j, j < tile.reduction_rows);
  }
}

// Warp w's share of one stage's gathered loads (the A block in fprop, the B block in wgrad), after
// its lane 0 has added them (and `extra` bytes, warp 0's other loads) to the stage's full barrier.
template <GemmKind kKind, typename T>
__device__ __forceinline__ void gather_stage(const KernelArgs& args, uint64_t* bar,
                                             const Tile& tile, int rows, int kb, uint8_t* a,
                                             uint8_t* b, int warp, uint32_t extra) {
  if (threadIdx.x % kWarpSize == 0) mbar_expect_tx(bar, kGatherWarpBytes<kKind, T> + extra);
  __syncwarp();
  if constexpr (kKind == GemmKind::kFprop) {
    gather_fprop_a<T>(args, bar, rows, kb * kBlockKOf<T>, a, warp);
  }
  if constexpr (kKind == GemmKind::kWgrad) gather_wgrad_b<T>(args, bar, rows, tile.col0, b, warp);
}

// FP8 block scales of one tile in split_quantize's layouts (kernels/split_quantize.h), as
// element offsets at reduction block 0. A is 1x128 in both kinds: the rowwise copy's [KB, r4(m_g)]
// per group (fprop/dgrad: row r of the group at block kb is kb·r4(m_g) + r) or the columnwise
// copy's [MB_g, r4(n)] (wgrad: dW row r, kb·r4(n) + r). B is 128x128 in fprop/dgrad: the
// weights' [cols/128, r4(KB)] per group, one scale per n128 half of the tile; and 1x128 in wgrad,
// per column c: x's columnwise [MB_g, r4(k)], kb·r4(k) + c. Every offset is a multiple of 4 (the
// layouts' r4 padding) and 128-row and 256-column tiles start on multiples of 4, so the copies
// are 16-byte chunks.
struct ScaleSource {
  int a, a_step, a_rows;  // the tile's first row; between blocks; valid rows from the first
  int b;                  // wgrad: column col0; fprop/dgrad: the first half's scale
  int b_step;             // wgrad: between blocks; fprop/dgrad: the second half's from the first's
  int b_cols;             // wgrad: valid columns from col0
};

template <GemmKind kKind>
__device__ __forceinline__ ScaleSource scale_source(const KernelArgs& args, const GroupTable& t,
                                                    const Tile& tile) {
  const Sm90GemmParams& p = args.p;
  const int g = tile.group, units = t.scale_units[g];
  ScaleSource s;
  if constexpr (kKind == GemmKind::kWgrad) {
    const int rows = static_cast<int>(p.n), rows4 = static_cast<int>(round_up4(rows));
    const int cols = static_cast<int>(p.k), cols4 = static_cast<int>(round_up4(cols));
    s.a = rows4 * units + tile.row0;
    s.a_step = rows4;
    s.a_rows = rows - tile.row0;
    s.b = cols4 * units + tile.col0;
    s.b_step = cols4;
    s.b_cols = cols - tile.col0;
  } else {
    constexpr int kBlock = static_cast<int>(kQuantizeBlock);
    const int m = t.count(g), local = tile.row0 - t.start[g];
    const int kb_count = static_cast<int>(block_count(p.k));
    const int kb4 = static_cast<int>(round_up4(kb_count));
    const int cols = static_cast<int>(p.n), col_blocks = static_cast<int>(block_count(cols));
    s.a = kb_count * units + local;
    s.a_step = static_cast<int>(round_up4(m));
    s.a_rows = m - local;
    s.b = (g * col_blocks + tile.col0 / kBlock) * kb4;
    // A second half wholly past the last column (never stored) reads the first half's scale.
    s.b_step = tile.col0 + kBlock < cols ? kb4 : 0;
    s.b_cols = 0;
  }
  return s;
}

// The producer warp's copy of reduction block kb's scales into a stage's area
// (Smem::kScaleStageBytes): lane l copies A's rows 4l..4l+3, and B's columns 4l.. and 128 + 4l..
// (wgrad) or, lanes 0 and 1, the 16-byte chunks holding the two halves' scales (fprop/dgrad: block
// kb's at kb % 4). Chunks wholly past the valid rows or columns are zero-filled; the last valid
// chunk may carry up to 3 of the layouts' padding entries. Neither feeds a stored result.
template <GemmKind kKind>
__device__ __forceinline__ void copy_block_scales(const KernelArgs& args, const ScaleSource& s,
                                                  int kb, uint8_t* area) {
  const int lane = threadIdx.x % kWarpSize;
  const uint32_t dst = smem_u32(area);
  const bool a_valid = 4 * lane < s.a_rows;
  cp_async_16(dst + 16 * lane, args.a_scale_inv + (a_valid ? s.a + kb * s.a_step + 4 * lane : 0),
              a_valid ? 16 : 0);
  const uint32_t b_dst = dst + kBlockM * sizeof(float);
  if constexpr (kKind == GemmKind::kWgrad) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int c = 4 * lane + 128 * q;
      const bool valid = c < s.b_cols;
      cp_async_16(b_dst + 4 * c, args.b_scale_inv + (valid ? s.b + kb * s.b_step + c : 0),
                  valid ? 16 : 0);
    }
  } else {
    if (lane < 2) {
      cp_async_16(b_dst + 16 * lane, args.b_scale_inv + s.b + lane * s.b_step + kb / 4 * 4, 16);
    }
  }
}

// The producer warp: lane 0 issues the TMA loads and the tile handoff, all lanes copy block scales
// or load the warp's share of gathered rows. FP8 wgrad loads both operands K-major, as fprop
// does, each group through its own maps.
template <GemmKind kKind, typename T, bool kBlockScaled>
__device__ void produce(const KernelArgs& args, const GroupTable& t, const TileRing& ring,
                        uint8_t* smem, uint64_t* full, uint64_t* empty, uint8_t* scales) {
  constexpr bool kGroupMaps = kIsFp8<T> && kKind == GemmKind::kWgrad;
  const Sm90GemmParams& p = args.p;
  const int lane = threadIdx.x % kWarpSize;
  const bool gather = gathers_rows<kKind, T>(p);
  // The bytes TMA delivers per stage: all, or the operand that is not gathered (W, or dy).
  const uint32_t tma_bytes = !gather ? kStageBytes : kKind == GemmKind::kFprop ? kBBytes : kABytes;
  int stage = 0;
  uint32_t phase = 0;
  int acquired = -1;  // the group whose maps this thread last acquired
  claim_tiles<kKind, kBlockKOf<T>>(p, t, ring, [&](const Tile& tile) {
    const CUtensorMap* w_map = p.weight_maps != nullptr
                                   ? static_cast<const CUtensorMap*>(p.weight_maps) + tile.group
                                   : &args.b_map;
    const int w_group = p.weight_maps != nullptr ? 0 : tile.group;
    const CUtensorMap* group_a = kGroupMaps ? args.group_maps + 2 * tile.group : nullptr;
    if constexpr (kGroupMaps) {
      if (lane == 0 && tile.group != acquired) {
        tensormap_acquire(group_a);
        tensormap_acquire(group_a + 1);
        acquired = tile.group;
      }
    }
    ScaleSource source{};
    if constexpr (kBlockScaled) source = scale_source<kKind>(args, t, tile);
    // Gathered rows: this warp's sources, per tile (fprop) or per block (wgrad, read before
    // waiting for the slot so that the wait hides the loads).
    int rows =
        kKind == GemmKind::kFprop && gather ? gather_sources<kKind, T>(p, t, tile, 0, 0) : -1;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      const int r = kb * kBlockKOf<T>;  // reduction offset
      if (kKind == GemmKind::kWgrad && gather) rows = gather_sources<kKind, T>(p, t, tile, kb, 0);
      mbar_wait(&empty[stage], phase ^ 1);
      uint8_t* a = smem + stage * kStageBytes;
      uint8_t* b = a + kABytes;
      // Gathering: the barrier's bytes are added with the warp's share (gather_stage), before
      // any load.
      if (gather) gather_stage<kKind, T>(args, &full[stage], tile, rows, kb, a, b, 0, tma_bytes);
      if (lane == 0) {
        if (!gather) mbar_expect_tx(&full[stage], tma_bytes);
        if constexpr (kKind == GemmKind::kFprop) {
          if (!gather) tma_load_3d(a, &args.a_map, &full[stage], r, tile.row0, 0);
          tma_load_3d(b, w_map, &full[stage], r, tile.col0, w_group);
        } else if constexpr (kGroupMaps) {
          tma_load_3d(a, group_a, &full[stage], r, tile.row0, 0);
          tma_load_3d(b, group_a + 1, &full[stage], r, tile.col0, 0);
        } else if constexpr (kKind == GemmKind::kDgrad) {
          tma_load_3d(a, &args.a_map, &full[stage], r, tile.row0, 0);
          for (int h = 0; h < kBlockN / 64; ++h) {
            tma_load_3d(b + h * kBoxBytes, w_map, &full[stage], tile.col0 + 64 * h, r, w_group);
          }
        } else {
          const int row = t.start[tile.group] + r;
          for (int h = 0; h < kBlockM / 64; ++h) {
            tma_load_3d(a + h * kBoxBytes, &args.a_map, &full[stage], tile.row0 + 64 * h, row, 0);
          }
          if (!gather) {
            for (int h = 0; h < kBlockN / 64; ++h) {
              tma_load_3d(b + h * kBoxBytes, &args.b_map, &full[stage], tile.col0 + 64 * h, row, 0);
            }
          }
        }
      }
      if constexpr (kBlockScaled) {
        copy_block_scales<kKind>(args, source, kb,
                                 scales + stage * Smem<kKind, true>::kScaleStageBytes);
        cp_async_mbar_arrive(&full[stage]);
      }
      if (++stage == Smem<kKind>::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  });
  // No copy may still be writing shared memory when the warp exits.
  if constexpr (kBlockScaled) cp_async_wait_all();
}

// Warps 1 .. kGatherWarps - 1 of the producer warpgroup when rows are gathered: they follow the
// tiles warp 0 claims through the tile ring (as the consumers do) and load their share of each
// stage's gathered rows, arriving on its full barrier as warp 0 does.
template <GemmKind kKind, typename T>
__device__ void gather_helper(const KernelArgs& args, const GroupTable& t, const TileRing& ring,
                              uint8_t* smem, uint64_t* full, uint64_t* empty, int warp) {
  const Sm90GemmParams& p = args.p;
  int stage = 0;
  uint32_t phase = 0;
  receive_tiles<kKind, kBlockKOf<T>>(p, t, ring, [&](const Tile& tile) {
    int rows = kKind == GemmKind::kFprop ? gather_sources<kKind, T>(p, t, tile, 0, warp) : -1;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      if (kKind == GemmKind::kWgrad) rows = gather_sources<kKind, T>(p, t, tile, kb, warp);
      mbar_wait(&empty[stage], phase ^ 1);
      uint8_t* a = smem + stage * kStageBytes;
      gather_stage<kKind, T>(args, &full[stage], tile, rows, kb, a, a + kABytes, warp, 0);
      if (++stage == Smem<kKind>::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  });
}

// acc's n128 half `half` += part, each element times its row's and column's scale of one
// reduction block (m64n128 layout: register 4j + {0, 1} holds row r, columns 8j + 2(lane % 4) +
// {0, 1} of the half; 4j + {2, 3} row r + 8). sa0, sa1: rows r and r + 8; `columns`: the half's
// 128 column scales in shared memory (1x128 B), or null and every column's is sb (128x128 B).
__device__ __forceinline__ void add_scaled_half(float (&acc)[128], const float (&part)[64],
                                                int half, float sa0, float sa1, float sb,
                                                const float* columns, int lane) {
  if (columns != nullptr) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float2 c = *reinterpret_cast<const float2*>(columns + j * 8 + (lane % 4) * 2);
      acc[64 * half + 4 * j + 0] += part[4 * j + 0] * c.x * sa0;
      acc[64 * half + 4 * j + 1] += part[4 * j + 1] * c.y * sa0;
      acc[64 * half + 4 * j + 2] += part[4 * j + 2] * c.x * sa1;
      acc[64 * half + 4 * j + 3] += part[4 * j + 3] * c.y * sa1;
    }
  } else {
    const float s0 = sa0 * sb, s1 = sa1 * sb;
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[64 * half + i] += part[i] * (i % 4 < 2 ? s0 : s1);
  }
}

// TA, TB: the operands' types (one 16-bit type twice, or FP8 formats, both K-major). kAcc (FP8):
// kSplit is split accumulation, as cuBLASLt's FP8 GEMMs without fast accumulation. The tensor
// cores keep FP8 products' partial sums with about 14 significant bits; here each 128-deep
// block's products are summed by wgmma alone (one n128 half of the tile at a time, into 64
// registers besides the tile's 128) and then added to the fp32 accumulators, so that the
// truncation error does not grow with the reduction's length. A warpgroup waits for each half
// before adding it, so the two consumers take turns issuing their halves (two named barriers,
// ping-pong): the tensor cores run one consumer's half while the other waits for and adds its
// own, instead of both waiting at once. kBlockScaled is the same with each half's sum multiplied
// by its rows' and columns' scales of that 128-deep block as it is added (DeepGEMM's scheme): a
// block of the reduction is one scale block of both operands.
template <GemmKind kKind, typename TA, typename TB, typename OutT, Accumulation kAcc>
__device__ void consume(const KernelArgs& args, const GroupTable& t, const TileRing& ring,
                        uint8_t* smem, uint64_t* full, uint64_t* empty, uint8_t* epilogue,
                        const uint8_t* scales, int consumer) {
  constexpr bool kFp8 = kIsFp8<TA>;
  constexpr bool kSplit = kAcc != Accumulation::kWhole;
  constexpr bool kBlockScaled = kAcc == Accumulation::kBlockScaled;
  constexpr int kTransA = !kFp8 && kKind == GemmKind::kWgrad ? 1 : 0;
  constexpr int kTransB = !kFp8 && kKind != GemmKind::kFprop ? 1 : 0;
  // Per-instruction (k16, or k32 in FP8: 32 bytes either way) start-address steps and the LBO/SBO
  // of each operand (see grouped_gemm_sm90_layout.cuh).
  constexpr uint32_t kStepA = kTransA ? 2048 : 32, kStepB = kTransB ? 2048 : 32;
  const Sm90GemmParams& p = args.p;
  const int thread = threadIdx.x % 128, lane = thread % kWarpSize;
  using Layout = Smem<kKind, kBlockScaled>;
  uint8_t* buffer = epilogue + consumer * Layout::kEpilogueBytes;
  int stage = 0;
  uint32_t phase = 0;
  float acc[128];
  // Split accumulation's turns: consumer c issues after bar.sync on 4 + c; the other consumer
  // arrives there once it has issued. Consumer 0 goes first.
  constexpr int kTurnBarrier = 4;
  if constexpr (kSplit) {
    if (consumer == 1) named_barrier_arrive(kTurnBarrier, 256);
  }

  receive_tiles<kKind, kBlockKOf<TA>>(p, t, ring, [&](const Tile& tile) {
    ScatterTargets targets{};  // read only when scattering
    if constexpr (kMayScatter<kKind, OutT>) {
      if (p.scatter_rows != nullptr) targets = load_scatter_targets(p, tile, consumer);
    }
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int previous = -1;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      mbar_wait(&full[stage], phase);
      uint8_t* a = smem + stage * kStageBytes;
      uint8_t* b = a + kABytes;
      if constexpr (kKind == GemmKind::kWgrad && !kFp8) {
        // The last block of a group reads rows of the next group (or padding): zero them in all
        // six boxes (A and B are adjacent), then make the generic-proxy stores visible to wgmma.
        // (FP8 wgrad's group maps end at the group: TMA fills the rest with zeros.)
        constexpr int kBlockK = kBlockKOf<TA>;
        const int valid = min(kBlockK, tile.reduction_rows - kb * kBlockK);
        if (valid < kBlockK) {
          constexpr int kBoxes = kStageBytes / kBoxBytes;
          const int chunks = (kBlockK - valid) * 8;  // 16-byte chunks per box
          for (int i = threadIdx.x - 128; i < kBoxes * chunks; i += 256) {
            const int box = i / chunks, rem = i % chunks;
            *reinterpret_cast<uint4*>(a + box * kBoxBytes + (valid + rem / 8) * 128 +
                                      (rem % 8) * 16) = make_uint4(0, 0, 0, 0);
          }
          fence_proxy_async();
          named_barrier(1, 256);
        }
      }
      // This warpgroup's 64 rows start 8 KB in for both layouts: 64 K-major rows of 128 B, or the
      // second 64-row MN-major box.
      const uint8_t* a_tile = a + consumer * kBoxBytes;
      if constexpr (kSplit) {
        // Block scales of this stage (produce copied them): this thread's rows' at this block.
        const float* stage_scales =
            reinterpret_cast<const float*>(scales + stage * Layout::kScaleStageBytes);
        float sa0 = 1.0f, sa1 = 1.0f;
        if constexpr (kBlockScaled) {
          const int row = consumer * 64 + (thread / kWarpSize) * 16 + lane / 4;
          sa0 = stage_scales[row];
          sa1 = stage_scales[row + 8];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          float part[64];
          named_barrier(kTurnBarrier + consumer, 256);
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBlockKBytes / 32; ++kk) {
            // B's rows 128·half on: 16 KB in (a multiple of the 1024-byte swizzle atom).
            wgmma_m64n128k32<TA, TB>(part, smem_desc(a_tile + kk * 32, 16, 1024),
                                     smem_desc(b + half * 16384 + kk * 32, 16, 1024), kk > 0);
          }
          wgmma_commit();
          named_barrier_arrive(kTurnBarrier + 1 - consumer, 256);
          wgmma_wait<0>();
          if constexpr (kBlockScaled) {
            const float* b_scales = stage_scales + kBlockM;
            if constexpr (kKind == GemmKind::kWgrad) {
              add_scaled_half(acc, part, half, sa0, sa1, 1.0f, b_scales + half * 128, lane);
            } else {
              // The 16-byte chunk copied for this half holds block kb's scale at kb % 4.
              add_scaled_half(acc, part, half, sa0, sa1, b_scales[half * 4 + kb % 4], nullptr,
                              lane);
            }
          } else {
#pragma unroll
            for (int i = 0; i < 64; ++i) acc[64 * half + i] += part[i];
          }
        }
        // Both halves have read the slot.
        if (lane == 0) mbar_arrive(&empty[stage]);
        if (++stage == Smem<kKind>::kStages) {
          stage = 0;
          phase ^= 1;
        }
        continue;
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockKBytes / 32; ++kk) {
        const uint64_t da = kTransA ? smem_desc(a_tile + kk * kStepA, kBoxBytes, 1024)
                                    : smem_desc(a_tile + kk * kStepA, 16, 1024);
        const uint64_t db = kTransB ? smem_desc(b + kk * kStepB, kBoxBytes, 1024)
                                    : smem_desc(b + kk * kStepB, 16, 1024);
        if constexpr (kFp8) {
          wgmma_m64n256k32<TA, TB>(acc, da, db);
        } else {
          wgmma_m64n256k16<TA, kTransA, kTransB>(acc, da, db);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous block's wgmma are done: its slot can be refilled
      if (previous >= 0 && lane == 0) mbar_arrive(&empty[previous]);
      previous = stage;
      if (++stage == Smem<kKind>::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    if (previous >= 0 && lane == 0) mbar_arrive(&empty[previous]);

    store_tile<kKind, Layout::kEpilogueBoxes, OutT, kFp8 && !kBlockScaled>(args, tile, acc, buffer,
                                                                           consumer, targets);
  });
  // Consumer 1's last arrival is still pending on consumer 0's barrier: consume it.
  if constexpr (kSplit) {
    if (consumer == 0) named_barrier(kTurnBarrier, 256);
  }
  // Shared memory must outlive the stores still reading it.
  if (thread == 0) bulk_wait_all();
}

template <GemmKind kKind, typename TA, typename TB, typename OutT,
          Accumulation kAcc = Accumulation::kWhole>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ KernelArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  constexpr bool kBlockScaled = kAcc == Accumulation::kBlockScaled;
  __shared__ int group_start[kSm90MaxGroups + 1], group_tiles[kSm90MaxGroups + 1],
      group_scale_units[kBlockScaled ? kSm90MaxGroups : 1];
  // 128-byte swizzle atoms must start on 1024-byte boundaries.
  uint8_t* smem = smem_raw + ((1024 - smem_u32(smem_raw) % 1024) % 1024);
  using Layout = Smem<kKind, kBlockScaled>;
  constexpr int kStages = Layout::kStages;
  uint8_t* epilogue = smem + kStages * kStageBytes;
  uint8_t* scales = epilogue + 2 * Layout::kEpilogueBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(scales + kStages * Layout::kScaleStageBytes);
  uint64_t* empty = full + kStages;
  uint64_t* tile_full = empty + kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  const TileRing ring{reinterpret_cast<int*>(tile_empty + kTileSlots), tile_full, tile_empty};
  const GroupTable table{group_start, group_tiles, kBlockScaled ? group_scale_units : nullptr};

  if (threadIdx.x < kWarpSize) build_group_table<kKind>(args.p, table);
  if (threadIdx.x == kWarpSize) {
    // lane 0's expect_tx and the cp.async arrivals of the producer warp's lanes that copy block
    // scales, or one expect_tx per gathering warp (gathered rows, see gather_stage); those warps
    // also take tiles from the ring.
    const bool gather = gathers_rows<kKind, TA>(args.p);
    const int arrivals = gather ? kGatherWarps : 1 + (kBlockScaled ? kWarpSize : 0);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], arrivals);
      mbar_init(&empty[s], kConsumerWarps);
    }
    for (int s = 0; s < kTileSlots; ++s) {
      mbar_init(&ring.full[s], 1);
      mbar_init(&ring.empty[s], kConsumerWarps + (gather ? kGatherWarps - 1 : 0));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
    const int warp = threadIdx.x / kWarpSize;
    if (warp == 0) {
      produce<kKind, TA, kBlockScaled>(args, table, ring, smem, full, empty, scales);
    } else if (warp < kGatherWarps) {
      if constexpr (!kIsFp8<TA> && kKind != GemmKind::kDgrad) {
        if (gathers_rows<kKind, TA>(args.p)) {
          gather_helper<kKind, TA>(args, table, ring, smem, full, empty, warp);
        }
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
    consume<kKind, TA, TB, OutT, kAcc>(args, table, ring, smem, full, empty, epilogue, scales,
                                       threadIdx.x / 128 - 1);
  }
#else
  __trap();  // this library was built without sm_90a code, and the host side checks for it
#endif
}

}  // namespace torchmoe::kernels::sm90
