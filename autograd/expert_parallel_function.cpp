#include "torchmoe/autograd/expert_parallel_function.h"

#include "torchmoe/autograd/once_differentiable.h"
#include "torchmoe/autograd/token_permutation_function.h"
#include "torchmoe/distributed/collectives.h"

namespace torchmoe::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor AllToAllFunction::forward(AutogradContext* ctx, const at::Tensor& rows,
                                     const std::vector<int64_t>& send_splits,
                                     const std::vector<int64_t>& recv_splits,
                                     const ProcessGroupOptions& group) {
  ctx->saved_data["send_splits"] = send_splits;
  ctx->saved_data["recv_splits"] = recv_splits;
  // A capsule holds the group without requiring c10d's TorchScript class registration.
  ctx->saved_data["group"] = c10::IValue::make_capsule(group.group());
  ctx->saved_data["timeout_ms"] = static_cast<int64_t>(group.timeout().count());
  return distributed::all_to_all_rows(rows, send_splits, recv_splits, group);
}

variable_list AllToAllFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  auto pg =
      c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(ctx->saved_data["group"].toCapsule());
  const ProcessGroupOptions group =
      ProcessGroupOptions(std::move(pg))
          .timeout(std::chrono::milliseconds(ctx->saved_data["timeout_ms"].toInt()));
  // Run even where this rank's gradient is not needed: the peers' exchange pairs with it.
  const at::Tensor grad =
      distributed::all_to_all_rows(grad_outputs[0], ctx->saved_data["recv_splits"].toIntVector(),
                                   ctx->saved_data["send_splits"].toIntVector(), group);
  return once_differentiable(
      "AllToAllFunction", once,
      {ctx->needs_input_grad(0) ? grad : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()});
}

at::Tensor all_to_all_rows(const at::Tensor& rows, c10::IntArrayRef send_splits,
                           c10::IntArrayRef recv_splits, const ProcessGroupOptions& group) {
  return AllToAllFunction::apply(rows, send_splits.vec(), recv_splits.vec(), group);
}

PermutedTokens route_received(const at::Tensor& probs, c10::IntArrayRef recv_per_expert,
                              int64_t num_local_experts) {
  constexpr const char* kOp = "route_received";
  TORCH_CHECK(probs.defined(), kOp, ": probs must be defined");
  ops::RoutingMap map =
      ops::received_routing_map(recv_per_expert, num_local_experts, probs.device());
  TORCH_CHECK(probs.dim() == 1 && probs.size(0) == map.num_rows, kOp, ": probs must be [",
              map.num_rows, "] as the counts say, got ", probs.sizes());
  PermutedTokens out;
  out.probs = probs.index_select(0, map.sorted_slots);
  out.row_tokens = map.sorted_slots;  // top-k 1: a row's slot is its received row
  out.row_map = std::move(map.row_map);
  out.sorted_slots = std::move(map.sorted_slots);
  out.m_splits = ops::split_sizes(map);
  return out;
}

PermutedTokens permute_to_capacity(const at::Tensor& tokens, const at::Tensor& indices,
                                   const at::Tensor& probs, int64_t num_experts, int64_t capacity) {
  constexpr const char* kOp = "permute_to_capacity";
  TORCH_CHECK(tokens.dim() == 2 && indices.dim() == 2 && indices.size(0) == tokens.size(0), kOp,
              ": tokens must be [T, H] and indices [T, topk], got ", tokens.sizes(), " and ",
              indices.sizes());
  TORCH_CHECK(probs.sizes() == indices.sizes(), kOp, ": probs must have the indices' shape ",
              indices.sizes(), ", got ", probs.sizes());
  ops::CapacityMap map = ops::make_capacity_map(indices, num_experts, capacity);
  PermutedTokens out;
  out.tokens = PermuteFunction::apply(tokens, map.row_map, map.sorted_slots);
  const at::Tensor padding = map.sorted_slots < 0;
  out.probs =
      probs.reshape(-1).index_select(0, map.sorted_slots.clamp_min(0)).masked_fill(padding, 0);
  out.row_map = std::move(map.row_map);
  out.sorted_slots = std::move(map.sorted_slots);
  out.m_splits = SplitSizes::uniform(num_experts, capacity, tokens.device());
  return out;
}

}  // namespace torchmoe::autograd
