#pragma once
// FP8 grouped linear products: the three GEMMs of a grouped linear layer over operands that
// split_quantize made (ops/quantize.h), each on the backend its plan chose for it
// (plan_grouped_gemms with Fp8GemmOptions): the sm90 kernel (kernels/grouped_gemm_sm90.h) or the
// cuBLASLt grouped matmul with device sizes, or per-group cuBLASLt FP8 matmuls with host sizes,
// accumulated as the plan's options say. Validation, allocation and the kernel call; the TN
// layout of every product and which copy each reads are in kernels/grouped_gemm_cublaslt.h and
// kernels/grouped_gemm_sm90.h, the numerics in docs/fp8.md.
//
// The plan must be an FP8 plan: CUDA, in_features and out_features multiples of 16. Every operand
// must be quantized as the plan's options say for its tensor (format and scaling): the plan chose
// each product's backend for those. Split sizes are any non-negative values: wgrad reduces over
// each split's columnwise block, which split_quantize pads with zeros to a multiple of 16 rows.
// Device sizes are clamped to the rows as the grouped GEMM ops clamp them where the device reads
// them; a product that runs per group reads the plan's host sizes, which planning checked. Two
// block-scaled operands of one product must not both be 128×128 (cuBLASLt has no such kernel),
// and e5m2 × e5m2 is refused.

#include <ATen/core/Tensor.h>

#include "torchmoe/ops/grouped_gemm.h"
#include "torchmoe/ops/quantize.h"

namespace torchmoe::ops {

// y[rows of g] = x_g · W_gᵀ (+ b_g), dequantized, in output_dtype. input: the rowwise copy of the
// [rows, k] input split by the plan's sizes; weights: quantize_weights' rowwise copy
// (ops/quantize.h); biases: none or G × [n] of output_dtype.
at::Tensor grouped_linear_forward_fp8(const GemmPlan& plan, const SplitQuantized& input,
                                      const SplitQuantized& weights, const GroupedTensors& biases,
                                      at::ScalarType output_dtype);

// dx[rows of g] = dy_g · W_g in output_dtype. grad_output: the rowwise copy of dy [rows, n];
// weights: quantize_weights' columnwise copy.
at::Tensor grouped_linear_dgrad_fp8(const GemmPlan& plan, const SplitQuantized& grad_output,
                                    const SplitQuantized& weights, at::ScalarType output_dtype);

// dW_g = dy_gᵀ · x_g from the columnwise copies of dy [rows, n] and x [rows, k], into
// weight_grads_out (G × [n, k], any of float32/float16/bfloat16): overwritten, or added to when
// `accumulate` (float32 only; an empty split then leaves its buffer as it is, else zeroes it).
void grouped_linear_wgrad_fp8(const GemmPlan& plan, const SplitQuantized& input,
                              const SplitQuantized& grad_output,
                              const GroupedTensors& weight_grads_out, bool accumulate);

}  // namespace torchmoe::ops
