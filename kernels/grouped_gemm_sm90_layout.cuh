#pragma once
// The shape of one sm90 grouped GEMM block: tile sizes, the shared-memory plan of each kind,
// register budgets and the launch arguments. Kept apart because the device code and the host
// launcher (grouped_gemm_sm90.cu: block size, shared-memory opt-in, tensor-map boxes) must agree
// on these numbers. Included by grouped_gemm_sm90.cu only (directly and through the kernel files).
//
// Block: 3 warpgroups. Warpgroup 0 is the producer (its first warp: one thread issues TMA, all
// 32 lanes copy block scales; all four warps copy gathered rows; it gives registers away with
// setmaxnreg); warpgroups 1 and 2 are consumers, each owning 64 rows of the 128 × 256 output
// tile and issuing m64n256k16 wgmma into 128 fp32 accumulator registers per thread.
// 128 × 256 tiles read 48 KB of shared memory per 2·128·256·64 FLOPs, a third less per FLOP
// than 128 × 128 tiles; that keeps the tensor cores, not shared memory or L2, the limit.
//
// Shared memory (217-226 KiB of 227 by kind, see Smem): slots of (A 16 KB | B 32 KB),
// 128-byte swizzled, one "full" and one "empty" mbarrier per slot; one epilogue buffer per
// consumer; FP8 block scales' area per slot (Smem); the group table. fprop/dgrad: 4 slots and
// 8 KB buffers; wgrad: 3 slots and 32 KB.
// Operands come in 64 × 64 boxes (8 KB) or one larger K-major box:
//
//   K-major operand (x in fprop, dy in dgrad, W in fprop): one TMA box {64 reduction, 128 or 256
//     rows}, row r at r·128 B: 8-row core groups 1024 B apart (SBO); k16 steps move the start
//     by 32 B.
//   MN-major operand (W in dgrad, dy and x in wgrad): 2 or 4 boxes {64 rows, 64 reduction}, 8 KB
//     apart (LBO); reduction step j at j·128 B, 8-step groups 1024 B apart (SBO); k16 steps move
//     the start by 2048 B. wgmma reads it with the transpose bit set.
//
// The trade between pipeline stages and epilogue buffer size differs by kind
// (docs/performance.md): wgrad keeps a whole-tile buffer and 3 stages, because its fp32 tiles with
// 4 stages and small buffers spent 10-15% waiting on their own stores; fprop/dgrad take the
// fourth stage and store in four rounds: +4-9% on small experts.

#include <cuda.h>  // CUtensorMap

#include <cstddef>
#include <cstdint>

#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels::sm90 {

constexpr int kThreads = 384;
constexpr int kBlockM = 128, kBlockN = 256;
// A reduction block is 128 bytes of every operand row: 64 16-bit or 128 FP8 elements.
constexpr int kBlockKBytes = 128;
template <typename T>
constexpr int kBlockKOf = kBlockKBytes / static_cast<int>(sizeof(T));
constexpr int kBoxBytes = 64 * 128;                  // one 64 × 64 box: 8 KB
constexpr int kABytes = (kBlockM / 64) * kBoxBytes;  // 16 KB
constexpr int kBBytes = (kBlockN / 64) * kBoxBytes;  // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;       // A | B
constexpr int kConsumerWarps = 8;                    // the empty barriers' arrivals
// Epilogue boxes: 64 rows × 64 bytes (a 64 × 256 tile of 16-bit values is 8 of them).
constexpr int kEpilogueRowBytes = 64, kEpilogueBoxBytes = 64 * kEpilogueRowBytes;  // 4 KB
// Tile indices pass from the producer to the consumers (and gathering warps) through a ring (see
// claim_tiles in grouped_gemm_sm90_schedule.cuh). The producer runs at most a few reduction blocks
// ahead, i.e. a few tiles when they have one each.
constexpr int kTileSlots = 4;
// Shared memory by kind (see the file comment): wgrad, 3 stages and a whole-tile epilogue buffer
// per consumer; fprop/dgrad (16-bit output), 4 stages and a quarter-tile buffer, four rounds.
// FP8 block scales (Accumulation::kBlockScaled) add an area per stage, filled by the producer warp
// with the stage's operands: A's 128 row scales, then B's, which are wgrad's 256 column scales
// (x's 1x128) or fprop's two 16-byte chunks holding the tile's two n128 halves' scales (the
// weights' 128x128).
template <GemmKind kKind, bool kBlockScaled = false>
struct Smem {
  static constexpr int kStages = kKind == GemmKind::kWgrad ? 3 : 4;
  static constexpr int kEpilogueBoxes = kKind == GemmKind::kWgrad ? 8 : 2;
  static constexpr int kEpilogueBytes = kEpilogueBoxes * kEpilogueBoxBytes;  // per consumer
  static constexpr int kScaleStageBytes =
      !kBlockScaled
          ? 0
          : (kBlockM + (kKind == GemmKind::kWgrad ? kBlockN : 8)) * static_cast<int>(sizeof(float));
  static constexpr size_t kBytes = kStages * kStageBytes + 2 * kEpilogueBytes +
                                   kStages * kScaleStageBytes +
                                   2 * (kStages + kTileSlots) * sizeof(uint64_t) +
                                   kTileSlots * sizeof(int) + 1024;  // + alignment slack
};
// Registers: the producer needs few, the consumers' 128 accumulators need many (64K per SM). 40
// leaves 1K of the register file free; 48, an exact fit, hung the consumers' setmaxnreg.inc on
// the H100 (FP8 wgrad never started).
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <= 65536);
// Dynamic plus the static group table (2 int arrays of G + 1, and one of G with block scales, else
// of 1)
// within the 227 KB a block may use.
template <GemmKind kKind, bool kBlockScaled>
constexpr size_t kSharedBytes = Smem<kKind, kBlockScaled>::kBytes +
                                (2 * (kSm90MaxGroups + 1) + (kBlockScaled ? kSm90MaxGroups : 1)) *
                                    sizeof(int);
static_assert(kSharedBytes<GemmKind::kFprop, false> <= 227 * 1024);
static_assert(kSharedBytes<GemmKind::kWgrad, false> <= 227 * 1024);
static_assert(kSharedBytes<GemmKind::kFprop, true> <= 227 * 1024);
static_assert(kSharedBytes<GemmKind::kWgrad, true> <= 227 * 1024);

// How an FP8 product accumulates (Sm90Fp8GemmParams; 16-bit products: kWhole): in the tensor
// cores across the whole reduction (fast accumulation), split (each 128-deep block's sum added to
// fp32 accumulators), or split with each block's sum multiplied by its block scales first.
enum class Accumulation { kWhole, kSplit, kBlockScaled };

// Everything a launch passes by value; the tensor maps must live in parameter (or global) memory.
struct KernelArgs {
  // Gathered x (fprop's a_map, wgrad's b_map): its source in boxes of one row.
  CUtensorMap a_map;    // fprop: x; dgrad: dy; wgrad: dy (MN-major)
  CUtensorMap b_map;    // fprop/dgrad: equally spaced weights (3-D); wgrad: x (MN-major)
  CUtensorMap out_map;  // y / dx [1, rows, cols] or equally spaced dW [G, n, k]; see out_tma
  bool out_tma;         // out_map is valid (else every tile is stored from registers)
  Sm90GemmParams p;
  // FP8 (Sm90Fp8GemmParams): each group's dequantization scales, multiplied into its tiles, and
  // for wgrad the per-group maps of the columnwise operands (group g: maps 2g and 2g + 1, written
  // on the device by build_wgrad_maps; a_map and b_map are unused).
  // Block scales: a_scale_inv and b_scale_inv are split_quantize's block-scale buffers, A's 1x128
  // and B's 128x128 (fprop/dgrad) or 1x128 (wgrad); the producer copies each stage's.
  const float* a_scale_inv;
  const float* b_scale_inv;
  const CUtensorMap* group_maps;
};

}  // namespace torchmoe::kernels::sm90
