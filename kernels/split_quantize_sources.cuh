#pragma once
// Where split-quantize's input pieces come from (split_quantize.h, SplitQuantizeParams::glu):
// the input tensor as it is (optionally its rows gathered), or computed on the fly from a GLU's
// pre-activation, its output (SwiGLU forward) or the gradient of its input (SwiGLU backward),
// rounded to the input type exactly as glu.cu writes them, so that a fused cast gives the bytes
// of glu_forward / glu_backward followed by split-quantize. Kept apart from the kernel because
// this is glu.h's layout and math, not the cast. Included by split_quantize.cu only.
//
// Each source hands the kernel the same thing: a thread's P pieces of a tile (16 bytes of V
// consecutive elements of a row each) as words. A GLU source loads a and b (and dy for the
// gradient) and computes the activation per piece.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/glu.h"
#include "torchmoe/kernels/glu_math.cuh"
#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/kernels/split_quantize_layout.cuh"
#include "torchmoe/kernels/split_quantize_math.cuh"

namespace torchmoe::kernels::split_quantize {

// Where the kernel's input pieces come from: the input as it is, or computed from a GLU's
// pre-activation (its output, or the gradient of its input).
enum class Source { kTensor, kGluForward, kGluBackward };

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

// The launch's units (UnitGrid): a GLU gradient source of 16-bit type (their stash fits) pairs a
// and b tiles when a and b blocks (`block` columns, set here) are whole tiles.
template <typename T, Source kSource>
__device__ __forceinline__ UnitGrid unit_grid(const SplitQuantizeParams& p,
                                              const SplitLayout& layout, int groups,
                                              int64_t col_tiles, int64_t& block) {
  bool paired = false;
  int64_t block_tiles = 0;
  if constexpr (kSource == Source::kGluBackward && sizeof(T) == 2) {
    block = glu_block(p.glu);
    paired = block % kTile == 0;
    block_tiles = block / kTile;
  }
  const int64_t unit_cols = paired ? col_tiles / 2 : col_tiles;
  return {paired, col_tiles, block_tiles, unit_cols,
          static_cast<int64_t>(layout.tiles[groups]) * unit_cols};
}

// This thread's place for its piece i in a [P][kThreads] stash (dynamic shared memory,
// kStashBytes).
__device__ __forceinline__ uint4& stash_piece(uint4* stash, int i) {
  return stash[i * kThreads + threadIdx.x];
}

// This thread's P pieces of the tile at `spot` from the source, zeros where a row or the piece's
// columns lie outside the split (k % 16 == 0: a piece is wholly in or out, `col_ok`). kGluBackward
// also leaves each row's scale-gradient share in scale_grad. A paired unit (UnitGrid) computes
// both tiles' pieces in half 0, which stashes b's gradient for half 1 (each thread its own
// pieces, so no barrier).
//
// The activation is a template argument of this loop only: its math inlined once per loaded
// piece keeps the hot code small (a branch per piece held both activations' code and stalled on
// instruction fetch).
template <typename T, Source kSource, GluActivation K, int P>
__device__ __forceinline__ void load_pieces(const SplitQuantizeParams& p, const TileSpot<T>& spot,
                                            const ThreadPlace& t, int64_t k, bool col_ok,
                                            bool paired, int half, int64_t block, uint4* stash,
                                            uint32_t (&x)[P][4], float (&scale_grad)[P]) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    bool valid = col_ok && t.r0 + i < spot.rows_valid;
    if constexpr (kSource == Source::kTensor) {
      int64_t in_row = t.r0 + i;
      if (p.gather_rows != nullptr) {
        in_row = valid ? p.gather_rows[spot.row0 + t.r0 + i] : -1;
        valid = in_row >= 0 && in_row < p.gather_source_rows;
      }
      uint4 v = make_uint4(0, 0, 0, 0);
      if (valid) v = *reinterpret_cast<const uint4*>(spot.input + in_row * k + t.c0);
      set_words(x[i], v);
    } else {
      x[i][0] = x[i][1] = x[i][2] = x[i][3] = 0u;
      scale_grad[i] = 0.0f;
      if constexpr (kSource == Source::kGluForward) {
        if (valid) glu_piece<T, K>(p.glu, spot.row0 + t.r0 + i, spot.col0 + t.c0, x[i]);
      } else if (!paired) {
        if (valid) {
          scale_grad[i] = glu_grad_piece<T, K>(p.glu, spot.row0 + t.r0 + i, spot.col0 + t.c0, x[i]);
        }
      } else if (half == 0) {
        uint32_t db[4] = {0u, 0u, 0u, 0u};
        if (valid) {
          const int64_t a_col = spot.col0 + t.c0;
          scale_grad[i] = glu_grads<T, K>(p.glu, spot.row0 + t.r0 + i, a_col, glu_j(a_col, block),
                                          block, x[i], db);
        }
        stash_piece(stash, i) = pack_words(db);
      } else {
        set_words(x[i], stash_piece(stash, i));
      }
    }
  }
}

// load_pieces with the launch's activation (a GLU source) as its template argument.
template <typename T, Source kSource, int P>
__device__ __forceinline__ void load_source_pieces(const SplitQuantizeParams& p,
                                                   const TileSpot<T>& spot, const ThreadPlace& t,
                                                   int64_t k, bool col_ok, bool paired, int half,
                                                   int64_t block, uint4* stash, uint32_t (&x)[P][4],
                                                   float (&scale_grad)[P]) {
  if constexpr (kSource == Source::kTensor) {
    load_pieces<T, kSource, GluActivation::kSwiGLU>(p, spot, t, k, col_ok, paired, half, block,
                                                    stash, x, scale_grad);  // no activation
  } else if (p.glu.activation == GluActivation::kSwiGLU) {
    load_pieces<T, kSource, GluActivation::kSwiGLU>(p, spot, t, k, col_ok, paired, half, block,
                                                    stash, x, scale_grad);
  } else {
    load_pieces<T, kSource, GluActivation::kClampedSwiGLU>(p, spot, t, k, col_ok, paired, half,
                                                           block, stash, x, scale_grad);
  }
}

// kGluBackward: the scale gradient's partial sums, one per row and tile column (half 0 of a
// paired unit holds both tiles' shares): this thread's row shares summed over the row's threads.
template <typename T, int P>
__device__ __forceinline__ void store_scale_grad_partials(const SplitQuantizeParams& p,
                                                          const TileSpot<T>& spot,
                                                          const ThreadPlace& t,
                                                          const float (&scale_grad)[P]) {
  constexpr int kRowThreads = PieceShape<T>::kRowThreads;
  float* partial = p.glu_grad_scales_partial + spot.kb * p.rows + spot.row0 + t.r0;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    float sum = scale_grad[i];
#pragma unroll
    for (int offset = kRowThreads / 2; offset > 0; offset /= 2) {
      sum += __shfl_xor_sync(kFullMask, sum, offset);
    }
    if (t.lane_col == 0 && t.r0 + i < spot.rows_valid) partial[i] = sum;
  }
}

}  // namespace torchmoe::kernels::split_quantize
