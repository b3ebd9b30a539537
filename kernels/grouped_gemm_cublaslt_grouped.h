#pragma once
// The three products of a grouped linear layer as one cuBLASLt grouped matmul each
// (CUBLASLT_BATCH_MODE_GROUPED: per-group pointers, rows, columns and leading dimensions in device
// arrays), with the split sizes read on the device: no host sync, CUDA-graph capturable.
//
// The grouped matmul appeared in cuBLAS 13.3 (Hopper: 13.4) and TransformerEngine reports
// CUDA-graph replay deadlocks in it up to 13.7, so this backend needs a loaded cuBLASLt >= 13.8.
// The library is built against whatever cuBLAS headers the toolkit has (13.1 lacks the grouped
// API): the grouped entry point is looked up at run time in the cuBLASLt the process loaded, so
// the same build takes this path once a newer cuBLASLt is loaded and refuses it otherwise.
//
// Per call: a setup kernel turns the split sizes into the groups' pointers and shapes (clamped to
// the buffers as in grouped_gemm_sm90.h), then one cublasLtMatmul runs every group. Row-major
// shapes, as in grouped_gemm_cublaslt.h (cuBLAS sees each matrix transposed):
//
//   kFprop  y[rows of g, n]  = x[rows of g, k] · W_g[n, k]ᵀ   cuBLAS TN   (+ b_g: see below)
//   kDgrad  dx[rows of g, k] = dy[rows of g, n] · W_g[n, k]   cuBLAS NN
//   kWgrad  dW_g[n, k]       = dy[rows of g, n]ᵀ · x[rows of g, k]  (+= dW_g)   cuBLAS NT
//
// With a bias the matmul writes an fp32 product and a second kernel adds b_g and rounds once.
//
// Kernel layer: raw pointers, sizes and a stream. Validation and the choice of this backend:
// ops/grouped_gemm.cpp.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

// LoadedCublasLt::grouped needs this version (13.8.0) or newer and the grouped entry point.
inline constexpr size_t kCublasLtGroupedMinVersion = 130800;

// The cuBLASLt this process loaded (kernels/types.h), looked up once per process.
const LoadedCublasLt& loaded_cublaslt();

// Every matrix starts on a 16-byte boundary and n, k are multiples of 8 (ops checks both).
struct CublasLtGroupedParams {
  GemmKind kind = GemmKind::kFprop;
  ScalarType input_type = ScalarType::kBFloat16;   // x, W, dy, bias
  ScalarType output_type = ScalarType::kBFloat16;  // kWgrad: input_type or fp32; else input_type
  int num_groups = 0;
  int64_t rows = 0;                // rows of x / dy / y / dx (may exceed the split sum)
  int64_t n = 0;                   // out_features
  int64_t k = 0;                   // in_features
  const void* m_splits = nullptr;  // device, num_groups integers
  bool splits_int32 = false;       // else int64
  bool allow_tf32 = false;         // fp32 operands: TF32 tensor cores

  const void* input = nullptr;        // x  [rows, k]      (kFprop, kWgrad)
  const void* grad_output = nullptr;  // dy [rows, n]      (kDgrad, kWgrad)
  void* output = nullptr;             // y / dx [rows, ·]  (kFprop, kDgrad)
  GroupAddress weight;                // W_g [n, k]        (kFprop, kDgrad)
  GroupAddress bias;                  // b_g [n]           (kFprop; empty = no bias)
  GroupAddress weight_grad;           // dW_g [n, k]       (kWgrad)
  bool accumulate = false;            // kWgrad: dW_g += product (fp32); empty groups untouched
};

// Device memory the call needs besides its operands, from the caller's stream-ordered allocator.
struct CublasLtGroupedEnv {
  cublasLtHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  void* arrays = nullptr;     // cublaslt_grouped_array_bytes(num_groups) bytes, 16-byte aligned
  void* workspace = nullptr;  // 256-byte aligned (cuBLASLt refuses others with INVALID_VALUE)
  size_t workspace_bytes = 0;
  float* fprop_product = nullptr;  // kFprop with a bias: [rows, n] fp32 scratch
};

size_t cublaslt_grouped_array_bytes(int num_groups);

// Throws c10::Error when cuBLASLt has no algorithm for the call (e.g. a dtype it does not group).
void run_grouped_gemm_cublaslt_grouped(const CublasLtGroupedParams& params,
                                       const CublasLtGroupedEnv& env);

// FP8 products with one scale per group and operand (split_quantize's per-tensor scalings), as
// one grouped matmul: the TN products of grouped_gemm_cublaslt.h's FP8 section, C[m, n] =
// A[m, kk] · B[n, kk]ᵀ per group, with cuBLASLt's PER_BATCH_SCALAR_32F scale mode (a device array
// of one scale pointer per group and operand; Hopper needs cuBLAS >= 13.5, below this backend's
// 13.8). Operands in split_quantize's layouts (kernels/split_quantize.h):
//
//   kind    A (ours)                    B (ours)                      C             kk
//   kFprop  x rowwise, rows of g        W rowwise, rows g·n ..        y rows of g   k
//   kDgrad  dy rowwise, rows of g       W columnwise, at k·n·g        dx rows of g  n
//   kWgrad  dy columnwise, block of g   x columnwise, block of g      dW_g          r16(m_g)
//
// (the columnwise block of split g starts at width·Σ_{h<g} r16(m_h)). Block scales are not
// grouped here: ops runs them on per-group matmuls.
struct CublasLtGroupedFp8Params {
  GemmKind kind = GemmKind::kFprop;
  Fp8Format a_format = Fp8Format::kE4M3, b_format = Fp8Format::kE4M3;  // not both e5m2
  ScalarType output_type = ScalarType::kBFloat16;                      // fp32 to accumulate
  int num_groups = 0;
  int64_t rows = 0;  // rows of x / dy / y / dx (may exceed the split sum)
  int64_t n = 0;     // out_features
  int64_t k = 0;     // in_features, a multiple of 16 (as n)
  const void* m_splits = nullptr;
  bool splits_int32 = false;

  const void* a = nullptr;
  const void* b = nullptr;
  const float* a_scale_inv = nullptr;  // [G] device
  const float* b_scale_inv = nullptr;  // [G] device
  void* output = nullptr;              // y / dx [rows, ·] (kFprop, kDgrad)
  GroupAddress bias;                   // b_g [n] of output_type (kFprop; empty = no bias)
  GroupAddress weight_grad;            // dW_g [n, k] (kWgrad)
  bool accumulate = false;             // kWgrad: dW_g += product (fp32); empty groups untouched
  // Split accumulation (TE's use_split_accumulator); false: cuBLASLt's fast accumulation.
  bool split_accumulator = true;
};

void run_grouped_gemm_cublaslt_grouped_fp8(const CublasLtGroupedFp8Params& params,
                                           const CublasLtGroupedEnv& env);

}  // namespace torchmoe::kernels
