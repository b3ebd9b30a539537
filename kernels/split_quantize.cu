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
// registers (V = 16 / sizeof(T); 16 threads per row for 16-bit types, 32 for fp32), so the input
// is read once and never staged (a GLU source: two loads, a and b, and the activation's math give
// the same piece; a GLU gradient source three, a, b and dy, for the pieces of both a and b, as
// its loop says), and works on them as 32-bit words: amaxes of 16-bit inputs stay
// packed (two elements per instruction), casts produce four FP8 bytes per word. Row amaxes are
// shuffles among the threads of a row, column amaxes go through a small shared-memory reduction,
// and each warp maxes its part of a tile into the split's amax (no barrier). The rowwise copy is
// stored from registers (V contiguous bytes per thread and row); the columnwise copy goes through
// a 128×128-byte shared tile, written as one 8-byte chunk of P rows per column (a 4×4 byte
// transpose in registers, or the column cast for 1×128 blocks) and read back as 16-byte row
// segments of the transposed output. The chunks are XOR-swizzled by column so that both the
// column writes (lanes 8 or 4 columns apart) and the row reads (two output rows per half-warp)
// are free of bank conflicts.
//
// kCurrent needs each split's amax before any of its elements can be cast. Each block takes units
// in order from a ticket counter and visits each first for its split's amax, keeping the loaded
// pieces in shared memory (one unit per block, 32 KB for a 16-bit tile) until the split's amax
// is complete, so a tile is usually read from HBM once: the block loads its next unit while the
// kept one's split completes (thread 0 asks while the loads are in flight), then casts the kept
// one, exchanging the two units' pieces. Thread 0 announces each tile's amax with one release
// (a max, then a count per split) after the block's barrier, so one warp, not every warp, waits
// for its earlier stores to be visible. Where the stash's split is one that the stashes can hold
// whole, the block waits for it to complete. A unit that finds the stash still waiting on a larger
// split, or no stash (fp32 pieces: a 64 KB stash would cost a block per SM), is dropped after its
// amax visit and loaded again for its cast: by the same block as soon as its split is complete
// (a few held per block), or once every unit has had its amax visit. An amax visit waits only for
// an earlier split, the casts of held units before that never wait, and a cast waits only for
// visits that running blocks hold: no deadlock whatever is resident. (The earlier scheme, the amax
// visits a split and a wave ahead of separate cast visits, found most second reads in HBM: 61-67%
// of copy.) kCurrent has no GLU gradient source (ops/quantize.h says why), so its units are tiles.

#include "torchmoe/kernels/split_quantize.h"

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/fp8_cast.cuh"
#include "torchmoe/kernels/glu_math.cuh"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTile = static_cast<int>(kQuantizeBlock);
constexpr unsigned kFullMask = 0xffffffffu;
// Three blocks per SM (at most 80 registers; unbounded, ptxas took ~128, two blocks): up to 96 KB
// of 16-bit input loads in flight per SM.
constexpr int kMinBlocks = 3;

// Where each split lives, from the clamped split sizes: G + 1 entries each (entry G: the totals).
struct SplitLayout {
  int64_t* start;   // first row
  int64_t* cstart;  // Σ_{h<g} r16(m_h): where split g's columnwise block starts, in K-element rows
  int32_t* tiles;   // Σ_{h<g} ceil(m_h / 128): row tiles before split g
  int32_t* rows4;   // Σ_{h<g} r4(m_h)
  int32_t* tiles4;  // Σ_{h<g} r4(ceil(m_h / 128))
};

__host__ __device__ size_t layout_bytes(int groups) {
  return static_cast<size_t>(groups + 1) * (2 * sizeof(int64_t) + 3 * sizeof(int32_t));
}

// The stash of a paired GLU gradient source, or kCurrent's (the kernel's loop says why), follows
// the layout in dynamic shared memory: one 16-byte piece per row of each thread, P = 8 rows for
// 16-bit types. With it, the block's 57 KB of shared memory still let three blocks share an SM.
constexpr size_t kStashBytes = size_t{8} * kThreads * 16;
__host__ __device__ size_t stash_offset(int groups) {
  return (layout_bytes(groups) + 15) / 16 * 16;
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

// Max over the block; every thread gets it. `scratch`: kWarps floats. Ends with the block
// synchronized, so scratch may be reused at once.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float m = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

// ---- a thread's 16-byte piece of a row (V elements) as four 32-bit words ----
// 16-bit types hold elements 2w and 2w + 1 in word w (the first in the low half), fp32 one
// element per word. The arithmetic below works on whole words: the amaxes of 16-bit inputs stay
// packed (two elements per instruction) and the casts produce four FP8 bytes per word.

template <typename T>
struct PackedPair {  // 16-bit types
  using Type = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
};

// Running max |x| over words (NaN ignored, as abs_max).
template <typename T>
struct AbsMax {
  using T2 = typename PackedPair<T>::Type;
  T2 m = as_pair(0u);
  __device__ __forceinline__ void add(uint32_t w) { m = __hmax2(m, __habs2(as_pair(w))); }
  __device__ __forceinline__ float value() const {
    const float2 f = to_float2(m);
    return fmaxf(f.x, f.y);
  }
  __device__ __forceinline__ float lo() const { return to_float2(m).x; }
  __device__ __forceinline__ float hi() const { return to_float2(m).y; }

 private:
  __device__ __forceinline__ static T2 as_pair(uint32_t w) { return *reinterpret_cast<T2*>(&w); }
  __device__ __forceinline__ static float2 to_float2(__nv_bfloat162 v) {
    return __bfloat1622float2(v);
  }
  __device__ __forceinline__ static float2 to_float2(__half2 v) { return __half22float2(v); }
};
template <>
struct AbsMax<float> {
  float m = 0.0f;
  __device__ __forceinline__ void add(uint32_t w) { m = abs_max(m, __uint_as_float(w)); }
  __device__ __forceinline__ float value() const { return m; }
};

// Element j of a piece, as fp32.
template <typename T>
__device__ __forceinline__ float element_at(const uint32_t (&w)[4], int j) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(w[j]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // A bf16 is the upper half of the fp32 of the same value.
    return __uint_as_float(j % 2 == 0 ? w[j / 2] << 16 : w[j / 2] & 0xffff0000u);
  } else {
    const __half2 h = *reinterpret_cast<const __half2*>(&w[j / 2]);
    return __half2float(j % 2 == 0 ? __low2half(h) : __high2half(h));
  }
}

// The piece cast with `scale`: V FP8 bytes, four per word, in element order.
template <typename T, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void cast_piece(const uint32_t (&w)[4], float scale,
                                           uint32_t (&out)[16 / sizeof(T) / 4]) {
#pragma unroll
  for (int o = 0; o < 16 / static_cast<int>(sizeof(T)) / 4; ++o) {
    const int j = 4 * o;
    const uint32_t lo = cast2<F>(element_at<T>(w, j) * scale, element_at<T>(w, j + 1) * scale);
    const uint32_t hi = cast2<F>(element_at<T>(w, j + 2) * scale, element_at<T>(w, j + 3) * scale);
    out[o] = __byte_perm(lo, hi, 0x5410);
  }
}

// The 8-byte chunk of output row c (tile column c) that holds tile rows [8·q, 8·q + 8) sits at
// chunk q ^ swizzle(c). Column writes come from lanes V columns apart (c / V distinct), row reads
// from two adjacent columns per half-warp (c & 1 distinct): both spread over all banks.
template <int V>
__device__ __forceinline__ int swizzle(int c) {
  return ((c / V) ^ (c & 1)) & 15;
}

// What a block does with a unit in an iteration (kCurrent's visits; the file's header).
enum class Visit : int {
  kOnly,         // every scaling but kCurrent: the unit's one visit
  kAmax,         // load, max into the split's amax, then keep, swap or drop the pieces
  kCastStashed,  // cast the pieces the block's stash holds
  kCastReload,   // load again and cast (a dropped unit)
  kDone,
};
struct Step {
  int64_t unit;
  Visit visit;
};
// After an amax visit: the pieces go to the empty stash, or are exchanged for the stash's (whose
// split has become complete: those are cast now), or are dropped (cast again from the input).
enum class Keep : int { kStash, kSwap, kDrop };
struct AmaxOutcome {
  Keep keep;
  int64_t cast_unit;  // kSwap: the unit that left the stash
};
// kCurrent's workspace: four counters, then a count of announced tiles per split, then the
// list of dropped units.
enum Counter : int { kTickets, kRetired, kDropped, kDropClaims, kCounters };
static_assert(kCounters == 4, "split_quantize_workspace_ints counts four counters");
// Polls of a stashed unit's split, larger than the stashes hold, after the next unit's amax
// visit before that unit is dropped: the split usually completes while the next unit loads.
constexpr int kStashPolls = 4;
constexpr unsigned kPollNanoseconds = 128;
// Dropped units a block holds for itself (thread 0's, in shared memory).
constexpr int kHeldDrops = 4;

// A 16-byte piece as the four words the kernel works on, and back.
__device__ __forceinline__ void set_words(uint32_t (&w)[4], const uint4& u) {
  w[0] = u.x;
  w[1] = u.y;
  w[2] = u.z;
  w[3] = u.w;
}
__device__ __forceinline__ uint4 pack_words(const uint32_t (&w)[4]) {
  return make_uint4(w[0], w[1], w[2], w[3]);
}
// This thread's place for its piece i in a [P][kThreads] stash.
__device__ __forceinline__ uint4& stash_piece(uint4* stash, int i) {
  return stash[i * kThreads + threadIdx.x];
}

// Exchanges this thread's pieces with its places in a stash: x gets the stash's when `load`, the
// stash gets x's when `store`.
template <int P>
__device__ __forceinline__ void exchange_pieces(uint4* stash, uint32_t (&x)[P][4], bool load,
                                                bool store) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    uint4& slot = stash_piece(stash, i);
    const uint4 kept = load ? slot : make_uint4(0, 0, 0, 0);
    if (store) slot = pack_words(x[i]);
    if (load) set_words(x[i], kept);
  }
}

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
  // Gathered rows are found per row (load_rows): from the input's first row.
  const T* input = static_cast<const T*>(p.input) + (p.gather_rows ? 0 : s.row0 * p.k);
  if (p.split_inputs.base != nullptr || p.split_inputs.table != nullptr) {
    input = group_ptr<T>(p.split_inputs, s.g) + static_cast<int64_t>(s.mb) * kTile * p.k;
  }
  s.input = input + s.col0;
  return s;
}

// The words of a 16-byte vector.
template <typename T, int V>
__device__ __forceinline__ void to_words(const Vec<T, V>& v, uint32_t (&w)[4]) {
  set_words(w, *reinterpret_cast<const uint4*>(&v));
}

// A GLU source's piece of row `row` at column `col` (glu.h's layout and math): act(a)·gate(b)
// times the row's scale, rounded to T as glu_forward rounds it, as the words of a loaded piece.
template <typename T, GluActivation K>
__device__ __forceinline__ void glu_piece(const GluParams& g, int64_t row, int64_t col,
                                          uint32_t (&w)[4]) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const T* in = static_cast<const T*>(g.input) + row * 2 * g.hidden + a_index(col, g.interleave);
  const Vec<T, V> a = load<T, V>(in);
  const Vec<T, V> b = load<T, V>(in + (g.interleave ? g.interleave : g.hidden));
  float scale = 1.0f;
  if (g.scales != nullptr) {
    scale = g.scale_type == ScalarType::kFloat32 ? static_cast<const float*>(g.scales)[row]
                                                 : to_float(static_cast<const T*>(g.scales)[row]);
  }
  const ActParams act{g.limit, g.alpha, g.offset};
  Vec<T, V> y;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float ai = to_float(a.v[i]), bi = to_float(b.v[i]);
    y.v[i] = glu_output<T, K>(ai, bi, scale, act);
  }
  to_words(y, w);
}

// The GLU input's gradient at V consecutive j of row `row` (glu.h's layout and math): da_j and
// db_j, rounded to T exactly as launch_glu_backward writes them, from the pre-activation's a values
// at column a_col (b one `block` later) and dy at j. Returns the row's scale-gradient share Σ
// dy_j·act(a_j)·gate(b_j) over these j.
template <typename T, GluActivation K>
__device__ __forceinline__ float glu_grads(const GluParams& g, int64_t row, int64_t a_col,
                                           int64_t j, int64_t block, uint32_t (&da)[4],
                                           uint32_t (&db)[4]) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));
  const T* in = static_cast<const T*>(g.input) + row * 2 * g.hidden + a_col;
  const Vec<T, V> a = load<T, V>(in);
  const Vec<T, V> b = load<T, V>(in + block);
  const Vec<T, V> dy = load<T, V>(static_cast<const T*>(g.grad_output) + row * g.hidden + j);
  float scale = 1.0f;
  if (g.scales != nullptr) {
    scale = g.scale_type == ScalarType::kFloat32 ? static_cast<const float*>(g.scales)[row]
                                                 : to_float(static_cast<const T*>(g.scales)[row]);
  }
  const ActParams act{g.limit, g.alpha, g.offset};
  Vec<T, V> ga, gb;
  float scale_grad = 0.0f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float ai = to_float(a.v[i]), bi = to_float(b.v[i]), dyi = to_float(dy.v[i]);
    const GluTerms t = glu_terms<K>(ai, bi, act);
    // glu_backward_kernel's expressions, in its order.
    ga.v[i] = from_float<T>(dyi * scale * t.d_a);
    gb.v[i] = from_float<T>(dyi * scale * t.d_b);
    scale_grad += dyi * t.value;
  }
  to_words(ga, da);
  to_words(gb, db);
  return scale_grad;
}

// The block of a and b columns: the interleave, or H for halves.
__device__ __forceinline__ int64_t glu_block(const GluParams& g) {
  return g.interleave ? g.interleave : g.hidden;
}

// The j of a column of the GLU input (a_j's or b_j's), with a and b blocks of `block` columns.
__device__ __forceinline__ int64_t glu_j(int64_t col, int64_t block) {
  return col / (2 * block) * block + col % block;
}

// A GLU gradient source's piece of row `row` at column `col` of the GLU input's gradient: da or db
// of V consecutive j (a piece lies wholly in one a or b block: the interleave and H are multiples
// of V). Returns its scale-gradient share when it holds a values, else 0 (each j counts once).
// Used where a tile's a and b partners cannot be paired (below).
template <typename T, GluActivation K>
__device__ __forceinline__ float glu_grad_piece(const GluParams& g, int64_t row, int64_t col,
                                                uint32_t (&w)[4]) {
  const int64_t block = glu_block(g);
  const bool is_b = col / block % 2 == 1;
  uint32_t other[4];
  const float scale_grad = glu_grads<T, K>(g, row, is_b ? col - block : col, glu_j(col, block),
                                           block, is_b ? other : w, is_b ? w : other);
  return is_b ? 0.0f : scale_grad;
}

// An add that publishes this thread's earlier writes to whoever reads the count with
// load_acquire (lighter than __threadfence's sequentially consistent fence).
__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Where the kernel's input pieces come from: the input as it is, or computed from a GLU's
// pre-activation (its output, or the gradient of its input).
enum class Source { kTensor, kGluForward, kGluBackward };

// Whether a launch has a stash (kStashBytes above): 16-bit pieces, and a GLU gradient source or
// kCurrent.
template <typename T, QuantizeScaling S, Source kSource>
constexpr bool has_stash() {
  return sizeof(T) == 2 && (kSource == Source::kGluBackward || S == QuantizeScaling::kCurrent);
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, Source kSource>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    split_quantize_kernel(const SplitQuantizeParams p, float max_fp8) {
  constexpr int V = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte load
  constexpr int kRowThreads = kTile / V;               // threads sharing a row: 16 or 32
  constexpr int kRowGroups = kThreads / kRowThreads;   // 16 or 8
  constexpr int P = kTile / kRowGroups;                // rows per thread: 8 or 16
  constexpr bool kPerTensor = S == QuantizeScaling::kCurrent || S == QuantizeScaling::kDelayed;
  constexpr bool kCurrent = S == QuantizeScaling::kCurrent;
  static_assert(P % 8 == 0 && V % 2 == 0, "whole 8-byte chunks and fp8 pairs");
  // Current scaling's scheduling counts tiles as units (its amax_complete): no paired GLU units.
  static_assert(!(kCurrent && kSource == Source::kGluBackward),
                "no GLU gradient source in kCurrent");
  static_assert(sizeof(T) != 2 || P * kThreads * sizeof(uint4) == kStashBytes, "stash size");

  extern __shared__ __align__(16) char dynamic_shared[];
  __shared__ __align__(16) uint8_t transposed[kTile * kTile];
  __shared__ __align__(16) float column_partial[kWarps][kTile];
  __shared__ __align__(16) float column_scale[kTile];
  __shared__ float scratch[kWarps];
  // kCurrent: the step and amax outcome of this iteration, by its parity (so that one barrier
  // each suffices), and the scale of the cast unit's split (thread 0 writes it before a barrier
  // that precedes its reads, and after the next iteration's first barrier).
  __shared__ Step step[2];
  __shared__ AmaxOutcome outcome[2];
  // kCurrent: the warps' amaxes of the tile of an amax visit, for thread 0.
  __shared__ float warp_amaxes[kWarps];
  __shared__ int held[kHeldDrops];  // kCurrent, thread 0's: next_current_step
  __shared__ float split_scale;

  const int groups = p.num_groups;
  const SplitLayout layout = build_layout(p, dynamic_shared);
  const float value_for_inf = kPerTensor ? FLT_MAX : InputLimits<T>::kMax;

  const int64_t k = p.k;
  const int64_t col_tiles = (k + kTile - 1) / kTile;
  // One scale_inv per split. kDelayed: all here. kCurrent: the splits without a tile here (empty,
  // or K = 0: their amax is the launch's zero), the others by the cast of their first tile, once
  // their amax is complete.
  if constexpr (kPerTensor) {
    if (blockIdx.x == 0) {
      for (int g = threadIdx.x; g < groups; g += kThreads) {
        if (kCurrent && layout.start[g + 1] > layout.start[g] && col_tiles > 0) continue;
        const float scale =
            kCurrent ? scale_from_amax(0.0f, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf)
                     : p.scale[g];
        p.scale_inv[g] = __frcp_rn(scale);
      }
    }
  }
  const bool writes_amax = !kCurrent && p.amax != nullptr;

  uint8_t* rowwise = static_cast<uint8_t*>(p.rowwise);
  uint8_t* columnwise = static_cast<uint8_t*>(p.columnwise);
  const int lane_col = threadIdx.x % kRowThreads;
  const int c0 = lane_col * V;                   // first tile column of this thread
  const int r0 = threadIdx.x / kRowThreads * P;  // first tile row of this thread
  const int warp = threadIdx.x / kWarpSize;

  // A GLU gradient source pairs each tile of a columns with the tile of b columns that has the
  // same j when a and b blocks are whole tiles (16-bit types; their stash fits): one work unit
  // does both, loading a, b and dy and computing the activation's terms once for the two. The a
  // tile goes first and leaves its partner's gradient in shared memory (each thread its own
  // pieces, so no barrier). Else a unit is one tile.
  //
  // kCurrent keeps a unit's pieces in the same shared memory between its amax visit and its
  // cast, where a unit is one tile of a 16-bit type (`kHasSlot`).
  [[maybe_unused]] uint4* stash = nullptr;  // [P][kThreads]: the b tile's or the kept unit's pieces
  bool paired = false;
  int64_t block = 0, block_tiles = 0;  // when paired: a (or b) block's columns and tiles
  if constexpr (kSource == Source::kGluBackward && sizeof(T) == 2) {
    block = glu_block(p.glu);
    paired = block % kTile == 0;
    block_tiles = block / kTile;
  }
  if constexpr (has_stash<T, S, kSource>()) {
    stash = reinterpret_cast<uint4*>(dynamic_shared + stash_offset(groups));
  }
  constexpr bool kHasSlot = kCurrent && sizeof(T) == 2;
  const int64_t unit_cols = paired ? col_tiles / 2 : col_tiles;  // units per row tile
  const int64_t units = static_cast<int64_t>(layout.tiles[groups]) * unit_cols;

  // kCurrent's scheduling (thread 0 decides, the block follows). Units are handed out in order
  // from a ticket counter for their amax visits, which never wait, so whatever waits (a cast for
  // its split's amax) waits only for visits that running blocks hold: no deadlock whatever is
  // resident. `stashed`: the unit whose pieces the stash holds, or -1.
  [[maybe_unused]] int* counters = p.workspace;
  [[maybe_unused]] int* amax_done = p.workspace + kCounters;  // announced tiles per split
  [[maybe_unused]] int* dropped = amax_done + groups;
  [[maybe_unused]] int64_t stashed = -1;
  [[maybe_unused]] bool exhausted = false;
  auto split_of_unit = [&](int64_t unit) {
    return split_of_tile(layout, groups, static_cast<int32_t>(unit / unit_cols));
  };
  auto amax_complete = [&](int g) {
    const int needed = (layout.tiles[g + 1] - layout.tiles[g]) * static_cast<int>(col_tiles);
    return load_acquire(amax_done + g) >= needed;
  };
  auto complete_split_scale = [&](int g) {  // once amax_complete(g)
    return scale_from_amax(__ldcg(p.amax + g), max_fp8, p.power_of_2_scales, p.epsilon,
                           value_for_inf);
  };
  // Thread 0 claims each ticket an iteration before it is used, so that the claim's round trip
  // overlaps the iteration's work. A block holding a valid ticket never waits without bound (its
  // next visit is an amax visit), so the argument above holds.
  [[maybe_unused]] int pending_ticket = 0;
  if (kCurrent && threadIdx.x == 0) pending_ticket = atomicAdd(counters + kTickets, 1);
  // Thread 0's last few dropped units, in order, held to be cast as soon as their split is
  // complete (their second read may still find them in L2); more go to the workspace's list.
  [[maybe_unused]] int held_first = 0, held_count = 0;
  auto pop_held = [&]() -> Step {
    const int unit = held[held_first];
    held_first = (held_first + 1) % kHeldDrops;
    --held_count;
    return {unit, Visit::kCastReload};
  };
  // A held unit whose split is complete; else the next unit's amax visit while tickets last;
  // then the stash's cast, the held units' casts, and the list's once every amax visit has
  // retired (the list is complete).
  auto next_current_step = [&]() -> Step {
    if (held_count > 0 && amax_complete(split_of_unit(held[held_first]))) return pop_held();
    if (!exhausted) {
      const int ticket = pending_ticket;
      if (ticket < units) {
        pending_ticket = atomicAdd(counters + kTickets, 1);
        return {ticket, Visit::kAmax};
      }
      exhausted = true;
    }
    if (stashed >= 0) {
      const Step cast{stashed, Visit::kCastStashed};
      stashed = -1;
      return cast;
    }
    if (held_count > 0) return pop_held();  // every amax visit is handed out: waiting is safe
    while (load_acquire(counters + kRetired) < units) __nanosleep(kPollNanoseconds);
    const int claim = atomicAdd(counters + kDropClaims, 1);
    if (claim < __ldcg(counters + kDropped)) return {__ldcg(dropped + claim), Visit::kCastReload};
    return {0, Visit::kDone};
  };
  // Whether the stash's split is complete; if so, split_scale gets its scale. Thread 0 asks
  // first while the next unit's loads are in flight (`stash_ready`), then in keep_or_drop.
  [[maybe_unused]] bool stash_ready = false;
  auto stash_split_complete = [&]() {
    const int g = split_of_unit(stashed);
    if (!amax_complete(g)) return false;
    split_scale = complete_split_scale(g);
    return true;
  };
  // After `unit`'s amax visit.
  auto keep_or_drop = [&](int64_t unit) -> AmaxOutcome {
    AmaxOutcome o{Keep::kDrop, stashed};
    if (kHasSlot && stashed < 0) {
      o.keep = Keep::kStash;
    } else if (kHasSlot && split_of_unit(unit) != split_of_unit(stashed)) {
      // (The stash's split cannot be complete before this unit of it is announced.) A split that
      // the stashes can hold whole completes within the amax visits in flight: wait for it rather
      // than read this unit twice. That cannot deadlock: every ticket of the stash's split is
      // claimed (this unit's split is later), and a block holding one of them unannounced, or
      // claimed ahead, waits, if at all, for an earlier split. For a larger split, a few polls,
      // then the unit is dropped (waiting idled the blocks while its last tiles loaded:
      // docs/experiments.md).
      const int g = split_of_unit(stashed);
      const bool wait = (layout.tiles[g + 1] - layout.tiles[g]) * col_tiles <= gridDim.x;
      for (int poll = 0; !stash_ready && (wait || poll < kStashPolls); ++poll) {
        __nanosleep(kPollNanoseconds);
        stash_ready = stash_split_complete();
      }
      if (stash_ready) o.keep = Keep::kSwap;
    }
    stash_ready = false;
    if (o.keep == Keep::kDrop && held_count == kHeldDrops) {
      dropped[atomicAdd(counters + kDropped, 1)] = static_cast<int>(unit);
      add_release(counters + kRetired, 1);  // the entry is visible before the count
      return o;
    }
    if (o.keep == Keep::kDrop) {
      held[(held_first + held_count++) % kHeldDrops] = static_cast<int>(unit);
    } else {
      stashed = unit;
    }
    atomicAdd(counters + kRetired, 1);
    return o;
  };

  int64_t t = blockIdx.x;  // every scaling but kCurrent: a grid-stride loop over the units
  for (int parity = 0;; parity ^= 1) {
    int64_t unit = t;
    Visit visit = Visit::kOnly;
    if constexpr (kCurrent) {
      if (threadIdx.x == 0) step[parity] = next_current_step();
      __syncthreads();
      unit = step[parity].unit;
      visit = step[parity].visit;
      if (visit == Visit::kDone) break;
    } else {
      if (t >= units) break;
      t += gridDim.x;
    }
    for (int half = 0; half < (paired ? 2 : 1); ++half) {
      int64_t tile = unit;
      if (paired) {  // unit → its row tile and a's tile column, then half 1 is b's
        const int64_t rt = unit / unit_cols, pair = unit % unit_cols;
        tile = rt * col_tiles + pair / block_tiles * 2 * block_tiles + pair % block_tiles +
               half * block_tiles;
      }
      TileSpot<T> spot;
      int g, mb, kb, rows_valid, cols_valid;
      int64_t m, row0, col0;
      bool col_ok;
      auto place = [&](int64_t at) {
        spot = locate<T>(p, layout, at, col_tiles);
        g = spot.g;
        mb = spot.mb;
        kb = spot.kb;
        rows_valid = spot.rows_valid;
        cols_valid = spot.cols_valid;
        m = spot.m;
        row0 = spot.row0;
        col0 = spot.col0;
        col_ok = c0 < cols_valid;  // k % 16 == 0: a piece is wholly in or out
      };
      place(tile);
      uint32_t x[P][4];
      [[maybe_unused]] float
          scale_grad[P];  // kGluBackward: this thread's share of each row's scale gradient
      // The rows' pieces. The activation is a template argument of this loop only: its math
      // inlined once per loaded piece keeps the hot code small (a branch per piece held both
      // activations' code and stalled on instruction fetch).
      auto load_rows = [&](auto activation) {
        [[maybe_unused]] constexpr GluActivation K = decltype(activation)::value;
#pragma unroll
        for (int i = 0; i < P; ++i) {
          bool valid = col_ok && r0 + i < rows_valid;
          if constexpr (kSource == Source::kTensor) {
            int64_t in_row = r0 + i;
            if (p.gather_rows != nullptr) {
              in_row = valid ? p.gather_rows[row0 + r0 + i] : -1;
              valid = in_row >= 0 && in_row < p.gather_source_rows;
            }
            uint4 v = make_uint4(0, 0, 0, 0);
            if (valid) v = *reinterpret_cast<const uint4*>(spot.input + in_row * k + c0);
            set_words(x[i], v);
          } else {
            x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0u;
            scale_grad[i] = 0.0f;
            if constexpr (kSource == Source::kGluForward) {
              if (valid) glu_piece<T, K>(p.glu, row0 + r0 + i, col0 + c0, x[i]);
            } else if (!paired) {
              if (valid)
                scale_grad[i] = glu_grad_piece<T, K>(p.glu, row0 + r0 + i, col0 + c0, x[i]);
            } else if (half == 0) {
              uint32_t db[4] = {0u, 0u, 0u, 0u};
              if (valid) {
                const int64_t a_col = col0 + c0;
                scale_grad[i] = glu_grads<T, K>(p.glu, row0 + r0 + i, a_col, glu_j(a_col, block),
                                                block, x[i], db);
              }
              stash_piece(stash, i) = pack_words(db);
            } else {
              set_words(x[i], stash_piece(stash, i));
            }
          }
        }
      };
      using SwiGLU = std::integral_constant<GluActivation, GluActivation::kSwiGLU>;
      if (kCurrent && visit == Visit::kCastStashed) {
        exchange_pieces(stash, x, true, false);
      } else if constexpr (kSource == Source::kTensor) {
        load_rows(SwiGLU{});  // no activation
      } else if (p.glu.activation == GluActivation::kSwiGLU) {
        load_rows(SwiGLU{});
      } else {
        load_rows(std::integral_constant<GluActivation, GluActivation::kClampedSwiGLU>{});
      }
      if (kCurrent && kHasSlot && visit == Visit::kAmax && threadIdx.x == 0 && stashed >= 0) {
        stash_ready = stash_split_complete();  // overlaps the loads just issued
      }
      // The scale gradient's partial sums: one per row and tile column.
      if constexpr (kSource == Source::kGluBackward) {
        if (p.glu_grad_scales_partial != nullptr && half == 0) {
          float* partial = p.glu_grad_scales_partial + kb * p.rows + row0 + r0;
#pragma unroll
          for (int i = 0; i < P; ++i) {
            float sum = scale_grad[i];
#pragma unroll
            for (int offset = kRowThreads / 2; offset > 0; offset /= 2) {
              sum += __shfl_xor_sync(kFullMask, sum, offset);
            }
            if (lane_col == 0 && r0 + i < rows_valid) partial[i] = sum;
          }
        }
      }

      // The tile's amax (zero rows and columns past the tile add nothing). Unless the tile needs it
      // whole (128×128 blocks), each warp maxes its part into the split's amax itself: no block
      // barrier. kCurrent's amax visits instead leave the warps' parts to thread 0, which
      // announces the tile (below); a cast waits for every tile of its split.
      float tile_amax = 0.0f;
      const bool reports_amax = (kCurrent && visit == Visit::kAmax) || writes_amax;
      if (reports_amax || S == QuantizeScaling::kBlock128x128) {
        AbsMax<T> a;
#pragma unroll
        for (int i = 0; i < P; ++i) {
#pragma unroll
          for (int w = 0; w < 4; ++w) a.add(x[i][w]);
        }
        if constexpr (S == QuantizeScaling::kBlock128x128) {
          tile_amax = block_max(a.value(), scratch);
          if (reports_amax && threadIdx.x == 0) atomic_max_nonnegative(p.amax + g, tile_amax);
        } else if (reports_amax) {
          const float warp_amax = warp_max(a.value());
          if (threadIdx.x % kWarpSize == 0) {
            if (kCurrent) {
              warp_amaxes[warp] = warp_amax;
            } else {
              atomic_max_nonnegative(p.amax + g, warp_amax);
            }
          }
        }
      }
      if (kCurrent && visit == Visit::kAmax) {
        // Thread 0 decides what becomes of the pieces, then announces the tile's amax after the
        // barrier: the release waits for thread 0's earlier stores while the other warps go on
        // (one warp's wait per tile; a release per warp stalled every warp, ncu).
        if (threadIdx.x == 0) outcome[parity] = keep_or_drop(unit);
        __syncthreads();
        if (threadIdx.x == 0) {
          float amax = warp_amaxes[0];
#pragma unroll
          for (int w = 1; w < kWarps; ++w) amax = fmaxf(amax, warp_amaxes[w]);
          atomic_max_nonnegative(p.amax + g, amax);
          add_release(amax_done + g, 1);  // the max is visible before the count
        }
        const AmaxOutcome o = outcome[parity];
        if (o.keep == Keep::kDrop) continue;
        exchange_pieces(stash, x, o.keep == Keep::kSwap, true);
        if (o.keep == Keep::kStash) continue;
        place(o.cast_unit);  // kSwap: cast the unit that left the stash
      }

      // ---- rowwise scales, then the rowwise copy (also the columnwise bytes when one scale
      // serves both copies) ----
      constexpr int kOutWords = V / 4;  // FP8 words per piece
      uint32_t q[P][kOutWords];
      float tensor_scale = 1.0f;  // the one scale of this tile unless kBlock1x128
      if constexpr (S == QuantizeScaling::kDelayed) {
        tensor_scale = p.scale[g];
      } else if constexpr (kCurrent) {
        if (visit != Visit::kAmax) {  // a swap found its scale already
          if (threadIdx.x == 0) {
            // Every tile of the split has been announced (a unit retires before its announcement;
            // the stash's split may be complete already).
            while (!amax_complete(g)) __nanosleep(kPollNanoseconds);
            split_scale = complete_split_scale(g);
          }
          __syncthreads();
        }
        if (threadIdx.x == 0 && mb == 0 && kb == 0) p.scale_inv[g] = __frcp_rn(split_scale);
        tensor_scale = split_scale;
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
        uint8_t* out_row = rowwise != nullptr ? rowwise + (row0 + r0) * k + col0 + c0 : nullptr;
        // kBlock1x128: the P row amaxes of this row group, reduced over its 2P lanes by halving
        // exchanges (at each step a lane keeps half of its rows and sends the other half to the
        // partner that keeps those: P shuffles instead of P·log2(2P)), so that lanes 2i and
        // 2i + 1 end with row i's; they turn it into its scale (one division per lane, not P),
        // which the others fetch.
        float own_row_scale = 1.0f;
        if constexpr (S == QuantizeScaling::kBlock1x128) {
          static_assert(kRowThreads == 2 * P, "two lanes per row after the exchanges");
          float v[P];
#pragma unroll
          for (int i = 0; i < P; ++i) {
            AbsMax<T> a;
#pragma unroll
            for (int w = 0; w < 4; ++w) a.add(x[i][w]);
            v[i] = a.value();
          }
          // The lane with bit `offset` set keeps rows [half, 2·half) of its current ones: after
          // the steps, row lane_col / 2 of the group.
#pragma unroll
          for (int half = P / 2, offset = kRowThreads / 2; half > 0; half /= 2, offset /= 2) {
            const bool upper = (lane_col & offset) != 0;
#pragma unroll
            for (int j = 0; j < half; ++j) {
              const float send = upper ? v[j] : v[j + half];
              const float keep = upper ? v[j + half] : v[j];
              v[j] = fmaxf(keep, __shfl_xor_sync(kFullMask, send, offset));
            }
          }
          const float own = fmaxf(v[0], __shfl_xor_sync(kFullMask, v[0], 1));
          own_row_scale =
              scale_from_amax(own, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf);
          const int own_row = lane_col / 2;
          if (lane_col % 2 == 0 && r0 + own_row < rows_valid) {
            p.scale_inv[col_tiles * layout.rows4[g] + kb * m4 + mb * kTile + r0 + own_row] =
                __frcp_rn(own_row_scale);
          }
        }
        const int group_lane0 = threadIdx.x % kWarpSize - lane_col;
#pragma unroll
        for (int i = 0; i < P; ++i) {
          float scale = tensor_scale;
          if constexpr (S == QuantizeScaling::kBlock1x128) {
            scale = __shfl_sync(kFullMask, own_row_scale, group_lane0 + 2 * i);
          }
          cast_piece<T, F>(x[i], scale, q[i]);
          if (rowwise != nullptr && col_ok && r0 + i < rows_valid) {
            if constexpr (kOutWords == 2) {
              *reinterpret_cast<uint2*>(out_row + i * k) = make_uint2(q[i][0], q[i][1]);
            } else {
              *reinterpret_cast<uint32_t*>(out_row + i * k) = q[i][0];
            }
          }
        }
      }
      if (columnwise == nullptr) continue;

      // ---- columnwise copy: column scales (kBlock1x128), the transposed tile, its rows ----
      // Column c0 + j of this thread's P rows is P / 8 chunks of 8 bytes (two words each) at
      // chunk (r0 / 8 + h) ^ swizzle(c) of the shared tile's row c.
      auto store_chunk = [&](int j, int h, uint32_t lo, uint32_t hi) {
        const int c = c0 + j;
        const int chunk_index = (r0 / 8 + h) ^ swizzle<V>(c);
        *reinterpret_cast<uint2*>(transposed + c * kTile + chunk_index * 8) = make_uint2(lo, hi);
      };
      if constexpr (S == QuantizeScaling::kBlock1x128) {
        // Column amaxes: packed over this thread's rows, then over the row groups.
        AbsMax<T> col[4];
#pragma unroll
        for (int i = 0; i < P; ++i) {
#pragma unroll
          for (int w = 0; w < 4; ++w) col[w].add(x[i][w]);
        }
        float col_amax[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float a;
          if constexpr (std::is_same_v<T, float>) {
            a = col[j].value();
          } else {
            a = j % 2 == 0 ? col[j / 2].lo() : col[j / 2].hi();
          }
          // The other row groups of this warp that hold the same columns.
#pragma unroll
          for (int offset = kRowThreads; offset < kWarpSize; offset *= 2) {
            a = fmaxf(a, __shfl_xor_sync(kFullMask, a, offset));
          }
          col_amax[j] = a;
        }
        if (threadIdx.x % kWarpSize < kRowThreads) {
#pragma unroll
          for (int j = 0; j < V; j += 4) {
            *reinterpret_cast<float4*>(&column_partial[warp][c0 + j]) =
                make_float4(col_amax[j], col_amax[j + 1], col_amax[j + 2], col_amax[j + 3]);
          }
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
        float col_scale[V];
#pragma unroll
        for (int j = 0; j < V; j += 4) {
          const float4 v = *reinterpret_cast<const float4*>(&column_scale[c0 + j]);
          col_scale[j] = v.x;
          col_scale[j + 1] = v.y;
          col_scale[j + 2] = v.z;
          col_scale[j + 3] = v.w;
        }
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float scale = col_scale[j];
#pragma unroll
          for (int h = 0; h < P / 8; ++h) {
            uint32_t word[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const int i = 8 * h + 4 * half;
              const uint32_t lo =
                  cast2<F>(element_at<T>(x[i], j) * scale, element_at<T>(x[i + 1], j) * scale);
              const uint32_t hi =
                  cast2<F>(element_at<T>(x[i + 2], j) * scale, element_at<T>(x[i + 3], j) * scale);
              word[half] = __byte_perm(lo, hi, 0x5410);
            }
            store_chunk(j, h, word[0], word[1]);
          }
        }
      } else {
        // The rowwise bytes transposed, four rows by four columns at a time.
#pragma unroll
        for (int h = 0; h < P / 8; ++h) {
#pragma unroll
          for (int w = 0; w < kOutWords; ++w) {
            uint32_t top[4], bottom[4];  // rows 8h .. 8h + 3 and 8h + 4 .. 8h + 7
            transpose4x4(q[8 * h][w], q[8 * h + 1][w], q[8 * h + 2][w], q[8 * h + 3][w], top);
            transpose4x4(q[8 * h + 4][w], q[8 * h + 5][w], q[8 * h + 6][w], q[8 * h + 7][w],
                         bottom);
#pragma unroll
            for (int j = 0; j < 4; ++j) store_chunk(4 * w + j, h, top[j], bottom[j]);
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
        const uint2 a =
            *reinterpret_cast<const uint2*>(transposed + c * kTile + ((2 * segment) ^ s) * 8);
        const uint2 b =
            *reinterpret_cast<const uint2*>(transposed + c * kTile + ((2 * segment + 1) ^ s) * 8);
        *reinterpret_cast<uint4*>(block + (col0 + c) * ld + 16 * segment) =
            make_uint4(a.x, a.y, b.x, b.y);
      }
      __syncthreads();  // the next tile rewrites `transposed`
    }
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

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, Source kSource>
void launch_source(const SplitQuantizeParams& p, cudaStream_t stream) {
  auto* kernel = split_quantize_kernel<T, F, S, kSource>;
  const size_t shared = has_stash<T, S, kSource>() ? stash_offset(p.num_groups) + kStashBytes
                                                   : layout_bytes(p.num_groups);
  // The kernel's static shared memory (about 21 KB) plus the layout may pass the 48 KB default.
  TORCHMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared)));
  const int64_t tiles_bound = split_quantize_tiles_bound(p.num_groups, p.rows, p.k);
  // Tile indices are divided in 32 bits, and kCurrent counts in ints its tickets (one per unit and
  // per block), its units and a split's announced tiles: 2^27 tiles (2·10^12 elements) leave room
  // for all.
  TORCH_INTERNAL_ASSERT(tiles_bound < (int64_t{1} << 27), "launch_split_quantize: too many tiles");
  const unsigned grid = one_wave_grid(kernel, kThreads, shared, tiles_bound);
  kernel<<<grid, kThreads, shared, stream>>>(p, fp8_max(p.format));
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S>
void launch_scaling(const SplitQuantizeParams& p, cudaStream_t stream) {
  if (p.glu.input == nullptr) return launch_source<T, F, S, Source::kTensor>(p, stream);
  if (p.glu.grad_output == nullptr) return launch_source<T, F, S, Source::kGluForward>(p, stream);
  if constexpr (S == QuantizeScaling::kCurrent) {
    TORCH_INTERNAL_ASSERT(false, "launch_split_quantize: no GLU gradient source with kCurrent");
  } else {
    return launch_source<T, F, S, Source::kGluBackward>(p, stream);
  }
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
  TORCH_INTERNAL_ASSERT(aligned16({p.input, p.glu.input, p.rowwise, p.columnwise}),
                        "launch_split_quantize: buffers must be 16-byte aligned");
  const int64_t glu_width = p.glu.grad_output != nullptr ? p.k / 2 : p.k;
  TORCH_INTERNAL_ASSERT(
      p.glu.input == nullptr ||
          (p.glu.rows == p.rows && p.glu.hidden == glu_width && p.glu.data_type == p.input_type &&
           p.split_inputs.empty() && p.glu.interleave % kQuantizeFeatureMultiple == 0),
      "launch_split_quantize: a GLU source must be [rows, 2 * hidden] of the input type, with k ",
      "= hidden (its output) or 2 * hidden (its input's gradient)");
  TORCH_INTERNAL_ASSERT(p.glu.grad_output == nullptr || p.glu.input != nullptr,
                        "launch_split_quantize: a GLU gradient source needs the GLU input");
  TORCH_INTERNAL_ASSERT(
      p.gather_rows == nullptr || (p.glu.input == nullptr && p.split_inputs.base == nullptr &&
                                   p.split_inputs.table == nullptr),
      "launch_split_quantize: gathered rows come from `input` only");
  TORCH_INTERNAL_ASSERT(p.glu_grad_scales_partial == nullptr || p.glu.grad_output != nullptr,
                        "launch_split_quantize: scale-gradient sums need a GLU gradient source");
  TORCH_INTERNAL_ASSERT(aligned16({p.glu.grad_output}),
                        "launch_split_quantize: glu.grad_output must be 16-byte aligned");
  TORCH_INTERNAL_ASSERT(p.scaling != QuantizeScaling::kCurrent || p.workspace != nullptr,
                        "launch_split_quantize: kCurrent needs a workspace");
  if (p.amax != nullptr && !(p.scaling == QuantizeScaling::kDelayed && p.accumulate_amax)) {
    TORCHMOE_CUDA_CHECK(
        cudaMemsetAsync(p.amax, 0, static_cast<size_t>(p.num_groups) * sizeof(float), stream));
  }
  if (p.scaling == QuantizeScaling::kCurrent) {
    TORCHMOE_CUDA_CHECK(cudaMemsetAsync(
        p.workspace, 0, (kCounters + static_cast<size_t>(p.num_groups)) * sizeof(int32_t), stream));
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
