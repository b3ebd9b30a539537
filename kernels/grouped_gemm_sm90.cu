// One-launch grouped GEMM for sm_90a; see grouped_gemm_sm90.h for the problem and the contract.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer (one thread issues TMA); warpgroups 1 and 2 are
// consumers, each owning 64 rows of the 128 × 128 output tile and issuing m64n128k16 wgmma.
// Shared memory: kStages slots of (A 16 KB | B 16 KB), 128-byte swizzled, one "full" and one
// "empty" mbarrier per slot. A slot holds a 128 × 64 (rows × reduction) tile of each operand:
//
//   K-major operand (x in fprop, dy in dgrad, W in fprop): one TMA box {64 reduction, 128 rows},
//     row r at r·128 B: 8-row core groups 1024 B apart (SBO); k16 steps move the start by 32 B.
//   MN-major operand (W in dgrad, dy and x in wgrad): two boxes {64 rows, 64 reduction}, 8 KB
//     apart (LBO); reduction step j at j·128 B, 8-step groups 1024 B apart (SBO); k16 steps move
//     the start by 2048 B. wgmma reads it with the transpose bit set.
//
// The persistent grid walks a global tile list, group after group, in the same order in every
// role, so the producer and the consumers agree on each slot's tile without talking. Per-group
// row offsets and tile counts are computed once per block from the device split sizes.

#include "torchmoe/kernels/grouped_gemm_sm90.h"

#include <cuda.h>  // CUtensorMap and the encode signature only; the driver is reached at run time
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>

#include "torchmoe/kernels/device_types.cuh"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 384;
constexpr int kBlockM = 128, kBlockN = 128, kBlockK = 64;
constexpr int kStages = 5;
constexpr int kHalfTileBytes = 64 * 128;                      // one 64 × 64 box: 8 KB
constexpr int kOperandBytes = 2 * kHalfTileBytes;             // 16 KB
constexpr int kStageBytes = 2 * kOperandBytes;                // A | B
constexpr int kConsumerWarps = 8;                             // the empty barriers' arrivals
constexpr size_t kSharedBytes = kStages * kStageBytes + 1024  // + alignment slack
                                + 2 * kStages * sizeof(uint64_t);

// Everything a launch passes by value; the tensor maps must live in parameter (or global) memory.
struct KernelArgs {
  CUtensorMap a_map;  // fprop: x; dgrad: dy; wgrad: dy (MN-major)
  CUtensorMap b_map;  // fprop/dgrad: equally spaced weights (3-D); wgrad: x (MN-major)
  Sm90GemmParams p;
};

// ---- device helpers ------------------------------------------------------------------------

__device__ __forceinline__ int64_t split_at(const void* splits, bool int32, int g) {
  const int64_t v =
      int32 ? static_cast<const int32_t*>(splits)[g] : static_cast<const int64_t*>(splits)[g];
  return v > 0 ? v : 0;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Every tensor map is 3-D ([groups, rows, inner]; groups = 1 for a matrix): the instruction's rank
// must match the map's.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA, "matrix descriptor format").
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// d[64 × 128] += A[64 × 16] · B[128 × 16]ᵀ, both from shared memory; kTransA / kTransB select the
// MN-major layouts.
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#define TORCHMOE_WGMMA(TYPE)                                                                       \
  asm volatile(                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                               \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE                                \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"                      \
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"            \
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"            \
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"           \
      " %64, %65, p, 1, 1, %67, %68;\n}"                                                           \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])                                                                                \
      : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB))
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    TORCHMOE_WGMMA("bf16");
  } else {
    TORCHMOE_WGMMA("f16");
  }
#undef TORCHMOE_WGMMA
}

__device__ __forceinline__ void store2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store2(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

template <typename T>
__device__ __forceinline__ const T* group_ptr(const GroupAddress& a, int g) {
  if (a.table != nullptr) return static_cast<const T*>(a.table[g]);
  return static_cast<const T*>(a.base) + static_cast<int64_t>(g) * a.group_stride;
}

// Per-block view of the groups: clamped row offsets and sizes, and the first tile of each group.
struct GroupTable {
  int* start;  // [G]
  int* count;  // [G]
  int* tiles;  // [G + 1]: tile prefix
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

  int64_t rows = 0;
  for (int g = first; g < last; ++g) rows += split_at(p.m_splits, p.splits_int32, g);
  int64_t row_prefix = rows;  // inclusive scan over lanes
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int64_t other = __shfl_up_sync(0xffffffffu, row_prefix, offset);
    if (lane >= offset) row_prefix += other;
  }
  int64_t row = row_prefix - rows;
  int tiles = 0;
  for (int g = first; g < last; ++g) {
    const int64_t split = split_at(p.m_splits, p.splits_int32, g);
    const int64_t begin = min(row, p.rows);
    const int64_t size = min(split, p.rows - begin);
    t.start[g] = static_cast<int>(begin);
    t.count[g] = static_cast<int>(size);
    row += split;
    tiles += tiles_of(size);
  }
  int tile_prefix = tiles;
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int other = __shfl_up_sync(0xffffffffu, tile_prefix, offset);
    if (lane >= offset) tile_prefix += other;
  }
  int tile = tile_prefix - tiles;
  for (int g = first; g < last; ++g) {
    t.tiles[g] = tile;
    tile += tiles_of(t.count[g]);
  }
  if (lane == kWarpSize - 1) t.tiles[G] = tile_prefix;
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

template <GemmKind kKind>
__device__ __forceinline__ Tile tile_at(const Sm90GemmParams& p, const GroupTable& t, int g,
                                        int index) {
  const int local = index - t.tiles[g];
  Tile tile;
  tile.group = g;
  if constexpr (kKind == GemmKind::kWgrad) {
    const int row_tiles = static_cast<int>((p.n + kBlockM - 1) / kBlockM);
    tile.row0 = (local % row_tiles) * kBlockM;
    tile.valid_rows = static_cast<int>(min(static_cast<int64_t>(kBlockM), p.n - tile.row0));
    tile.col0 = (local / row_tiles) * kBlockN;
    tile.reduction_rows = t.count[g];
    tile.k_blocks = (t.count[g] + kBlockK - 1) / kBlockK;
  } else {
    const int row_tiles = (t.count[g] + kBlockM - 1) / kBlockM;
    const int m = local % row_tiles;
    tile.row0 = t.start[g] + m * kBlockM;
    tile.valid_rows = min(kBlockM, t.count[g] - m * kBlockM);
    tile.col0 = (local / row_tiles) * kBlockN;
    const int64_t reduction = kKind == GemmKind::kFprop ? p.k : p.n;
    tile.k_blocks = static_cast<int>((reduction + kBlockK - 1) / kBlockK);
    tile.reduction_rows = 0;
  }
  return tile;
}

// Walks this block's tiles in order, calling fn(tile) for each.
template <GemmKind kKind, typename Fn>
__device__ __forceinline__ void for_each_tile(const Sm90GemmParams& p, const GroupTable& t,
                                              Fn&& fn) {
  const int total = t.tiles[p.num_groups];
  int g = 0;
  for (int index = blockIdx.x; index < total; index += gridDim.x) {
    while (index >= t.tiles[g + 1]) ++g;
    fn(tile_at<kKind>(p, t, g, index));
  }
}

template <GemmKind kKind>
__device__ void produce(const KernelArgs& args, const GroupTable& t, uint8_t* smem, uint64_t* full,
                        uint64_t* empty) {
  const Sm90GemmParams& p = args.p;
  int stage = 0;
  uint32_t phase = 0;
  for_each_tile<kKind>(p, t, [&](const Tile& tile) {
    const CUtensorMap* w_map = p.weight_maps != nullptr
                                   ? static_cast<const CUtensorMap*>(p.weight_maps) + tile.group
                                   : &args.b_map;
    const int w_group = p.weight_maps != nullptr ? 0 : tile.group;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      mbar_wait(&empty[stage], phase ^ 1);
      uint8_t* a = smem + stage * kStageBytes;
      uint8_t* b = a + kOperandBytes;
      mbar_expect_tx(&full[stage], kStageBytes);
      const int r = kb * kBlockK;  // reduction offset
      if constexpr (kKind == GemmKind::kFprop) {
        tma_load_3d(a, &args.a_map, &full[stage], r, tile.row0, 0);
        tma_load_3d(b, w_map, &full[stage], r, tile.col0, w_group);
      } else if constexpr (kKind == GemmKind::kDgrad) {
        tma_load_3d(a, &args.a_map, &full[stage], r, tile.row0, 0);
        for (int h = 0; h < 2; ++h) {
          tma_load_3d(b + h * kHalfTileBytes, w_map, &full[stage], tile.col0 + 64 * h, r, w_group);
        }
      } else {
        const int row = t.start[tile.group] + r;
        for (int h = 0; h < 2; ++h) {
          tma_load_3d(a + h * kHalfTileBytes, &args.a_map, &full[stage], tile.row0 + 64 * h, row,
                      0);
          tma_load_3d(b + h * kHalfTileBytes, &args.b_map, &full[stage], tile.col0 + 64 * h, row,
                      0);
        }
      }
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  });
}

template <GemmKind kKind, typename T, typename OutT>
__device__ void consume(const KernelArgs& args, const GroupTable& t, uint8_t* smem, uint64_t* full,
                        uint64_t* empty, int consumer) {
  constexpr int kTransA = kKind == GemmKind::kWgrad ? 1 : 0;
  constexpr int kTransB = kKind == GemmKind::kFprop ? 0 : 1;
  // Per-k16 start-address steps and the LBO/SBO of each operand (see the file comment).
  constexpr uint32_t kStepA = kTransA ? 2048 : 32, kStepB = kTransB ? 2048 : 32;
  const Sm90GemmParams& p = args.p;
  const int thread = threadIdx.x % 128, warp = thread / kWarpSize, lane = thread % kWarpSize;
  int stage = 0;
  uint32_t phase = 0;
  float acc[64];

  for_each_tile<kKind>(p, t, [&](const Tile& tile) {
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    int previous = -1;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      mbar_wait(&full[stage], phase);
      uint8_t* a = smem + stage * kStageBytes;
      uint8_t* b = a + kOperandBytes;
      if constexpr (kKind == GemmKind::kWgrad) {
        // The last block of a group reads rows of the next group (or padding): zero them in all
        // four boxes, then make the generic-proxy stores visible to wgmma (async proxy).
        const int valid = min(kBlockK, tile.reduction_rows - kb * kBlockK);
        if (valid < kBlockK) {
          const int chunks = (kBlockK - valid) * 8;  // 16-byte chunks per box
          for (int i = threadIdx.x - 128; i < 4 * chunks; i += 256) {
            const int box = i / chunks, rem = i % chunks;
            *reinterpret_cast<uint4*>(a + box * kHalfTileBytes + (valid + rem / 8) * 128 +
                                      (rem % 8) * 16) = make_uint4(0, 0, 0, 0);
          }
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          asm volatile("bar.sync 1, 256;" ::: "memory");
        }
      }
      // This warpgroup's 64 rows start 8 KB in for both layouts: 64 K-major rows of 128 B, or the
      // second 64-row MN-major box.
      const uint8_t* a_tile = a + consumer * kHalfTileBytes;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t da = kTransA ? smem_desc(a_tile + kk * kStepA, kHalfTileBytes, 1024)
                                    : smem_desc(a_tile + kk * kStepA, 16, 1024);
        const uint64_t db = kTransB ? smem_desc(b + kk * kStepB, kHalfTileBytes, 1024)
                                    : smem_desc(b + kk * kStepB, 16, 1024);
        wgmma_m64n128k16<T, kTransA, kTransB>(acc, da, db);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous block's wgmma are done: its slot can be refilled
      if (previous >= 0 && lane == 0) mbar_arrive(&empty[previous]);
      previous = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    if (previous >= 0 && lane == 0) mbar_arrive(&empty[previous]);

    // Epilogue. Accumulator layout of m64nN: warp w holds rows 16w..16w+15; lane l holds rows
    // l/4 and l/4 + 8 of those, columns 8j + 2(l%4) + {0, 1} in registers 4j + {0, 1} / {2, 3}.
    OutT* out;
    int64_t out_cols;
    const T* bias = nullptr;
    if constexpr (kKind == GemmKind::kWgrad) {
      if (tile.k_blocks == 0 && p.accumulate) return;  // empty group: main-grad left untouched
      out = const_cast<OutT*>(group_ptr<OutT>(p.weight_grad, tile.group)) +
            static_cast<int64_t>(tile.row0) * p.k;
      out_cols = p.k;
    } else {
      out_cols = kKind == GemmKind::kFprop ? p.n : p.k;
      out = static_cast<OutT*>(p.output) + static_cast<int64_t>(tile.row0) * out_cols;
      if constexpr (kKind == GemmKind::kFprop) {
        if (p.bias.base != nullptr || p.bias.table != nullptr)
          bias = group_ptr<T>(p.bias, tile.group);
      }
    }
    const int row_in_tile = consumer * 64 + warp * 16 + lane / 4;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int64_t col = tile.col0 + j * 8 + (lane % 4) * 2;
      if (col >= out_cols) continue;  // out_cols is a multiple of 8, so col + 1 is in range too
      float b0 = 0.0f, b1 = 0.0f;
      if (bias != nullptr) {
        b0 = to_float(bias[col]);
        b1 = to_float(bias[col + 1]);
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = row_in_tile + half * 8;
        if (r >= tile.valid_rows) continue;
        OutT* dst = out + static_cast<int64_t>(r) * out_cols + col;
        float v0 = acc[4 * j + 2 * half] + b0, v1 = acc[4 * j + 2 * half + 1] + b1;
        if constexpr (std::is_same_v<OutT, float>) {
          if (kKind == GemmKind::kWgrad && p.accumulate) {
            const float2 old = *reinterpret_cast<const float2*>(dst);
            v0 += old.x;
            v1 += old.y;
          }
        }
        store2(dst, v0, v1);
      }
    }
  });
}

template <GemmKind kKind, typename T, typename OutT>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ KernelArgs args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  __shared__ int group_start[kSm90MaxGroups], group_count[kSm90MaxGroups],
      group_tiles[kSm90MaxGroups + 1];
  // 128-byte swizzle atoms must start on 1024-byte boundaries.
  uint8_t* smem = smem_raw + ((1024 - smem_u32(smem_raw) % 1024) % 1024);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const GroupTable table{group_start, group_count, group_tiles};

  if (threadIdx.x < kWarpSize) build_group_table<kKind>(args.p, table);
  if (threadIdx.x == kWarpSize) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    if (threadIdx.x == 0) produce<kKind>(args, table, smem, full, empty);
  } else {
    consume<kKind, T, OutT>(args, table, smem, full, empty, threadIdx.x / 128 - 1);
  }
#else
  __trap();  // this library was built without sm_90a code, and the host side checks for it
#endif
}

// ---- column sums (bias gradient) -----------------------------------------------------------

constexpr int kSumColumnPairs = 32, kSumRowSlices = 8;

template <typename T>
__global__ void grouped_column_sum_kernel(const GroupedColumnSumParams p) {
  __shared__ int64_t group_start;
  __shared__ float partial[kSumRowSlices][kSumColumnPairs][2];
  const int g = blockIdx.y;
  if (threadIdx.y == 0) {
    int64_t sum = 0;
    for (int h = threadIdx.x; h < g; h += kWarpSize) sum += split_at(p.m_splits, p.splits_int32, h);
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) group_start = sum;
  }
  __syncthreads();
  const int64_t begin = min(group_start, p.rows);
  const int64_t count = min(split_at(p.m_splits, p.splits_int32, g), p.rows - begin);
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kSumColumnPairs + threadIdx.x) * 2;
  const T* dy = static_cast<const T*>(p.grad_output);
  float s0 = 0.0f, s1 = 0.0f;
  if (col < p.n) {
    for (int64_t r = threadIdx.y; r < count; r += kSumRowSlices) {
      const T* src = dy + (begin + r) * p.n + col;
      s0 += to_float(src[0]);
      s1 += to_float(src[1]);
    }
  }
  partial[threadIdx.y][threadIdx.x][0] = s0;
  partial[threadIdx.y][threadIdx.x][1] = s1;
  __syncthreads();
  if (threadIdx.y == 0 && col < p.n) {
    for (int s = 1; s < kSumRowSlices; ++s) {  // fixed order: deterministic
      s0 += partial[s][threadIdx.x][0];
      s1 += partial[s][threadIdx.x][1];
    }
    T* out = const_cast<T*>(group_ptr<T>(p.bias_grad, g)) + col;
    store2(out, s0, s1);
  }
}

// ---- host side -----------------------------------------------------------------------------

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    TORCHMOE_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                         cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "torchmoe sm90 grouped GEMM: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

CUtensorMapDataType map_type(ScalarType type) {
  return type == ScalarType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                       : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// A row-major [groups, rows, inner] tensor (groups = 1 for a matrix), read in boxes of
// {box_inner, box_rows, 1} with 128-byte swizzling; out-of-range elements read as zero.
CUtensorMap encode_map(ScalarType type, const void* base, int64_t inner, int64_t rows,
                       int64_t groups, int64_t group_stride, int box_inner, int box_rows) {
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(base) % 16 == 0 && inner % 8 == 0,
                        "sm90 grouped GEMM: operands must be 16-byte aligned");
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(inner) * 2,
                                 static_cast<cuuint64_t>(group_stride) * 2};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(box_inner), static_cast<cuuint32_t>(box_rows),
                             1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status = tensor_map_encoder()(
      &map, map_type(type), 3, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(status == CUDA_SUCCESS, "sm90 grouped GEMM: cuTensorMapEncodeTiled failed (CUresult ",
              static_cast<int>(status), ") for a [", groups, ", ", rows, ", ", inner, "] tensor");
  return map;
}

// The weight box: K-major {64 k, 128 n} for fprop, MN-major {64 k, 64 n} for dgrad.
int weight_box_rows(GemmKind kind) { return kind == GemmKind::kFprop ? kBlockN : 64; }

constexpr int kMaxDevices = 64;

template <GemmKind kKind, typename T, typename OutT>
void launch(const Sm90GemmParams& p, cudaStream_t stream) {
  auto* kernel = grouped_gemm_sm90_kernel<kKind, T, OutT>;
  // The shared-memory opt-in is per device.
  static std::once_flag configured[kMaxDevices];
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));
  TORCH_CHECK(device < kMaxDevices, "sm90 grouped GEMM: device index ", device, " out of range");
  std::call_once(configured[device], [&] {
    TORCHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(kSharedBytes)));
  });
  KernelArgs args;
  std::memset(&args, 0, sizeof(args));
  args.p = p;
  if constexpr (kKind == GemmKind::kFprop) {
    args.a_map = encode_map(p.input_type, p.input, p.k, p.rows, 1, 0, kBlockK, kBlockM);
  } else if constexpr (kKind == GemmKind::kDgrad) {
    args.a_map = encode_map(p.input_type, p.grad_output, p.n, p.rows, 1, 0, kBlockK, kBlockM);
  } else {
    args.a_map = encode_map(p.input_type, p.grad_output, p.n, p.rows, 1, 0, 64, kBlockK);
    args.b_map = encode_map(p.input_type, p.input, p.k, p.rows, 1, 0, 64, kBlockK);
  }
  if constexpr (kKind != GemmKind::kWgrad) {
    if (p.weight_maps == nullptr) {
      args.b_map = encode_map(p.input_type, p.weight.base, p.k, p.n, p.num_groups,
                              p.weight.group_stride, 64, weight_box_rows(kKind));
    }
  }
  kernel<<<sm_count(), kThreads, kSharedBytes, stream>>>(args);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool sm90_grouped_gemm_available() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // no usable device: not an error for a capability query
    return false;
  }
  if (device >= kMaxDevices) return false;
  // Asked before every grouped GEMM: the answer per device is computed once.
  static std::once_flag checked[kMaxDevices];
  static bool available[kMaxDevices] = {};
  std::call_once(checked[device], [&] {
    int major = 0, minor = 0;
    TORCHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TORCHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major != 9 || minor != 0) return;
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(
            &attributes,
            grouped_gemm_sm90_kernel<GemmKind::kFprop, __nv_bfloat16, __nv_bfloat16>) !=
        cudaSuccess) {
      (void)cudaGetLastError();  // no sm_90a image in this build (not a sticky error)
      return;
    }
    available[device] = true;
  });
  return available[device];
}

std::vector<uint8_t> encode_weight_maps(GemmKind kind, ScalarType input_type, int64_t n, int64_t k,
                                        const std::vector<const void*>& weights) {
  TORCH_INTERNAL_ASSERT(kind != GemmKind::kWgrad, "encode_weight_maps: fprop or dgrad only");
  std::vector<uint8_t> bytes(weights.size() * sizeof(CUtensorMap));
  for (size_t g = 0; g < weights.size(); ++g) {
    const CUtensorMap map =
        encode_map(input_type, weights[g], k, n, 1, n * k, 64, weight_box_rows(kind));
    std::memcpy(bytes.data() + g * sizeof(CUtensorMap), &map, sizeof(CUtensorMap));
  }
  return bytes;
}

void launch_grouped_gemm_sm90(const Sm90GemmParams& p, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(p.num_groups > 0 && p.num_groups <= kSm90MaxGroups && p.rows > 0 &&
                            p.rows <= INT_MAX && p.n % kSm90FeatureMultiple == 0 &&
                            p.k % kSm90FeatureMultiple == 0,
                        "launch_grouped_gemm_sm90: unchecked arguments");
  const bool bf16 = p.input_type == ScalarType::kBFloat16;
  TORCH_INTERNAL_ASSERT(bf16 || p.input_type == ScalarType::kFloat16);
  auto with_type = [&](auto tag) {
    using T = decltype(tag);
    switch (p.kind) {
      case GemmKind::kFprop:
        return launch<GemmKind::kFprop, T, T>(p, stream);
      case GemmKind::kDgrad:
        return launch<GemmKind::kDgrad, T, T>(p, stream);
      case GemmKind::kWgrad:
        if (p.output_type == ScalarType::kFloat32)
          return launch<GemmKind::kWgrad, T, float>(p, stream);
        TORCH_INTERNAL_ASSERT(p.output_type == p.input_type && !p.accumulate);
        return launch<GemmKind::kWgrad, T, T>(p, stream);
    }
  };
  bf16 ? with_type(__nv_bfloat16{}) : with_type(__half{});
}

void launch_grouped_column_sum(const GroupedColumnSumParams& p, cudaStream_t stream) {
  if (p.num_groups == 0 || p.n == 0) return;
  TORCH_INTERNAL_ASSERT(p.n % 2 == 0, "launch_grouped_column_sum: n must be even");
  const dim3 block(kSumColumnPairs, kSumRowSlices);
  const dim3 grid(static_cast<unsigned>((p.n + 2 * kSumColumnPairs - 1) / (2 * kSumColumnPairs)),
                  static_cast<unsigned>(p.num_groups));
  dispatch_type(p.type, [&](auto tag) {
    using T = decltype(tag);
    grouped_column_sum_kernel<T><<<grid, block, 0, stream>>>(p);
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
