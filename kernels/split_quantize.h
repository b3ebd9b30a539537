#pragma once
// Split-quantize: one launch casts a row-major [M, K] bf16/fp16/fp32 tensor, split into G row
// blocks, to FP8 (e4m3 or e5m2), per split: the rowwise data [m_g, K], the columnwise (transposed)
// data [K, m_g] that Hopper's TN-only FP8 GEMMs need for dgrad and wgrad, the scale_inv and the
// amax. Semantics follow TransformerEngine (recipe/recipe_common.cuh, recipe/delayed_scaling.cu,
// transpose/quantize_transpose_{vector,square}_blockwise.cu).
//
// Kernel layer: raw pointers, sizes and a stream. Validation and allocation: ops/quantize.cpp.
//
// Splits are read from device memory (int32 or int64) and clamped as in the sm90 grouped GEMM:
// start_g = min(Σ_{h<g} split_h, M), m_g = min(split_g, M - start_g), negative sizes read as 0.
// Rows past the last split are never read or written. Host sizes are uploaded by ops.
//
// Data layouts (one buffer each, all splits):
//
//   rowwise     [M, K]   split g's rows at rows [start_g, start_g + m_g), as in the input
//   columnwise  [K·(M + 15·G)]  split g's transpose [K, r16(m_g)] (row-major) at element
//                        K·Σ_{h<g} r16(m_h), r16(n) = n rounded up to a multiple of 16; columns
//                        m_g .. r16(m_g) are zeros. The padding makes every row of every block
//                        16-byte aligned and every block's width a multiple of 16, which FP8 GEMMs
//                        that reduce over the rows (wgrad) need of their operands; the zeros add
//                        nothing to the product.
//
// Scalings (q = satfinite_rn(x · scale) in fp32, dequantized as q · scale_inv):
//
//   kCurrent   per split: scale = fp8_max / amax_g of this call's data (the launch reduces amax_g
//              and casts the split once it is complete; no host sync)
//   kDelayed   per split: scale_g is given (device, from an amax history); the cast writes this
//              call's amax_g; update_delayed_scaling turns it into the next step's scale
//   kBlock1x128    one scale per 128 consecutive elements of a row (rowwise copy) and per 128
//                  consecutive elements of a row of the transposed copy, i.e. 128 rows of one
//                  column of the split (columnwise copy), each from its own amax
//   kBlock128x128  one scale per 128×128 tile, shared by both copies
//
// amax → scale (kCurrent and the block scalings; TE's compute_scale_from_amax): amax < epsilon →
// epsilon; amax 0, inf or NaN → scale 1; else scale = fp8_max / amax rounded to nearest, an
// infinite result → value_for_inf (FLT_MAX for kCurrent, the input type's largest finite value for
// the block scalings, as TE); with power_of_2_scales the scale's mantissa is cleared. amax ignores
// NaN inputs (fmaxf), so a NaN element is cast to NaN but leaves the scale finite; an inf element
// makes amax inf and the scale 1. scale_inv = 1 / scale (rounded to nearest).
//
// Block scale layouts: TE's "GEMM ready" Float8BlockwiseQTensor layout, which TE hands to
// cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F and BLK128x128_32F modes on Hopper, per split,
// the splits' arrays one after another (offsets below). Blocks never straddle two splits: a
// split's first block starts at its first row, so a split of m_g rows has ceil(m_g/128) row blocks
// and only its last may be short. With KB = ceil(K/128), MB_g = ceil(m_g/128), r4(n) = n rounded
// up to a multiple of 4 (so each array's rows start 16-byte aligned):
//
//   kBlock1x128  rowwise     [KB, r4(m_g)]  s[kb][r]: row r, columns [128·kb, 128·kb + 128)
//                            at KB · Σ_{h<g} r4(m_h)
//                columnwise  [MB_g, r4(K)]  s[mb][k]: column k, rows [128·mb, 128·mb + 128)
//                            at r4(K) · Σ_{h<g} MB_h
//   kBlock128x128 rowwise    [MB_g, r4(KB)] s[mb][kb]
//                            at r4(KB) · Σ_{h<g} MB_h
//                columnwise  [KB, r4(MB_g)] s[kb][mb]  (the same values, transposed)
//                            at KB · Σ_{h<g} r4(MB_h)
//
//   input split g (m_g = 301 rows), K = 256         rowwise 1x128 scales of split g, [2, 304]
//   row 0    ┌──────── kb 0 ───────┬──────── kb 1 ───────┐         r:  0  1  ...  300  pad pad pad
//            │ mb 0: rows 0..127   │                     │    kb 0  [ s  s  ...   s    ·   ·   · ]
//   row 128  ├─────────────────────┼─────────────────────┤    kb 1  [ s  s  ...   s    ·   ·   · ]
//            │ mb 1: rows 128..255 │                     │
//   row 256  ├─────────────────────┼─────────────────────┤   columnwise 1x128 scales, [3, 256]:
//            │ mb 2: rows 256..300 │ (45 rows: short)    │   s[mb][k] for mb 0..2, k 0..255
//   row 301  └─────────────────────┴─────────────────────┘   split g+1 starts its own mb 0 here
//
// Padding entries are left unwritten. kCurrent and kDelayed have one scale_inv per split ([G]),
// shared by both copies; every scaling writes amax [G] when `amax` is set (max |x| over the
// split, NaN ignored; 0 for an empty split).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchmoe/kernels/glu.h"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

inline constexpr int64_t kQuantizeBlock = 128;
// The row length must be a multiple of this: rows start 16-byte aligned in every output, and FP8
// GEMMs need it anyway.
inline constexpr int64_t kQuantizeFeatureMultiple = 16;
// Each split's columnwise block is padded to a multiple of this many rows (of the input; columns
// of the block).
inline constexpr int64_t kColumnwiseRowMultiple = 16;
constexpr int64_t round_up_columnwise(int64_t rows) {
  return (rows + kColumnwiseRowMultiple - 1) / kColumnwiseRowMultiple * kColumnwiseRowMultiple;
}
// Elements of the columnwise data buffer for any G splits of M rows: Σ_g r16(m_g) <= M + 15·G.
inline int64_t columnwise_elements(int64_t rows, int64_t k, int64_t groups) {
  return k * (rows + (kColumnwiseRowMultiple - 1) * groups);
}
// Each thread block keeps the split layout in shared memory (20 bytes per split).
inline constexpr int kSplitQuantizeMaxGroups = 4096;

inline float fp8_max(Fp8Format format) { return format == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

inline bool is_block_scaling(QuantizeScaling s) {
  return s == QuantizeScaling::kBlock1x128 || s == QuantizeScaling::kBlock128x128;
}

// Elements of the rowwise and columnwise block-scale buffers for any G splits of M rows (the
// offsets above can reach, at most, these sums).
constexpr int64_t round_up4(int64_t n) { return (n + 3) / 4 * 4; }
constexpr int64_t block_count(int64_t n) { return (n + kQuantizeBlock - 1) / kQuantizeBlock; }
// Σ_g MB_g <= floor(M/128) + G and Σ_g r4(n_g) <= Σ_g n_g + 3G.
inline int64_t rowwise_block_scales(QuantizeScaling s, int64_t rows, int64_t k, int64_t groups) {
  if (s == QuantizeScaling::kBlock1x128) return block_count(k) * (rows + 3 * groups);
  return round_up4(block_count(k)) * (rows / kQuantizeBlock + groups);
}
inline int64_t columnwise_block_scales(QuantizeScaling s, int64_t rows, int64_t k, int64_t groups) {
  if (s == QuantizeScaling::kBlock1x128) return round_up4(k) * (rows / kQuantizeBlock + groups);
  return block_count(k) * (rows / kQuantizeBlock + 4 * groups);
}

struct SplitQuantizeParams {
  ScalarType input_type = ScalarType::kBFloat16;
  Fp8Format format = Fp8Format::kE4M3;
  QuantizeScaling scaling = QuantizeScaling::kCurrent;
  bool power_of_2_scales = false;  // kCurrent and block scalings
  float epsilon = 0.0f;            // kCurrent and block scalings: amax floor
  int num_groups = 0;
  int64_t rows = 0;                // M (the buffers; may exceed the split sum)
  int64_t k = 0;                   // a multiple of kQuantizeFeatureMultiple
  const void* m_splits = nullptr;  // device, num_groups integers
  bool splits_int32 = false;       // else int64

  const void* input = nullptr;  // [M, K], 16-byte aligned
  // When glu.input is set, the tensor cast is instead the gated activation of glu.input ([M, 2K]
  // in glu.h's layout, 16-byte aligned; glu.rows = M, glu.hidden = K, glu.data_type =
  // input_type), computed and rounded to input_type exactly as launch_glu_forward writes it: the
  // bytes equal launch_glu_forward followed by this launch, and the 16-bit activation is never
  // stored. `input` and `split_inputs` are then unused; glu's output and gradient fields too.
  // When glu.grad_output ([M, glu.hidden]) is set as well, the tensor cast is instead the gradient
  // of the GLU input, k = 2·glu.hidden in glu.input's layout, computed and rounded exactly as
  // launch_glu_backward writes grad_input (glu.grad_input and glu.grad_scales stay unused). Not
  // with kCurrent (ops casts the written gradient instead: ops/quantize.h says why).
  GluParams glu;
  // GLU gradient source only, or null: float32 [ceil(k / 128), M], zeroed by the caller. Entry
  // [kb][r] gets row r's share of the scale gradient Σ_j dy_j·act(a_j)·gate(b_j) over the a_j in
  // tile column kb; the sum over kb is glu_backward's grad_scales (rows past the splits stay 0).
  float* glu_grad_scales_partial = nullptr;
  // When set, split g's m_g rows are read from its own [m_g, K] tensor (16-byte aligned) instead
  // of `input`: a layer's G separate weights are quantized in one launch without stacking them.
  GroupAddress split_inputs;
  // When set ([rows] int64), row r is row gather_rows[r] of `input` ([gather_source_rows, K]), and
  // zeros where that index is outside [0, gather_source_rows): an MoE layer's tokens quantized in
  // expert order without a permuted copy. Not with split_inputs or a GLU source.
  const int64_t* gather_rows = nullptr;
  int64_t gather_source_rows = 0;
  void* rowwise = nullptr;  // [M, K] fp8, or null: no rowwise copy
  // columnwise_elements(M, K, G) fp8, or null: no columnwise copy (16-byte aligned)
  void* columnwise = nullptr;
  // kCurrent, kDelayed: [G] (both copies). Block scalings: the rowwise copy's scales (layout
  // above).
  float* scale_inv = nullptr;
  float* columnwise_scale_inv = nullptr;  // block scalings with a columnwise copy
  const float* scale = nullptr;           // kDelayed: [G], given
  // [G]: this call's amax per split. Required for kCurrent (the launch reduces it first) and
  // kDelayed; optional for the block scalings.
  float* amax = nullptr;
  // kDelayed: max into `amax` as it is (e.g. several micro-batches into one history row) instead
  // of zeroing it first.
  bool accumulate_amax = false;
  // kCurrent: split_quantize_workspace_ints(G, M, K) int32 (counters, a count per split and a
  // list of units), its counters zeroed by the launch.
  int32_t* workspace = nullptr;
};

// 128×128 tiles of any G splits of M rows and K columns, at most: Σ_g ceil(m_g / 128) row tiles
// <= M/128 + G, each of ceil(K / 128) tiles.
inline int64_t split_quantize_tiles_bound(int groups, int64_t rows, int64_t k) {
  return (rows / kQuantizeBlock + groups) * block_count(k);
}
// Four counters, a count per split, and room for every tile's index.
inline int64_t split_quantize_workspace_ints(int groups, int64_t rows, int64_t k) {
  return 4 + groups + split_quantize_tiles_bound(groups, rows, k);
}

// One kernel launch for every scaling (kCurrent: each split's amax is reduced, then the split is
// cast, in the same launch). Every scaling that writes amax without accumulate_amax zeroes it
// first, kCurrent its workspace, and the block scalings their scale buffers (memsets).
// Graph-capturable: no host sync, no allocation.
void launch_split_quantize(const SplitQuantizeParams& params, cudaStream_t stream);

// The blocks of one wave of the launch `params` describes (its persistent grid at most): the SMs
// times the blocks of the kernel it selects that fit on one. Reads input_type, format, scaling,
// num_groups and which source it is (glu.input, glu.grad_output set or null), nothing else.
int64_t split_quantize_wave_blocks(const SplitQuantizeParams& params);

// TE's delayed-scaling update (recipe/delayed_scaling.cu), per split g, in place, one launch:
// amax[g] (this step's amax; may alias history row 0) becomes the newest history entry; the
// amax to scale by is the max over the history (kMax) or amax[g] (kMostRecent); the history
// rolls by one (the oldest entry drops out, row 0 is zeroed for the next step's amax); and
//   scale[g] = fp8_max · 2^-margin / amax   if amax is finite and > 0, else unchanged,
// an infinite quotient becoming FLT_MAX; scale_inv[g] = 1 / scale[g].
// The history's order is TE's: after an update, row H-1 holds the newest step, row H-2 the one
// before it, ..., row 1 the oldest, and row 0 is zero.
struct DelayedScalingUpdateParams {
  int num_groups = 0;
  int64_t history_length = 0;     // H >= 1
  float* amax_history = nullptr;  // [H, G] row-major
  const float* amax = nullptr;    // [G]
  float* scale = nullptr;         // [G]
  float* scale_inv = nullptr;     // [G]
  float scaled_max = 448.0f;      // fp8_max · 2^-margin
  AmaxComputeAlgo algo = AmaxComputeAlgo::kMax;
};

void launch_update_delayed_scaling(const DelayedScalingUpdateParams& params, cudaStream_t stream);

}  // namespace torchmoe::kernels
