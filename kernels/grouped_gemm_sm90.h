#pragma once
// One-launch grouped GEMM for Hopper (sm_90a): TMA loads into a multi-stage shared-memory ring,
// wgmma with fp32 accumulators, one producer warpgroup and two consumer warpgroups, and a
// persistent grid that walks the tiles of all groups. Group sizes are read from device memory by
// the kernel itself, so a call needs no device-to-host copy and can be captured in a CUDA graph
// (new split contents in the same buffer are picked up at replay).
//
// Kernel layer: raw pointers, sizes and a stream. Validation, the table cache and the choice of
// this backend: ops/grouped_gemm.cpp.
//
// Row-major shapes; group g owns rows [start_g, start_g + m_g) of x and dy, where m_g is the split
// clamped to [0, rows - start_g] and start_g the clamped prefix sum (a split sum above `rows` never
// reads or writes past the buffers; rows past the last group are never touched):
//
//   kFprop  y[rows of g, n]  = x[rows of g, k] · W_g[n, k]ᵀ (+ b_g[n])     grouped along M
//   kDgrad  dx[rows of g, k] = dy[rows of g, n] · W_g[n, k]                 grouped along M
//   kWgrad  dW_g[n, k]       = dy[rows of g, n]ᵀ · x[rows of g, k]  (+= dW_g) grouped along K
//
// For wgmma every operand is a tile of "rows × reduction": x in fprop and dy in dgrad are
// reduction-contiguous (K-major); W in dgrad and both operands of wgrad are contiguous along the
// output dimension (MN-major) and are read through wgmma's transpose bit rather than copied.
//
// Gathered x (kFprop, kWgrad): with `gather_rows` set, row i of x is row gather_rows[i] of
// `input` (an MoE layer's tokens read in expert order through the routing map, so that the
// permuted copy is never written). Hopper's TMA has no gather mode, so the producer warpgroup's
// four warps load those rows with one TMA load per row and 128-byte box instead
// (grouped_gemm_sm90_kernel.cuh).
//
// Scattered y / dx (kFprop, kDgrad): with `scatter_rows` set, row i of the product is added into
// row scatter_rows[i] of the output (an MoE layer's unpermute in fc2's forward, or its
// permutation's backward in fc1's dgrad, so that the expert-ordered rows are never written). The
// epilogue adds each row in L2 (red.add of eight 16-bit values, one rounding per add): a target
// that starts at +0.0 and receives at most two rows ends with their sum rounded once, whatever
// their order (+0.0 + a is a, or +0.0 for a = -0.0 as in an fp32 sum from +0.0; and a + b is
// b + a), which is what top-1 and top-2 routing give.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

// Every tensor starts on a 16-byte boundary and equally spaced groups are a multiple of 16 bytes
// apart (TMA's requirements; ops checks them before choosing this kernel).
struct Sm90GemmParams {
  GemmKind kind = GemmKind::kFprop;
  ScalarType input_type = ScalarType::kBFloat16;   // x, W, dy, bias: bf16 or fp16
  ScalarType output_type = ScalarType::kBFloat16;  // kWgrad: input_type or fp32; else input_type
  int num_groups = 0;
  int64_t rows = 0;  // rows of x / dy / y / dx (the buffers; may exceed the split sum)
  int64_t n = 0;     // out_features
  int64_t k = 0;     // in_features
  const void* m_splits = nullptr;  // device, num_groups integers
  bool splits_int32 = false;       // else int64

  const void* input = nullptr;  // x  [rows, k], or the gathered rows' source (kFprop, kWgrad)
  // Device, `rows` integers, each a row of `input` (unchecked; ops checks the map's shape): x[i] =
  // input[gather_rows[i]]. Null: x is `input` itself.
  const void* gather_rows = nullptr;
  bool gather_rows_int32 = false;     // else int64
  int64_t gather_source_rows = 0;     // rows of `input` when gathering (entries outside read zeros)
  const void* grad_output = nullptr;  // dy [rows, n]       (kDgrad, kWgrad)
  void* output = nullptr;             // y / dx [rows, ·]   (kFprop, kDgrad)
  // Scattered rows (kFprop, kDgrad): device, `rows` integers (unchecked; ops checks the map's
  // shape). Row i of the product is added to row scatter_rows[i] of `output`, which then has
  // scatter_target_rows rows and which the launch zeroes first, instead of being stored at row i;
  // entries -1 or outside the output are not added. Null: row i is stored at row i.
  const void* scatter_rows = nullptr;
  bool scatter_rows_int32 = false;  // else int64
  int64_t scatter_target_rows = 0;
  // W_g [n, k] (kFprop, kDgrad). Equally spaced weights are read through one 3-D tensor map; others
  // through `weight_maps`, a device array of G tensor maps from encode_weight_maps().
  GroupAddress weight;
  const void* weight_maps = nullptr;
  GroupAddress bias;            // b_g [n] (kFprop; base and table null = no bias)
  GroupAddress weight_grad;     // dW_g [n, k] (kWgrad)
  bool accumulate = false;      // kWgrad: dW_g += product (fp32 only); empty groups left untouched
  int* tile_counter = nullptr;  // kWgrad: device workspace for one int; the launch zeroes it
};

// Limits of this kernel; ops checks them before choosing it.
inline constexpr int kSm90MaxGroups = 1024;         // per-group offsets live in shared memory
inline constexpr int64_t kSm90FeatureMultiple = 8;  // TMA needs 16-byte row strides

// True when the current device runs the sm_90a code compiled into this library.
bool sm90_grouped_gemm_available();

// The G tensor maps (128 bytes each) for separately allocated weights of `kind` (fprop or dgrad);
// the caller copies them to device memory that outlives every launch using them.
std::vector<uint8_t> encode_weight_maps(GemmKind kind, ScalarType input_type, int64_t n, int64_t k,
                                        const std::vector<const void*>& weights);

void launch_grouped_gemm_sm90(const Sm90GemmParams& params, cudaStream_t stream);

// FP8 products on the same kernel (ops/grouped_gemm_fp8.h). wgmma reads FP8 only K-major, so both
// operands are split_quantize copies (kernels/split_quantize.h) that are contiguous along the
// reduction. With per-tensor scalings every group has one scale_inv per operand, applied to its
// fp32 accumulators before the bias and the store (sa_g·sb_g below); with block scales each
// 128-deep block of the reduction is summed apart and multiplied by its rows' and columns' scales
// before it is added (A 1x128; B 128x128 in fprop, 1x128 in wgrad: the products of
// BlockScaling's default blocks):
//
//   kFprop  y[rows of g, n] = sa_g·sb_g · a[rows of g, k] · b_g[n, k]ᵀ (+ bias_g[n])
//           a: the rowwise copy of x (fprop) or dy (dgrad); b: [G, n, k], the weights' rowwise
//           copy (fprop) or their columnwise copy (dgrad, as this product with n = in_features
//           and k = out_features)
//   kWgrad  dW_g[n, k] = sa_g·sb_g · a_g[n, r16(m_g)] · b_g[k, r16(m_g)]ᵀ (+= dW_g)
//           a, b: the columnwise copies of dy [rows, n] and x [rows, k]; group g's block starts
//           at element n·Σ_{h<g} r16(m_h) (resp. k·…), in split_quantize's clamping of the sizes
//
// A kWgrad launch first writes two tensor maps per group into `group_maps` on the device (the
// blocks' sizes are known there only), so device split sizes need no host copy and the call can
// be captured in a CUDA graph.
struct Sm90Fp8GemmParams {
  GemmKind kind = GemmKind::kFprop;  // kFprop or kWgrad
  Fp8Format a_format = Fp8Format::kE4M3;
  Fp8Format b_format = Fp8Format::kE4M3;
  ScalarType output_type = ScalarType::kBFloat16;  // y / dW (and bias): any of the three
  int num_groups = 0;
  int64_t rows = 0;                // rows of the quantized tensors (x, dy, y)
  int64_t n = 0;                   // kFprop: output columns; kWgrad: dW rows
  int64_t k = 0;                   // kFprop: reduction; kWgrad: dW columns
  const void* m_splits = nullptr;  // device, num_groups integers
  bool splits_int32 = false;
  const void* a = nullptr;
  const void* b = nullptr;
  // Per-tensor scalings (kCurrent, kDelayed): [num_groups] each. Block scales: split_quantize's
  // block-scale buffer of the copy each operand is (its layout in kernels/split_quantize.h),
  // 16-byte aligned, of at most INT_MAX elements (the kernel's offsets are 32-bit; ops checks).
  QuantizeScaling a_scaling = QuantizeScaling::kDelayed;
  QuantizeScaling b_scaling = QuantizeScaling::kDelayed;
  const float* a_scale_inv = nullptr;
  const float* b_scale_inv = nullptr;
  void* output = nullptr;    // kFprop: y [rows, n]
  GroupAddress bias;         // kFprop: b_g [n] of output_type (empty: no bias)
  GroupAddress weight_grad;  // kWgrad: dW_g [n, k]
  bool accumulate = false;   // kWgrad: dW_g += product (fp32 only)
  // Split accumulation (TE's use_split_accumulator): each 128-deep block's sum added to fp32
  // accumulators (TE's choice for dgrad and wgrad; measured 1.1-1.2x the time). false: the tensor
  // cores' accumulation across the whole reduction (cuBLASLt's fast accumulation, TE's choice for
  // fprop). Block scales always split.
  bool split_accumulator = true;
  int* tile_counter = nullptr;  // kWgrad: device workspace for one int
  void* group_maps = nullptr;   // kWgrad: device workspace of kSm90Fp8MapBytes per group
};

// The FP8 kWgrad workspace per group (two 128-byte tensor maps); its start must be 128-byte
// aligned.
inline constexpr size_t kSm90Fp8MapBytes = 256;

void launch_grouped_gemm_sm90_fp8(const Sm90Fp8GemmParams& params, cudaStream_t stream);

}  // namespace torchmoe::kernels
