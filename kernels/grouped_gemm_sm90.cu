// One-launch grouped GEMM for sm_90a; see grouped_gemm_sm90.h for the problem and the contract.
//
// Block: 3 warpgroups. Warpgroup 0 is the producer (one thread issues TMA; it gives registers
// away with setmaxnreg); warpgroups 1 and 2 are consumers, each owning 64 rows of the 128 × 256
// output tile and issuing m64n256k16 wgmma into 128 fp32 accumulator registers per thread.
// 128 × 256 tiles read 48 KB of shared memory per 2·128·256·64 FLOPs, a third less per FLOP
// than 128 × 128 tiles; that keeps the tensor cores, not shared memory or L2, the limit.
//
// Shared memory (221 KiB of 227 for every kind, see Smem): slots of (A 16 KB | B 32 KB),
// 128-byte swizzled, one "full" and one "empty" mbarrier per slot; one epilogue buffer per
// consumer; the group table. fprop/dgrad: 4 slots and 8 KB buffers; wgrad: 3 slots and 32 KB.
// Operands come in 64 × 64 boxes (8 KB) or one larger K-major box:
//
//   K-major operand (x in fprop, dy in dgrad, W in fprop): one TMA box {64 reduction, 128 or 256
//     rows}, row r at r·128 B: 8-row core groups 1024 B apart (SBO); k16 steps move the start
//     by 32 B.
//   MN-major operand (W in dgrad, dy and x in wgrad): 2 or 4 boxes {64 rows, 64 reduction}, 8 KB
//     apart (LBO); reduction step j at j·128 B, 8-step groups 1024 B apart (SBO); k16 steps move
//     the start by 2048 B. wgmma reads it with the transpose bit set.
//
// Epilogue: each consumer writes its 64 × 256 result into its buffer in boxes of 64 rows × 64
// bytes (64-byte swizzle: the 8 rows a warp writes at once land in distinct banks), then one
// thread issues a TMA store per box (a TMA add for fp32 accumulation), in rounds of as many
// boxes as the buffer holds. The last round's stores drain while the next tile's main loop
// runs; a buffer is rewritten only once they have read it. The trade between pipeline stages
// and buffer size differs by kind (docs/performance.md): wgrad keeps a whole-tile buffer and 3
// stages, because its fp32 tiles with 4 stages and small buffers spent 10-15% waiting on their
// own stores (v2 -> v3); fprop/dgrad take the fourth stage and store in four rounds: +4-9% on
// small experts (v6). Tiles whose rows end inside the tile (a group's last row tile: the next
// group's rows follow) and outputs no tensor map describes are stored from registers with row
// masks instead.
//
// The persistent grid walks a global tile list, group after group: round-robin for fprop and
// dgrad, claimed from a global counter for wgrad (take_tiles); each block's producer passes its
// tile indices to its consumers. Per-group row offsets and tile counts are computed once per block
// from the device split sizes.

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
constexpr int kBlockM = 128, kBlockN = 256, kBlockK = 64;
constexpr int kBoxBytes = 64 * 128;                  // one 64 × 64 box: 8 KB
constexpr int kABytes = (kBlockM / 64) * kBoxBytes;  // 16 KB
constexpr int kBBytes = (kBlockN / 64) * kBoxBytes;  // 32 KB
constexpr int kStageBytes = kABytes + kBBytes;       // A | B
constexpr int kConsumerWarps = 8;                    // the empty barriers' arrivals
// Epilogue boxes: 64 rows × 64 bytes (a 64 × 256 tile of 16-bit values is 8 of them).
constexpr int kEpilogueRowBytes = 64, kEpilogueBoxBytes = 64 * kEpilogueRowBytes;  // 4 KB
// Tile indices pass from the producer to the consumers through a ring (see take_tiles). The
// producer runs at most a few reduction blocks ahead, i.e. a few tiles when they have one each.
constexpr int kTileSlots = 4;
// Shared memory by kind (see the file comment): wgrad, 3 stages and a whole-tile epilogue buffer
// per consumer; fprop/dgrad (16-bit output), 4 stages and a quarter-tile buffer, four rounds.
template <GemmKind kKind>
struct Smem {
  static constexpr int kStages = kKind == GemmKind::kWgrad ? 3 : 4;
  static constexpr int kEpilogueBoxes = kKind == GemmKind::kWgrad ? 8 : 2;
  static constexpr int kEpilogueBytes = kEpilogueBoxes * kEpilogueBoxBytes;  // per consumer
  static constexpr size_t kBytes = kStages * kStageBytes + 2 * kEpilogueBytes +
                                   2 * (kStages + kTileSlots) * sizeof(uint64_t) +
                                   kTileSlots * sizeof(int) + 1024;  // + alignment slack
};
// Registers: the producer needs few, the consumers' 128 accumulators need many (64K per SM).
constexpr int kProducerRegisters = 40, kConsumerRegisters = 232;
static_assert(128 * kProducerRegisters + 256 * kConsumerRegisters <= 65536);
// Dynamic plus the static group table (3 int arrays) within the 227 KB a block may use.
static_assert(Smem<GemmKind::kFprop>::kBytes + (3 * kSm90MaxGroups + 1) * sizeof(int) <=
              227 * 1024);
static_assert(Smem<GemmKind::kWgrad>::kBytes + (3 * kSm90MaxGroups + 1) * sizeof(int) <=
              227 * 1024);

// Everything a launch passes by value; the tensor maps must live in parameter (or global) memory.
struct KernelArgs {
  CUtensorMap a_map;    // fprop: x; dgrad: dy; wgrad: dy (MN-major)
  CUtensorMap b_map;    // fprop/dgrad: equally spaced weights (3-D); wgrad: x (MN-major)
  CUtensorMap out_map;  // y / dx [1, rows, cols] or equally spaced dW [G, n, k]; see out_tma
  bool out_tma;         // out_map is valid (else every tile is stored from registers)
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

// d[64 × 256] += A[64 × 16] · B[256 × 16]ᵀ, both from shared memory; kTransA / kTransB select the
// MN-major layouts.
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a,
                                                 uint64_t desc_b) {
#define TORCHMOE_WGMMA(TYPE)                                                                       \
  asm volatile(                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                              \
      " wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE                                \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "      \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "      \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "      \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "      \
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "      \
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, "        \
      "%103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "       \
      "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},"                         \
      " %128, %129, p, 1, 1, %131, %132;\n}"                                                       \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), \
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), \
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), \
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),          \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),        \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),        \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),        \
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])         \
      : "l"(desc_a), "l"(desc_b), "r"(1), "n"(kTransA), "n"(kTransB))
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    TORCHMOE_WGMMA("bf16");
  } else {
    TORCHMOE_WGMMA("f16");
  }
#undef TORCHMOE_WGMMA
}

// TMA store (or element-wise add, for fp32 accumulation) of a shared-memory box into a 3-D
// tensor map; tracked per issuing thread as one bulk async-group per commit.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0,
                                             int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_add_3d(const CUtensorMap* map, const void* src, int c0, int c1,
                                           int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], "
      "[%1];" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until at most kPending of this thread's bulk groups are still reading shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Generic-proxy shared-memory writes become visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
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

// A group's output is a grid of row tiles × column tiles, walked in panels of up to kPanelRows
// row tiles: down a panel's rows first, then across its columns, then the next panel.
// Consecutive tiles run at the same time on neighbouring blocks, so a wave of ~132 tiles covers
// about 16 row tiles × 8 column tiles (128 and 256 wide): close to square in operand bytes, which
// minimises what one wave reads. Outputs of at most kPanelRows row tiles (most fprop/dgrad
// groups) are walked rows first; tall ones (fc1's wgrad, dW[28672, 4096] on mixtral) no longer
// put 132 row tiles of dy into one wave.
constexpr int kPanelRows = 16;

template <GemmKind kKind>
__device__ __forceinline__ Tile tile_at(const Sm90GemmParams& p, const GroupTable& t, int g,
                                        int index) {
  const int local = index - t.tiles[g];
  const int64_t out_rows = kKind == GemmKind::kWgrad ? p.n : t.count[g];
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
    tile.reduction_rows = t.count[g];
    tile.k_blocks = (t.count[g] + kBlockK - 1) / kBlockK;
  } else {
    tile.row0 = t.start[g] + m * kBlockM;
    const int64_t reduction = kKind == GemmKind::kFprop ? p.k : p.n;
    tile.k_blocks = static_cast<int>((reduction + kBlockK - 1) / kBlockK);
    tile.reduction_rows = 0;
  }
  return tile;
}

// A block's first tile is blockIdx.x. fprop and dgrad tiles all reduce over the same length, so
// the next one is gridDim.x further on (a fixed round-robin). wgrad tiles reduce over their
// group's rows: with skewed splits, round-robin left the blocks that drew the big groups' tiles
// working while the others idled (modelled on the benchmark's qwen3 splits: 13-16% over an even
// share), so wgrad blocks claim the lowest index nobody has taken from a global counter that the
// launcher zeroes (modelled: 0-1%; measured +20% on qwen3 skewed wgrad). fprop and dgrad skip the
// counter: claiming measured the same there, and zeroing it costs a memset per call. Blocks take
// neighbouring indices at about the same time either way, so the panel order keeps its L2 reuse.
//
// The producer thread decides (claiming one index ahead, so the atomic's latency overlaps the
// current tile's loads) and passes each index to the consumers through kTileSlots shared-memory
// slots with full/empty mbarriers, as it passes operands; an index past the last tile ends both
// loops.
struct TileRing {
  int* index;       // [kTileSlots]
  uint64_t* full;   // [kTileSlots]: one arrival, the producer's
  uint64_t* empty;  // [kTileSlots]: one arrival per consumer warp
};

template <GemmKind kKind, typename Fn>
__device__ __forceinline__ void take_tiles(const Sm90GemmParams& p, const GroupTable& t,
                                           const TileRing& ring, Fn&& fn) {
  const int total = t.tiles[p.num_groups];
  int slot = 0, g = 0;
  uint32_t phase = 0;
  for (int index = blockIdx.x;;) {
    int next;
    if constexpr (kKind == GemmKind::kWgrad) {
      next = index < total ? static_cast<int>(gridDim.x) + atomicAdd(p.tile_counter, 1) : total;
    } else {
      next = index + static_cast<int>(gridDim.x);
    }
    mbar_wait(&ring.empty[slot], phase ^ 1);
    ring.index[slot] = index;
    mbar_arrive(&ring.full[slot]);
    if (++slot == kTileSlots) {
      slot = 0;
      phase ^= 1;
    }
    if (index >= total) return;
    while (index >= t.tiles[g + 1]) ++g;  // a block's indices only grow
    fn(tile_at<kKind>(p, t, g, index));
    index = next;
  }
}

template <GemmKind kKind, typename Fn>
__device__ __forceinline__ void taken_tiles(const Sm90GemmParams& p, const GroupTable& t,
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
    fn(tile_at<kKind>(p, t, g, index));
  }
}

template <GemmKind kKind>
__device__ void produce(const KernelArgs& args, const GroupTable& t, const TileRing& ring,
                        uint8_t* smem, uint64_t* full, uint64_t* empty) {
  const Sm90GemmParams& p = args.p;
  int stage = 0;
  uint32_t phase = 0;
  take_tiles<kKind>(p, t, ring, [&](const Tile& tile) {
    const CUtensorMap* w_map = p.weight_maps != nullptr
                                   ? static_cast<const CUtensorMap*>(p.weight_maps) + tile.group
                                   : &args.b_map;
    const int w_group = p.weight_maps != nullptr ? 0 : tile.group;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      mbar_wait(&empty[stage], phase ^ 1);
      uint8_t* a = smem + stage * kStageBytes;
      uint8_t* b = a + kABytes;
      mbar_expect_tx(&full[stage], kStageBytes);
      const int r = kb * kBlockK;  // reduction offset
      if constexpr (kKind == GemmKind::kFprop) {
        tma_load_3d(a, &args.a_map, &full[stage], r, tile.row0, 0);
        tma_load_3d(b, w_map, &full[stage], r, tile.col0, w_group);
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
        for (int h = 0; h < kBlockN / 64; ++h) {
          tma_load_3d(b + h * kBoxBytes, &args.b_map, &full[stage], tile.col0 + 64 * h, row, 0);
        }
      }
      if (++stage == Smem<kKind>::kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  });
}

// Where an output tile goes and what is added to it (see Tile).
template <typename T, typename OutT>
struct TileOutput {
  OutT* out;         // row 0, column 0 of the tile's matrix (y / dx, or dW_g)
  int64_t cols;      // the matrix's columns (its row stride)
  const T* bias;     // fprop: b_g, else null
  int map_group;     // the tile's group in out_map's coordinates (its rows: Tile::row0)
  int64_t map_rows;  // out_map's rows: boxes starting past them are not issued
};

// The bias of output columns col and col + 1 (zeros without a bias or past the last column).
template <typename T, typename OutT>
__device__ __forceinline__ float2 bias_pair(const TileOutput<T, OutT>& o, int64_t col) {
  if (o.bias == nullptr || col >= o.cols) return make_float2(0.0f, 0.0f);
  return make_float2(to_float(o.bias[col]), to_float(o.bias[col + 1]));
}

// Stores this warpgroup's 64 × 256 accumulators through its shared-memory buffer of
// kEpilogueBoxes boxes and TMA: the boxes of a round are written, then one thread issues their
// stores (16 boxes for fp32, 8 for 16-bit outputs, in as many rounds as the buffer needs). A
// round waits until the previous round's stores have read the buffer; the last round's drain
// during the next tile's main loop.
template <int kEpilogueBoxes, typename T, typename OutT>
__device__ __forceinline__ void store_tile_tma(const KernelArgs& args, const TileOutput<T, OutT>& o,
                                               const Tile& tile, const float (&acc)[128],
                                               uint8_t* buffer, int consumer) {
  constexpr int kChunkCols = kEpilogueRowBytes / static_cast<int>(sizeof(OutT));  // 32 or 16
  constexpr int kBlocksPerChunk = kChunkCols / 8;  // 8-column accumulator blocks
  constexpr int kRounds = kBlockN / kChunkCols / kEpilogueBoxes;
  const bool add = std::is_same_v<OutT, float> && args.p.accumulate;
  const int thread = threadIdx.x % 128, warp = thread / kWarpSize, lane = thread % kWarpSize;
  const int barrier = 2 + consumer;  // 0: __syncthreads, 1: both consumers (wgrad masking)
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    if (thread == 0) bulk_wait_read<0>();  // earlier stores from this buffer are done reading
    named_barrier(barrier, 128);
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
          // 64-byte swizzle: 16-byte unit u of row r sits at unit u ^ ((r / 2) % 4).
          const int unit = (byte / 16) ^ ((r / 2) % 4);
          store2(reinterpret_cast<OutT*>(box_base + r * kEpilogueRowBytes + unit * 16 + byte % 16),
                 acc[4 * j + 2 * half] + bias.x, acc[4 * j + 2 * half + 1] + bias.y);
        }
      }
    }
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

// Stores this warpgroup's accumulators straight from registers, masking rows past the tile's
// valid rows (fp32 accumulation: read, add, write).
template <typename T, typename OutT>
__device__ __forceinline__ void store_tile_direct(const Sm90GemmParams& p,
                                                  const TileOutput<T, OutT>& o, const Tile& tile,
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
      float v0 = acc[4 * j + 2 * half] + bias.x, v1 = acc[4 * j + 2 * half + 1] + bias.y;
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

template <GemmKind kKind, typename T, typename OutT>
__device__ void consume(const KernelArgs& args, const GroupTable& t, const TileRing& ring,
                        uint8_t* smem, uint64_t* full, uint64_t* empty, uint8_t* epilogue,
                        int consumer) {
  constexpr int kTransA = kKind == GemmKind::kWgrad ? 1 : 0;
  constexpr int kTransB = kKind == GemmKind::kFprop ? 0 : 1;
  // Per-k16 start-address steps and the LBO/SBO of each operand (see the file comment).
  constexpr uint32_t kStepA = kTransA ? 2048 : 32, kStepB = kTransB ? 2048 : 32;
  const Sm90GemmParams& p = args.p;
  const int thread = threadIdx.x % 128, lane = thread % kWarpSize;
  uint8_t* buffer = epilogue + consumer * Smem<kKind>::kEpilogueBytes;
  int stage = 0;
  uint32_t phase = 0;
  float acc[128];

  taken_tiles<kKind>(p, t, ring, [&](const Tile& tile) {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.0f;
    int previous = -1;
    for (int kb = 0; kb < tile.k_blocks; ++kb) {
      mbar_wait(&full[stage], phase);
      uint8_t* a = smem + stage * kStageBytes;
      uint8_t* b = a + kABytes;
      if constexpr (kKind == GemmKind::kWgrad) {
        // The last block of a group reads rows of the next group (or padding): zero them in all
        // six boxes (A and B are adjacent), then make the generic-proxy stores visible to wgmma.
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
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        const uint64_t da = kTransA ? smem_desc(a_tile + kk * kStepA, kBoxBytes, 1024)
                                    : smem_desc(a_tile + kk * kStepA, 16, 1024);
        const uint64_t db = kTransB ? smem_desc(b + kk * kStepB, kBoxBytes, 1024)
                                    : smem_desc(b + kk * kStepB, 16, 1024);
        wgmma_m64n256k16<T, kTransA, kTransB>(acc, da, db);
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

    TileOutput<T, OutT> o{};
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
          o.bias = group_ptr<T>(p.bias, tile.group);
      }
      o.map_group = 0;
      o.map_rows = p.rows;
      // A TMA store would write whole 64-row boxes: rows of the next group must not be touched.
      tma = tma && tile.valid_rows >= (consumer + 1) * 64;
    }
    if (tma) {
      store_tile_tma<Smem<kKind>::kEpilogueBoxes, T, OutT>(args, o, tile, acc, buffer, consumer);
    } else {
      store_tile_direct<T, OutT>(p, o, tile, acc, consumer);
    }
  });
  // Shared memory must outlive the stores still reading it.
  if (thread == 0) bulk_wait_all();
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
  constexpr int kStages = Smem<kKind>::kStages;
  uint8_t* epilogue = smem + kStages * kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(epilogue + 2 * Smem<kKind>::kEpilogueBytes);
  uint64_t* empty = full + kStages;
  uint64_t* tile_full = empty + kStages;
  uint64_t* tile_empty = tile_full + kTileSlots;
  const TileRing ring{reinterpret_cast<int*>(tile_empty + kTileSlots), tile_full, tile_empty};
  const GroupTable table{group_start, group_count, group_tiles};

  if (threadIdx.x < kWarpSize) build_group_table<kKind>(args.p, table);
  if (threadIdx.x == kWarpSize) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    for (int s = 0; s < kTileSlots; ++s) {
      mbar_init(&ring.full[s], 1);
      mbar_init(&ring.empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async();
  }
  __syncthreads();

  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegisters));
    if (threadIdx.x == 0) produce<kKind>(args, table, ring, smem, full, empty);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegisters));
    consume<kKind, T, OutT>(args, table, ring, smem, full, empty, epilogue, threadIdx.x / 128 - 1);
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

// A driver entry point, resolved once through the runtime (the library never links libcuda).
void* driver_entry_point(const char* name, int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  TORCHMOE_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found));
  TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
              "torchmoe sm90 grouped GEMM: the CUDA driver has no ", name);
  return fn;
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(
      driver_entry_point("cuTensorMapEncodeTiled", 12000));
  return encode;
}

// cuTensorMapEncodeTiled needs a current context (else CUresult 201). The runtime binds the
// device's primary context to a thread lazily, on the first call that needs one, so a thread that
// so far made none (a new std::thread or an autograd worker whose tensors came from the caching
// allocator) has none yet; cudaSetDevice binds it.
void bind_current_context() {
  static const auto get_current =
      reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(driver_entry_point("cuCtxGetCurrent", 4000));
  CUcontext context = nullptr;
  TORCH_CHECK(get_current(&context) == CUDA_SUCCESS, "sm90 grouped GEMM: cuCtxGetCurrent failed");
  if (context != nullptr) return;
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));
  TORCHMOE_CUDA_CHECK(cudaSetDevice(device));
}

CUtensorMapDataType map_type(ScalarType type) {
  switch (type) {
    case ScalarType::kBFloat16:
      return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case ScalarType::kFloat16:
      return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case ScalarType::kFloat32:
      return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  }
  TORCH_INTERNAL_ASSERT(false, "sm90 grouped GEMM: unknown element type");
}

// Operand boxes are 128 bytes wide (128-byte swizzle, as wgmma reads them); epilogue boxes are
// 64 bytes wide (64-byte swizzle, as the consumers write them).
struct MapBox {
  int inner, rows;
  CUtensorMapSwizzle swizzle;
};

MapBox operand_box(int rows) { return {64, rows, CU_TENSOR_MAP_SWIZZLE_128B}; }

MapBox output_box(ScalarType type) {
  return {kEpilogueRowBytes / static_cast<int>(element_size(type)), 64, CU_TENSOR_MAP_SWIZZLE_64B};
}

// A row-major [groups, rows, inner] tensor (groups = 1 for a matrix) in boxes of
// {box.inner, box.rows, 1}; out-of-range elements read as zero and are not written.
CUtensorMap encode_map(ScalarType type, const void* base, int64_t inner, int64_t rows,
                       int64_t groups, int64_t group_stride, MapBox box) {
  const auto bytes = static_cast<int64_t>(element_size(type));
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(base) % 16 == 0 && inner * bytes % 16 == 0 &&
                            group_stride * bytes % 16 == 0,
                        "sm90 grouped GEMM: tensors must be 16-byte aligned");
  bind_current_context();
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(inner * bytes),
                                 static_cast<cuuint64_t>(group_stride * bytes)};
  const cuuint32_t box_dims[3] = {static_cast<cuuint32_t>(box.inner),
                                  static_cast<cuuint32_t>(box.rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status =
      tensor_map_encoder()(&map, map_type(type), 3, const_cast<void*>(base), dims, strides,
                           box_dims, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, box.swizzle,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(status == CUDA_SUCCESS, "sm90 grouped GEMM: cuTensorMapEncodeTiled failed (CUresult ",
              static_cast<int>(status), ") for a [", groups, ", ", rows, ", ", inner, "] tensor");
  return map;
}

// The weight box: K-major {64 k, 256 n} for fprop, MN-major {64 k, 64 n} for dgrad.
MapBox weight_box(GemmKind kind) { return operand_box(kind == GemmKind::kFprop ? kBlockN : 64); }

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
                                             static_cast<int>(Smem<kKind>::kBytes)));
  });
  KernelArgs args;
  std::memset(&args, 0, sizeof(args));
  args.p = p;
  const ScalarType in = p.input_type;
  if constexpr (kKind == GemmKind::kFprop) {
    args.a_map = encode_map(in, p.input, p.k, p.rows, 1, 0, operand_box(kBlockM));
    args.out_map = encode_map(in, p.output, p.n, p.rows, 1, 0, output_box(in));
    args.out_tma = true;
  } else if constexpr (kKind == GemmKind::kDgrad) {
    args.a_map = encode_map(in, p.grad_output, p.n, p.rows, 1, 0, operand_box(kBlockM));
    args.out_map = encode_map(in, p.output, p.k, p.rows, 1, 0, output_box(in));
    args.out_tma = true;
  } else {
    args.a_map = encode_map(in, p.grad_output, p.n, p.rows, 1, 0, operand_box(kBlockK));
    args.b_map = encode_map(in, p.input, p.k, p.rows, 1, 0, operand_box(kBlockK));
    // Equally spaced gradients are one 3-D map; a pointer table's are stored from registers.
    args.out_tma = p.weight_grad.table == nullptr;
    if (args.out_tma) {
      args.out_map = encode_map(p.output_type, p.weight_grad.base, p.k, p.n, p.num_groups,
                                p.weight_grad.group_stride, output_box(p.output_type));
    }
  }
  if constexpr (kKind != GemmKind::kWgrad) {
    if (p.weight_maps == nullptr) {
      args.b_map = encode_map(in, p.weight.base, p.k, p.n, p.num_groups, p.weight.group_stride,
                              weight_box(kKind));
    }
  }
  if constexpr (kKind == GemmKind::kWgrad) {
    TORCHMOE_CUDA_CHECK(cudaMemsetAsync(p.tile_counter, 0, sizeof(int), stream));
  }
  kernel<<<sm_count(), kThreads, Smem<kKind>::kBytes, stream>>>(args);
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
    const CUtensorMap map = encode_map(input_type, weights[g], k, n, 1, n * k, weight_box(kind));
    std::memcpy(bytes.data() + g * sizeof(CUtensorMap), &map, sizeof(CUtensorMap));
  }
  return bytes;
}

void launch_grouped_gemm_sm90(const Sm90GemmParams& p, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT((p.kind != GemmKind::kWgrad || p.tile_counter != nullptr) &&
                            p.num_groups > 0 && p.num_groups <= kSm90MaxGroups && p.rows > 0 &&
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
