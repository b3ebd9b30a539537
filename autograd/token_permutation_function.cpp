#include "torchmoe/autograd/token_permutation_function.h"

#include "torchmoe/ops/token_permutation.h"

namespace torchmoe::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor PermuteFunction::forward(AutogradContext* ctx, const at::Tensor& tokens,
                                    const at::Tensor& row_map, const at::Tensor& sorted_slots) {
  ctx->save_for_backward({row_map});
  return ops::permute_rows(tokens.contiguous(), sorted_slots, row_map.size(1), at::Tensor());
}

variable_list PermuteFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const at::Tensor row_map = ctx->get_saved_variables()[0];
  at::Tensor grad_tokens;
  if (ctx->needs_input_grad(0)) {
    grad_tokens = ops::unpermute_rows(grad_outputs[0].contiguous(), row_map, at::Tensor());
  }
  return {grad_tokens, at::Tensor(), at::Tensor()};
}

at::Tensor UnpermuteFunction::forward(AutogradContext* ctx, const at::Tensor& permuted,
                                      const at::Tensor& row_map,
                                      const std::optional<at::Tensor>& probs) {
  const at::Tensor x = permuted.contiguous();
  const at::Tensor p = probs.has_value() ? probs->contiguous() : at::Tensor();
  // The permuted rows are only needed for the probabilities' gradient.
  ctx->save_for_backward({row_map, p, p.defined() ? x : at::Tensor()});
  ctx->saved_data["num_rows"] = x.size(0);
  return ops::unpermute_rows(x, row_map, p);
}

variable_list UnpermuteFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor& row_map = saved[0];
  const at::Tensor& probs = saved[1];
  const at::Tensor grad = grad_outputs[0].contiguous();
  const at::Tensor sorted_slots = ops::slots_of_rows(row_map, ctx->saved_data["num_rows"].toInt());
  if (!probs.defined()) {
    return {ops::permute_rows(grad, sorted_slots, row_map.size(1), at::Tensor()), at::Tensor(),
            at::Tensor()};
  }
  ops::UnpermuteGrads grads = ops::unpermute_rows_backward(grad, saved[2], sorted_slots, probs);
  return {ctx->needs_input_grad(0) ? grads.grad_permuted : at::Tensor(), at::Tensor(),
          ctx->needs_input_grad(2) ? grads.grad_probs : at::Tensor()};
}

PermutedTokens permute_tokens(const at::Tensor& tokens, const at::Tensor& indices,
                              int64_t num_experts, const std::optional<at::Tensor>& probs) {
  TORCH_CHECK(tokens.defined() && tokens.dim() == 2,
              "permute_tokens: tokens must be 2-D [T, H], got ",
              tokens.defined() ? tokens.sizes() : at::IntArrayRef{});
  TORCH_CHECK(indices.defined() && indices.dim() == 2 && indices.size(0) == tokens.size(0),
              "permute_tokens: indices must be [T=", tokens.size(0), ", topk], got ",
              indices.defined() ? indices.sizes() : at::IntArrayRef{});
  TORCH_CHECK(indices.device() == tokens.device(), "permute_tokens: indices must be on ",
              tokens.device(), " like the tokens, got ", indices.device());
  ops::RoutingMap map = ops::make_routing_map(indices, num_experts);
  PermutedTokens out;
  out.tokens = PermuteFunction::apply(tokens, map.row_map, map.sorted_slots);
  if (probs.has_value() && probs->defined()) {
    TORCH_CHECK(probs->sizes() == indices.sizes(), "permute_tokens: probs must have shape ",
                indices.sizes(), " like the indices, got ", probs->sizes());
    TORCH_CHECK(probs->device() == tokens.device(), "permute_tokens: probs must be on ",
                tokens.device(), ", got ", probs->device());
    TORCH_CHECK(at::isFloatingType(probs->scalar_type()),
                "permute_tokens: probs must have a floating dtype, got ", probs->scalar_type());
    // Each row's probability, differentiable through ATen's index_select.
    out.probs = probs->reshape(-1).index_select(0, map.sorted_slots);
  }
  out.row_map = std::move(map.row_map);
  out.m_splits = std::move(map.host_splits);
  out.m_splits_device = std::move(map.m_splits);
  return out;
}

}  // namespace torchmoe::autograd
