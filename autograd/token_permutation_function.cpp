#include "torchmoe/autograd/token_permutation_function.h"

#include <string>

#include "torchmoe/autograd/once_differentiable.h"
#include "torchmoe/autograd/saved_data.h"
#include "torchmoe/ops/token_permutation.h"

namespace torchmoe::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor PermuteFunction::forward(AutogradContext* ctx, const at::Tensor& tokens,
                                    const at::Tensor& row_map, const at::Tensor& sorted_slots) {
  ctx->save_for_backward({row_map});
  return ops::permute_rows(tokens.contiguous(), row_map, sorted_slots, at::Tensor());
}

variable_list PermuteFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const at::Tensor row_map = ctx->get_saved_variables()[0];
  at::Tensor grad_tokens;
  if (ctx->needs_input_grad(0)) {
    grad_tokens = ops::unpermute_rows(grad_outputs[0].contiguous(), row_map, at::Tensor());
  }
  return once_differentiable("PermuteFunction", once, {grad_tokens, at::Tensor(), at::Tensor()});
}

at::Tensor RowProbsFunction::forward(AutogradContext* ctx, const at::Tensor& probs,
                                     const ops::RoutingMap& map,
                                     const std::shared_ptr<RouterGradLink>& probs_link) {
  ctx->save_for_backward({map.row_map});
  save_link(ctx, probs_link);
  if (map.row_probs.defined()) return map.row_probs;
  // Each slot as a one-element token row (k = 1) through the row kernels: one launch.
  return ops::permute_rows(probs.contiguous().view({-1, 1}), map.row_map.view({-1, 1}),
                           map.sorted_slots, at::Tensor())
      .view(-1);
}

variable_list RowProbsFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const at::Tensor row_map = ctx->get_saved_variables()[0];  // [T, k]
  at::Tensor grad_probs;
  const std::shared_ptr<RouterGradLink> link = saved_link<RouterGradLink>(ctx);
  if (link && ctx->needs_input_grad(0) && grad_outputs[0].defined()) {
    // The router's backward reads these through the map: no gradient of its own here.
    TORCH_CHECK(!link->probs_grad_rows.defined(), "RowProbsFunction: the RouterGradLink still ",
                "holds another permutation's gradient; a link serves one forward");
    link->probs_grad_rows = grad_outputs[0];
    link->probs_row_map = row_map;
  } else if (ctx->needs_input_grad(0)) {
    grad_probs = ops::unpermute_rows(grad_outputs[0].contiguous().view({-1, 1}),
                                     row_map.contiguous().view({-1, 1}), at::Tensor())
                     .view(row_map.sizes());
  }
  return once_differentiable("RowProbsFunction", once, {grad_probs, at::Tensor(), at::Tensor()});
}

at::Tensor UnpermuteFunction::forward(AutogradContext* ctx, const at::Tensor& permuted,
                                      const at::Tensor& row_map,
                                      const std::optional<at::Tensor>& sorted_slots,
                                      const std::optional<at::Tensor>& probs,
                                      const std::shared_ptr<Fp8GradLink>& grad_link) {
  const at::Tensor x = permuted.contiguous();
  const at::Tensor p = probs.has_value() ? probs->contiguous() : at::Tensor();
  // The permuted rows are only needed for the probabilities' gradient.
  ctx->save_for_backward(
      {row_map, sorted_slots.value_or(at::Tensor()), p, p.defined() ? x : at::Tensor()});
  ctx->saved_data["num_rows"] = x.size(0);
  if (grad_link && !p.defined()) {
    TORCH_CHECK(!grad_link->armed || grad_link->rows == x.size(0), "unpermute_tokens: grad_link's ",
                "layer has ", grad_link->rows, " rows, permuted ", x.size(0),
                "; permuted must be that layer's output");
    save_link(ctx, grad_link);
  }
  return ops::unpermute_rows(x, row_map, p);
}

variable_list UnpermuteFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor& row_map = saved[0];
  const at::Tensor& probs = saved[2];
  const at::Tensor grad = grad_outputs[0].contiguous();
  const at::Tensor sorted_slots =
      saved[1].defined() ? saved[1]
                         : ops::slots_of_rows(row_map, ctx->saved_data["num_rows"].toInt());
  if (!probs.defined()) {
    const std::shared_ptr<Fp8GradLink> link = saved_link<Fp8GradLink>(ctx);
    if (link && link->armed) {
      link->grad =
          quantize_linked_gradient(*link, grad, ops::tokens_of_rows(sorted_slots, row_map.size(1)));
      return once_differentiable(
          "UnpermuteFunction", once,
          {linked_gradient_placeholder({ctx->saved_data["num_rows"].toInt(), grad.size(1)},
                                       grad.options()),
           at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()});
    }
    return once_differentiable("UnpermuteFunction", once,
                               {ops::permute_rows(grad, row_map, sorted_slots, at::Tensor()),
                                at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()});
  }
  ops::UnpermuteGrads grads = ops::unpermute_rows_backward(grad, saved[3], sorted_slots, probs);
  // One gradient per forward argument; autograd edges exist only for the optionals given.
  const size_t probs_edge = saved[1].defined() ? 3 : 2;
  return once_differentiable(
      "UnpermuteFunction", once,
      {ctx->needs_input_grad(0) ? grads.grad_permuted : at::Tensor(), at::Tensor(), at::Tensor(),
       ctx->needs_input_grad(probs_edge) ? grads.grad_probs : at::Tensor(), at::Tensor()});
}

PermutedTokens permute_tokens(const at::Tensor& tokens, const at::Tensor& indices,
                              int64_t num_experts, const std::optional<at::Tensor>& probs,
                              ops::IndexTrust trust) {
  PermutedTokens out = route_tokens(tokens, indices, num_experts, probs, trust);
  out.tokens = PermuteFunction::apply(tokens, out.row_map, out.sorted_slots);
  return out;
}

PermutedTokens route_tokens(const at::Tensor& tokens, const at::Tensor& indices,
                            int64_t num_experts, const std::optional<at::Tensor>& probs,
                            ops::IndexTrust trust,
                            const std::shared_ptr<RouterGradLink>& probs_link) {
  TORCH_CHECK(tokens.defined() && tokens.dim() == 2,
              "permute_tokens: tokens must be 2-D [T, H], got ",
              tokens.defined() ? tokens.sizes() : at::IntArrayRef{});
  TORCH_CHECK(indices.defined() && indices.dim() == 2 && indices.size(0) == tokens.size(0),
              "permute_tokens: indices must be [T=", tokens.size(0), ", topk], got ",
              indices.defined() ? indices.sizes() : at::IntArrayRef{});
  TORCH_CHECK(indices.device() == tokens.device(), "permute_tokens: indices must be on ",
              tokens.device(), " like the tokens, got ", indices.device());
  const bool has_probs = probs.has_value() && probs->defined();
  if (has_probs) {
    TORCH_CHECK(probs->sizes() == indices.sizes(), "permute_tokens: probs must have shape ",
                indices.sizes(), " like the indices, got ", probs->sizes());
    TORCH_CHECK(probs->device() == tokens.device(), "permute_tokens: probs must be on ",
                tokens.device(), ", got ", probs->device());
    TORCH_CHECK(at::isFloatingType(probs->scalar_type()),
                "permute_tokens: probs must have a floating dtype, got ", probs->scalar_type());
  }
  // float32 probabilities are put in row order by the map's own pass.
  const bool fp32_probs = has_probs && probs->scalar_type() == at::kFloat;
  if (probs_link && has_probs && probs->requires_grad()) {
    // The rows' gradient goes to the top-k through the link, as the gradient of its own output:
    // probs must be that output, unchanged (a product or mask in between would be skipped).
    auto* top_k =
        dynamic_cast<torch::autograd::CppNode<RouterTopKFunction>*>(probs->grad_fn().get());
    TORCH_CHECK(top_k != nullptr && probs->output_nr() == 1 &&
                    saved_link<RouterGradLink>(&top_k->ctx_) == probs_link,
                "route_tokens: with a probs_link, probs must be the probabilities of the "
                "RouterTopKFunction given that link, unchanged; got a tensor from ",
                probs->grad_fn() ? probs->grad_fn()->name() : std::string("no function"));
  }
  ops::RoutingMap map =
      ops::make_routing_map(indices, num_experts, trust, fp32_probs ? *probs : at::Tensor());
  PermutedTokens out;
  if (has_probs) {
    // Each row's probability: the slots' values as one-element token rows (k = 1), whose
    // gradient goes back through the row kernels, one launch (ATen's index_select and its
    // backward took three); float64 on CUDA, which the row kernels do not take, through
    // index_select.
    out.probs = probs->is_cuda() && probs->scalar_type() == at::kDouble
                    ? probs->reshape(-1).index_select(0, map.sorted_slots)
                    : RowProbsFunction::apply(*probs, map, probs_link);
  }
  out.row_map = std::move(map.row_map);
  out.sorted_slots = std::move(map.sorted_slots);
  out.row_tokens = std::move(map.row_tokens);
  out.m_splits = ops::split_sizes(map);
  return out;
}

at::Tensor unpermute_tokens(const at::Tensor& permuted, const at::Tensor& row_map,
                            const std::optional<at::Tensor>& probs) {
  constexpr const char* kOp = "unpermute_tokens";
  TORCH_CHECK(permuted.defined() && permuted.dim() == 2, kOp,
              ": permuted must be 2-D [rows, hidden], got ",
              permuted.defined() ? permuted.sizes() : at::IntArrayRef{});
  TORCH_CHECK(row_map.defined() && row_map.dim() == 2 && row_map.scalar_type() == at::kLong, kOp,
              ": row_map must be a 2-D int64 tensor [tokens, topk], got ",
              row_map.defined() ? row_map.sizes() : at::IntArrayRef{}, " ",
              row_map.defined() ? row_map.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK(row_map.device() == permuted.device(), kOp, ": row_map must be on ",
              permuted.device(), " like permuted, got ", row_map.device());
  // Contiguous, as every other entry point takes its maps: the row kernels read them so.
  const at::Tensor map = row_map.contiguous();
  ops::check_row_map(kOp, map, permuted.size(0));
  return UnpermuteFunction::apply(permuted, map, std::nullopt, probs);
}

at::Tensor unpermute_tokens(const at::Tensor& permuted, const PermutedTokens& routed,
                            const std::optional<at::Tensor>& probs,
                            const std::shared_ptr<Fp8GradLink>& grad_link) {
  TORCH_CHECK(
      permuted.defined() && permuted.dim() == 2 && permuted.size(0) == routed.sorted_slots.size(0),
      "unpermute_tokens: permuted must be [rows=", routed.sorted_slots.size(0),
      ", hidden] like the permuted tokens (to unpermute padded rows, pass the row_map), got ",
      permuted.defined() ? permuted.sizes() : at::IntArrayRef{});
  return UnpermuteFunction::apply(permuted, routed.row_map, routed.sorted_slots, probs, grad_link);
}

}  // namespace torchmoe::autograd
