#pragma once
// The router's logits, logits = x · Wᵀ in fp32 (fp64 for fp64 input), and their gradients.
//
// A router is a tiny GEMM ([T, H] × [H, E], E ≤ a few hundred) whose logits must be fp32 for the
// softmax and top-k. Casting 16-bit x and W to fp32 first costs a copy of x and runs the GEMM on
// CUDA cores (qwen3-30b-a3b's router: three fp32 GEMMs forward and backward took ~0.35 ms of a
// 6.4 ms MoE layer). 16-bit x and W are exact in fp32 and so are their products, so a tensor-core
// GEMM of the 16-bit operands with fp32 accumulation and fp32 output computes the same logits.
//
// The backward's fp32 grad_logits is not a bf16 value: it is split into hi + lo, both bf16
// (hi = its rounding, lo = the rounding of the remainder; together ~16 significant bits, against
// the 8 of the bf16 results), and each product is taken with both halves on tensor cores:
//   grad_x = [hi | lo] · [W; W]          (one GEMM over 2E, fp32 accumulation, x's dtype out)
//   grad_W = hiᵀ · x + loᵀ · x           (fp32, W's dtype out)
// A softmax router's gradient rows sum to zero, so grad_x cancels: with hi alone, 8 071 of the
// 66 600 grad_x elements of a [333, 200] × 24-expert case (test/ops/test_router.cpp) were off by
// more than 2 units in the last place of bf16 (plus a small absolute floor); with hi + lo none.
// fp16 operands take the cast path backward: the halves of small gradients fall below fp16's
// normal range.
// Otherwise (the CPU, fp32 or fp64 operands, mixed dtypes) both are cast to the logits' dtype.

#include <ATen/core/Tensor.h>

namespace torchmoe::ops {

// x [T, H], weight [E, H] of floating dtypes on one device -> logits [T, E] fp32 (fp64 when
// either is fp64).
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight);

struct RouterLogitsGrads {
  at::Tensor grad_x;       // [T, H] in x's dtype (undefined when not asked for)
  at::Tensor grad_weight;  // [E, H] in weight's dtype (undefined when not asked for)
};

RouterLogitsGrads router_logits_backward(const at::Tensor& grad_logits, const at::Tensor& x,
                                         const at::Tensor& weight, bool need_grad_x,
                                         bool need_grad_weight);

}  // namespace torchmoe::ops
