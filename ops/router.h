#pragma once
// The router's ops: its logits, logits = x · Wᵀ in fp32 (fp64 for fp64 input), and their
// gradients; then scoring and top-k selection with the inputs of its losses, and their gradient.
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
//   grad_W = hiᵀ · x + loᵀ · x           (one GEMM [hi | lo]ᵀ · x, its two fp32 halves added,
//                                         W's dtype out)
// The split is one launch writing [hi | lo] and, for grad_x, [W; W] (kernels/router.h), not five
// ATen ops and a concatenation; or none, when router_topk_backward's launch wrote them with the
// gradient (RouterTopKLinks::split_weight).
// A softmax router's gradient rows sum to zero, so grad_x cancels: with hi alone, 8 071 of the
// 66 600 grad_x elements of a [333, 200] × 24-expert case (test/ops/test_router.cpp) were off by
// more than 2 units in the last place of bf16 (plus a small absolute floor); with hi + lo none.
// fp16 operands take the cast path backward: the halves of small gradients fall below fp16's
// normal range.
// Otherwise (the CPU, fp32 or fp64 operands, mixed dtypes) both are cast to the logits' dtype.

#include <ATen/core/Tensor.h>

namespace torchmoe::ops {

// x [T, H], weight [E, H] of floating dtypes on one device -> logits [T, E] fp32 (fp64 when
// either is fp64). bias: undefined, or [E] of a floating dtype on that device (GPT-OSS's router),
// added to the logits in their dtype.
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight,
                         const at::Tensor& bias = {});

// x's gradient as a product still to be taken, grad_x = lhs · rhs: [hi | lo] and [W; W] on the
// bf16 tensor-core path (written by the split's one launch), else grad_logits and W in the
// logits' dtype. A deferred grad_x (autograd::ForkFunction adds it into another branch's gradient
// later) keeps these rather than grad_logits, so the split is made once for both gradients.
struct RouterGradXProduct {
  at::Tensor lhs;                         // [T, 2E] or [T, E]
  at::Tensor rhs;                         // [2E, H] or [E, H]
  at::ScalarType out_dtype = at::kFloat;  // x's dtype
};

struct RouterLogitsGrads {
  at::Tensor grad_x;                  // [T, H] in x's dtype (with RouterGradX::kNow)
  at::Tensor grad_weight;             // [E, H] in weight's dtype (undefined when not asked for)
  at::Tensor grad_bias;               // [E] in the bias's dtype (undefined when not asked for)
  RouterGradXProduct grad_x_product;  // with RouterGradX::kDeferred, for router_grad_x
};

enum class RouterGradX {
  kNone,      // x's gradient not needed
  kNow,       // returned as grad_x
  kDeferred,  // returned as grad_x_product
};

// Whether router_logits_backward multiplies grad_logits as bf16 halves [hi | lo] (bf16 x and
// weight on CUDA): the case where it takes a split made by router_topk_backward.
bool router_logits_backward_splits(const at::Tensor& x, const at::Tensor& weight);

// With `split` (router_topk_backward's split of this very grad_logits, made by its launch), the
// products take it instead of splitting grad_logits again.
// bias: the forward's bias when its gradient is needed (Σ over tokens of grad_logits), else
// undefined.
RouterLogitsGrads router_logits_backward(const at::Tensor& grad_logits, const at::Tensor& x,
                                         const at::Tensor& weight, RouterGradX grad_x,
                                         bool need_grad_weight,
                                         const RouterGradXProduct& split = {},
                                         const at::Tensor& bias = {});

// grad_x = product.lhs · product.rhs, in product.out_dtype; with an addend ([T, H] in that dtype,
// contiguous: another branch's gradient of x), the addend plus it. Where the product's operands
// have x's dtype (the bf16 tensor-core path, or fp32/fp64 x with the logits' dtype) the GEMM adds
// it (beta = 1, in place: one rounding and no add launch): the addend is overwritten, so the
// caller must own it.
at::Tensor router_grad_x(const RouterGradXProduct& product, const at::Tensor& grad_x_addend = {});

// Scoring and top-k from the logits (the formulas: kernels/router.h): one kernel each way on CUDA
// for fp32 logits, E <= 1024 experts and k <= 32, else ATen ops (the CPU reference, fp64 logits,
// more experts or choices).
struct RouterScoring {
  int64_t topk = 1;
  bool sigmoid = false;    // sigmoid scores, else softmax
  bool normalize = false;  // probs divided by their sum over the k choices
  // Group-limited choice (DeepSeek-V3): the E experts form num_groups groups of E / num_groups
  // consecutive experts; a token ranks the groups by the sum of their two highest choice scores
  // (score + expert bias), keeps the topk_groups best (ties: the lower group) and chooses its k
  // experts among theirs. num_groups 1: every expert.
  int64_t num_groups = 1;
  int64_t topk_groups = 1;
  // probs multiplied by this after any normalisation (DeepSeek-V3's routed_scaling_factor).
  double scale = 1.0;
  bool aux = false;  // also return the aux loss's input: the scores summed over tokens
  // aux_loss = aux_loss_scale · Σ_e aux_sums[e] · counts[e] (> 0 needs aux): the load-balancing
  // loss when this call's counts are the batch's (no process group); 0 when the scale is 0.
  double aux_loss_scale = 0.0;
  // Also return z_loss = z_loss_scale · Σ_t lse[t]² (0 when the scale is 0): the router z-loss
  // when this call's tokens are the batch's (no process group).
  bool z_loss = false;
  double z_loss_scale = 0.0;
};

struct RouterTopK {
  at::Tensor indices;   // [T, k] int64, descending score (+ bias)
  at::Tensor probs;     // [T, k] in the logits' dtype
  at::Tensor aux_sums;  // [E]: Σ over tokens of the softmax scores, or of the sigmoid scores over
                        // their row sum (T < 2^31); [0] when not asked for
  at::Tensor lse;       // [T] logsumexp of each row of logits
  at::Tensor counts;    // [E] int64 tokens choosing each expert
  at::Tensor aux_loss;  // [] in the logits' dtype (0 when aux_loss_scale is 0)
  at::Tensor z_loss;    // [] in the logits' dtype with z_loss, else undefined
};

// logits [T, E] fp32 or fp64; expert_bias undefined or [E] fp32 (shifts the choice, not probs).
RouterTopK router_topk(const at::Tensor& logits, const at::Tensor& expert_bias,
                       const RouterScoring& scoring);

// What router_topk_backward may also read and write for the functions around it (the links of
// autograd/router_function.h), each part optional.
struct RouterTopKLinks {
  // probs' gradient in a permutation's row order, [N] in the logits' dtype, with the
  // permutation's row_map [T, k] (each slot's row in [0, N), or -1 for none: trusted, as the
  // routing map wrote it): added to grad_probs, so that the permutation's backward needs no
  // launch of its own.
  at::Tensor grad_probs_rows;
  at::Tensor probs_row_map;
  // The router's bf16 weight [E, H]: on the kernel's path with bf16 x, the same launch also
  // writes router_logits_backward's split of grad_logits ([hi | lo] and [W; W]).
  at::Tensor split_weight;
};

struct RouterTopKGrads {
  at::Tensor grad_logits;    // [T, E]
  RouterGradXProduct split;  // with links.split_weight on the kernel's path, else undefined
};

// grad_logits [T, E] from the gradients of probs [T, k], aux_sums [E], lse [T], aux_loss [] and
// z_loss [] (each undefined when none); grad_aux_loss needs the forward's counts.
RouterTopKGrads router_topk_backward(const at::Tensor& logits, const at::Tensor& indices,
                                     const at::Tensor& probs, const at::Tensor& grad_probs,
                                     const at::Tensor& grad_aux, const at::Tensor& grad_lse,
                                     const RouterScoring& scoring, const at::Tensor& counts = {},
                                     const at::Tensor& grad_aux_loss = {},
                                     const at::Tensor& grad_z_loss = {},
                                     const RouterTopKLinks& links = {});

}  // namespace torchmoe::ops
