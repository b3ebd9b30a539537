#pragma once
// Autograd for the router's logits (ops/router.h): fp32 logits from 16-bit operands without
// casting them, and gradients in the operands' dtypes.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "torchmoe/ops/router.h"

namespace torchmoe::autograd {

// What the router's Functions hand each other and the Functions around them in backward, so
// that no launch is spent moving a gradient between them (MoELayer's router):
// - the router's gradient of x, from RouterLogitsFunction's backward to the ForkFunction that
//   gave the router its x, added to the other branch's gradient by the GEMM that makes it
//   (ops::router_grad_x's addend) rather than by autograd's add of the two branches (14 µs on
//   moe-lm, 35 on qwen3);
// - the logits' gradient split into bf16 halves by RouterTopKFunction's launch, for
//   RouterLogitsFunction (no split launch), used only when the gradient it receives is the one
//   the split was made from;
// - the routing probabilities' gradient in the permuted rows' order, from the RowProbsFunction
//   that put them in that order (route_tokens) to RouterTopKFunction, which reads it through the
//   row map (no launch for the permutation's backward).
// A link serves one forward (MoELayer makes one per call); its backward parts are taken and
// cleared as they are used. The probabilities' part is the one a shared link would mix up:
// route_tokens checks that its probs come from the top-k holding the link, and RowProbsFunction
// refuses to hand over rows while another permutation's wait in it.
struct RouterGradLink {
  // Set by the caller: the fork's second output goes to one Function whose backward returns a
  // tensor of its own (MoELayer's permutation), so the product may be added into it in place;
  // otherwise into a copy (autograd may hand one gradient tensor to several inputs).
  bool other_branch_exclusive = false;
  // Set by the router's backward (the operands its weight gradient also used), taken by the
  // fork's.
  ops::RouterGradXProduct grad_x_product;
  // Set by RouterLogitsFunction's forward where its backward takes the bf16 halves: the weight
  // whose [W; W] the top-k's launch writes with them.
  at::Tensor split_weight;
  // Set by RouterTopKFunction's backward, taken by RouterLogitsFunction's: the logits' gradient it
  // returned and that tensor's split.
  at::Tensor split_of;
  ops::RouterGradXProduct split;
  // Set by the RowProbsFunction given this link, taken by RouterTopKFunction's backward: the
  // gradient of the rows' probabilities [N] and the permutation's row map [T, k]. The
  // permutation then returns no gradient for probs itself, so probs must go from the top-k to that
  // permutation unchanged (no capacity mask between them); other uses of probs add theirs as usual.
  at::Tensor probs_grad_rows;
  at::Tensor probs_row_map;
};

class RouterLogitsFunction : public torch::autograd::Function<RouterLogitsFunction> {
 public:
  // x [T, H], weight [E, H], bias [E] or none -> logits [T, E] fp32 (fp64 when either is fp64).
  // With a link, the backward leaves x's gradient to the link's fork (and returns none for x).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const std::shared_ptr<RouterGradLink>& link = nullptr);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

// Scoring and top-k (ops::router_topk): logits [T, E] and an optional expert_bias [E] (no
// gradient) -> {indices, probs, aux_sums, lse, counts, aux_loss, z_loss}; differentiable in logits
// through probs, aux_sums, lse, aux_loss (aux_loss_scale > 0, else a constant 0) and z_loss
// (with z_loss, else an empty [0] output; 0 when z_loss_scale is 0). With a link,
// the backward also takes probs' gradient from the link's permutation and splits the logits'
// gradient for RouterLogitsFunction (RouterGradLink).
class RouterTopKFunction : public torch::autograd::Function<RouterTopKFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
      const std::optional<at::Tensor>& expert_bias, const ops::RouterScoring& scoring,
      const std::shared_ptr<RouterGradLink>& link = nullptr);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

// x -> {x for the router, x for the other branch} (views of x). Backward: the second branch's
// gradient plus the router's, which the link holds when the router's logits were computed
// with it (one GEMM with beta = 1), else autograd's gradient of the first output.
class ForkFunction : public torch::autograd::Function<ForkFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x,
                                                const std::shared_ptr<RouterGradLink>& link);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace torchmoe::autograd
