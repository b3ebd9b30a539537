#pragma once
// Per-group cuBLASLt GEMMs for the three products of a grouped linear layer, in 16/32-bit floats
// or FP8.
//
// Kernel layer: raw pointers, sizes and streams only. Validation, allocation and the choice of this
// backend happen in ops/grouped_gemm.cpp.
//
// Row-major shapes, group g holding `rows` rows (any value, including 0):
//
//   kFprop  y[rows,n]  = x[rows,k] · W[n,k]ᵀ (+ bias[n])          cuBLAS TN
//   kDgrad  dx[rows,k] = dy[rows,n] · W[n,k]                        cuBLAS NN
//   kWgrad  dW[n,k]    = dy[rows,n]ᵀ · x[rows,k]   (+= dW)           cuBLAS NT
//           db[n]      = Σ_rows dy                  (optional, fused as the BGRADB epilogue)
//
// cuBLAS is column-major, so every row-major matrix is passed as its transpose; the "TN/NN/NT"
// names above are the cuBLAS operations that result.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

// The cuBLAS data type of an element type (both cuBLASLt backends).
inline cudaDataType_t cuda_type(ScalarType type) {
  switch (type) {
    case ScalarType::kFloat32:
      return CUDA_R_32F;
    case ScalarType::kFloat16:
      return CUDA_R_16F;
    case ScalarType::kBFloat16:
      return CUDA_R_16BF;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ScalarType");
}

// One group's operands. Which pointers a kind reads or writes:
//   kFprop: input, weight -> output (y), bias (may be null)
//   kDgrad: grad_output, weight -> output (dx)
//   kWgrad: input, grad_output -> output (dW), bias_grad (may be null)
// All matrices are dense row-major with the leading dimension equal to their width.
struct GemmGroup {
  int64_t rows = 0;
  const void* input = nullptr;        // x  [rows, k]
  const void* weight = nullptr;       // W  [n, k]
  const void* grad_output = nullptr;  // dy [rows, n]
  void* output = nullptr;
  const void* bias = nullptr;  // [n], element type = input_type
  void* bias_grad = nullptr;   // [n], element type = input_type
};

struct GroupedGemmParams {
  GemmKind kind = GemmKind::kFprop;
  int64_t n = 0;                                  // out_features
  int64_t k = 0;                                  // in_features
  ScalarType input_type = ScalarType::kFloat32;   // x, W, dy, bias
  ScalarType output_type = ScalarType::kFloat32;  // y, dx, dW (fp32 for main-grad accumulation)
  bool accumulate = false;                        // kWgrad only: dW += result (beta = 1)
  bool allow_tf32 = false;                        // fp32 inputs: use TF32 tensor cores
  std::vector<GemmGroup> groups;
};

// Where and with what the GEMMs run. Inputs must be ready on `stream`; outputs are ready on
// `stream` when the call returns (side streams fork from and join back into it with events).
struct CublasLtEnv {
  cublasLtHandle_t handle = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> side_streams;  // groups are spread round-robin over stream + these
  void* workspace = nullptr;               // split evenly among the streams in use
  size_t workspace_bytes = 0;
};

struct GroupedGemmResult {
  // kWgrad with bias_grad pointers: true when every bias gradient was produced by the GEMM epilogue
  // (or zero-filled for an empty group); false when the caller must reduce dy itself.
  bool bias_grad_computed = false;
};

GroupedGemmResult run_grouped_gemm_cublaslt(const GroupedGemmParams& params,
                                            const CublasLtEnv& env);

// FP8 products. Hopper's FP8 tensor cores take only the TN layout: both operands K-major. So
// every product is, per group, in row-major terms
//
//   C[m, n] = (A[m, kk] · B[n, kk]ᵀ) · dequant  (+ bias[n])  (+ C when accumulating)
//
// with A and B the split-quantize copies (kernels/split_quantize.h) that are K-major for it:
//
//   fprop  y[rows, n]  = x[rows, k] · W[n, k]ᵀ          A = x rowwise,  B = W rowwise,  kk = k
//   dgrad  dx[rows, k] = dy[rows, n] · (Wᵀ[k, n])ᵀ      A = dy rowwise, B = W columnwise, kk = n
//   wgrad  dW[n, k]    = dyᵀ[n, r] · (xᵀ[k, r])ᵀ        A = dy columnwise, B = x columnwise,
//                                                       kk = r = rows rounded up to 16 (zeros)
//
// dequant is the operands' scale_inv: one float each (per-tensor scalings), or their block scales
// (kBlock1x128: cuBLASLt's VEC128_32F, kBlock128x128: BLK128x128_32F, in split_quantize.h's
// layouts). Everything in fp32, one rounding to the output type.
struct Fp8GemmGroup {
  int64_t m = 0;                       // rows of A and C
  int64_t kk = 0;                      // the reduced dimension (0: C is zero, or kept)
  const void* a = nullptr;             // [m, kk] fp8, ld kk
  const void* b = nullptr;             // [n, kk] fp8, ld kk
  const float* a_scale_inv = nullptr;  // device: one float, or this group's block scales
  const float* b_scale_inv = nullptr;
  void* output = nullptr;      // C [m, n] row-major, ld n
  const void* bias = nullptr;  // [n] of the output type, or null
};

struct Fp8GroupedGemmParams {
  int64_t n = 0;
  Fp8Format a_format = Fp8Format::kE4M3, b_format = Fp8Format::kE4M3;  // not both e5m2
  QuantizeScaling a_scaling = QuantizeScaling::kCurrent, b_scaling = QuantizeScaling::kCurrent;
  ScalarType output_type = ScalarType::kBFloat16;
  bool accumulate = false;  // C += product (fp32 C, for main-grad)
  // Split accumulation (TE's use_split_accumulator): partial sums promoted to fp32 every few
  // k-steps, TE's choice for dgrad/wgrad. false: cuBLASLt's FP8 fast accumulation (partial sums
  // kept in the tensor cores), TE's choice for fprop. Per-tensor scalings only: block-scaled
  // products always split.
  bool split_accumulator = true;
  std::vector<Fp8GemmGroup> groups;
};

struct Fp8GemmResult {
  // With bias pointers: true when the epilogue added every bias; false when cuBLASLt has no
  // algorithm with the bias epilogue for these types and the caller must add it.
  bool bias_applied = false;
};

Fp8GemmResult run_grouped_gemm_cublaslt_fp8(const Fp8GroupedGemmParams& params,
                                            const CublasLtEnv& env);

}  // namespace torchmoe::kernels
