#pragma once
// The top-k router's scoring in one pass per direction, from its fp32 logits.
//
// Kernel layer: raw pointers, sizes and a stream. Validation, allocation and dispatch:
// ops/router.cpp. Per token t (row of logits [T, E]):
//
//   lse[t]         = log Σ_e exp(logits[t, e])                       (the z-loss's input)
//   s[t, e]        = softmax(logits[t])_e, or sigmoid(logits[t, e])
//   c[t, e]        = s[t, e] + bias[e]                                (the choice score)
//   groups[t]      = with G = num_groups > 1: the topk_groups groups (E / G consecutive experts
//                    each) of highest c[t, first] + c[t, second], the group's two highest
//                    (ties: the lower group first); with G = 1 every expert
//   indices[t, :]  = the k experts of highest c[t, e] in those groups, in descending order (ties:
//                    the lower expert first)
//   probs[t, j]    = scale · s[t, indices[t, j]], divided by Σ_j of them (+1e-20) when normalized
//   aux[t, e]      = s[t, e], or for sigmoid s[t, e] / (Σ_e s[t, e] + 1e-20)
//   aux_sums[e]    = Σ_t aux[t, e]                 (optional: the load-balancing loss's input)
//   counts[e]      = number of tokens choosing e                                     (int64)
//   aux_loss       = aux_loss_scale · Σ_e aux_sums[e] · counts[e]   (optional: the load-balancing
//                    loss when the counts are this launch's own; 0 without aux_sums)
//   z_loss         = z_loss_scale · Σ_t lse[t]²                      (optional: the router z-loss
//                    when the tokens are the batch's; 0 when z_loss_scale is 0)
//
// The backward takes the gradients of probs, aux_sums, aux_loss, lse and z_loss (each optional) and
// writes grad_logits [T, E]. One warp per token, the row kept in registers: E ≤ kRouterMaxExperts
// and k ≤ kRouterMaxTopK (lane j keeps choice j).
//
// aux_sums is summed in fixed point, each term a multiple of 2^-32 (exact for terms of at least
// 2^-9, whose fp32 spacing that is; within 2^-33 below), so that integer atomics add the blocks'
// sums in any order to the same bits: deterministic, in the same launch (the [T, E] scores are
// never written, and no reduction launch follows); the block that finishes last converts them. A
// NaN term (a NaN logit makes its whole row of terms NaN) makes every sum NaN. The counts take the
// same path: each block counts its tokens' choices in shared memory and adds them to the launch's
// sums once. Σ lse² is summed in double in a fixed order for a given grid (each warp's tokens, the
// block's warps, then the blocks' words in the scratch): the same bits run to run on one device.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchmoe::kernels {

constexpr int64_t kRouterMaxExperts = 1024;
constexpr int64_t kRouterMaxTopK = 32;
// Group-limited choice keeps a group's score on lane g of the token's warp.
constexpr int64_t kRouterMaxGroups = 32;
// Normalisations divide by Σ + kRouterNormEps (a row of zero scores stays finite); the ATen path
// (ops/router.cpp) uses the same.
constexpr double kRouterNormEps = 1e-20;
// aux_sums count T < 2^31 terms in [0, 1] as multiples of 2^-32 in int64.
constexpr int64_t kRouterMaxAuxTokens = int64_t{1} << 31;
// Copies of the forward's global sums in its scratch: the blocks' atomics spread over them.
constexpr int64_t kRouterSumReplicas = 8;

struct RouterParams {
  int64_t tokens = 0;   // T
  int64_t experts = 0;  // E ≤ kRouterMaxExperts
  int64_t topk = 0;     // k ≤ min(E, kRouterMaxTopK)
  bool sigmoid = false;
  bool normalize = false;
  int64_t num_groups = 1;   // G dividing E, each group at least 2 experts; G ≤ kRouterMaxGroups
  int64_t topk_groups = 1;  // in [1, G]
  float scale = 1.0f;       // probs' factor
  const float* logits = nullptr;       // [T, E]
  const float* expert_bias = nullptr;  // [E] or null (selection only)

  // forward outputs
  int64_t* indices = nullptr;  // [T, k]
  float* probs = nullptr;      // [T, k]
  float* aux_sums = nullptr;   // [E] or null; T < 2^31 (the fixed-point sums' range)
  int64_t* scratch = nullptr;  // router_forward_scratch_words(params), zeroed by the launch: the
                               // counts' and sums' replicas, a NaN flag, the finished blocks,
                               // each block's Σ lse²
  float* lse = nullptr;        // [T]
  int64_t* counts = nullptr;   // [E]
  float* aux_loss = nullptr;   // [] or null (0 without aux_sums)
  double aux_loss_scale = 0.0;
  float* z_loss = nullptr;  // [] or null
  double z_loss_scale = 0.0;

  // backward: the forward's indices and probs, the output gradients (each may be null), and
  // grad_logits [T, E] (written)
  const int64_t* saved_indices = nullptr;  // [T, k]
  const float* saved_probs = nullptr;      // [T, k]
  const float* grad_probs = nullptr;       // [T, k]
  // probs' gradient in a permutation's row order, read through probs_row_map [T, k] (each slot's
  // row, -1 for none: no gradient) and added to grad_probs': the permutation's backward needs no
  // launch of its own. Both null or both set.
  const float* grad_probs_rows = nullptr;  // [N]
  const int64_t* probs_row_map = nullptr;  // [T, k]
  const float* grad_aux = nullptr;         // [E]: of aux_sums
  const float* grad_lse = nullptr;         // [T]
  const float* grad_aux_loss = nullptr;    // []: with saved_counts, the forward's counts [E]
  const int64_t* saved_counts = nullptr;
  const float* grad_z_loss = nullptr;  // []: with z_loss_scale
  float* grad_logits = nullptr;
  // Optional, the logits' backward's operands written by the same launch (router_grad_split's
  // hilo and stacked, below): no split launch after it.
  void* grad_hilo = nullptr;           // [T, 2E] bf16
  const void* split_weight = nullptr;  // [E, H] bf16, contiguous; with stacked
  void* stacked = nullptr;             // [2E, H] bf16
  int64_t hidden = 0;                  // H
};

// The forward's scratch for params' experts, tokens and aux_sums (null or not).
int64_t router_forward_scratch_words(const RouterParams& params);
void launch_router_forward(const RouterParams& params, cudaStream_t stream);
void launch_router_backward(const RouterParams& params, cudaStream_t stream);

// The logits' gradient [T, E] fp32 as two bf16 halves for the tensor cores, side by side in
// hilo [T, 2E]: hi = bf16(g) in columns [0, E), lo = bf16(g − hi) in [E, 2E), both rounded to
// nearest even, so that hi + lo carries ~16 bits of g's mantissa (ops/router.cpp). With a weight,
// the same launch also writes stacked [2E, H] = [W; W], grad_x's other operand.
struct RouterGradSplitParams {
  const float* grad = nullptr;  // [T, E]
  void* hilo = nullptr;         // [T, 2E] bf16
  int64_t tokens = 0;
  int64_t experts = 0;
  const void* weight = nullptr;  // [E, H] bf16, contiguous; null: no stacked copy
  void* stacked = nullptr;       // [2E, H] bf16
  int64_t hidden = 0;
};
void launch_router_grad_split(const RouterGradSplitParams& params, cudaStream_t stream);

// The weight's gradient from its two fp32 halves, hiᵀ·x in rows [0, E) and loᵀ·x in [E, 2E) of
// one product [2E, H]: out [E, H] bf16 = their sum, rounded once (ATen's add into bf16 rounds the
// same, but element by element for the dtype change: 3 µs on moe-lm's 32 × 1024).
struct RouterHalvesSumParams {
  const float* halves = nullptr;  // [2E, H], contiguous
  void* out = nullptr;            // [E, H] bf16, contiguous
  int64_t experts = 0;
  int64_t hidden = 0;
};
void launch_router_halves_sum(const RouterHalvesSumParams& params, cudaStream_t stream);

}  // namespace torchmoe::kernels
