#pragma once
// Autograd for token permutation: PermuteFunction (token order -> expert-grouped rows) and
// UnpermuteFunction (back, optionally weighted by the routing probabilities), plus
// permute_tokens(), which builds the routing map and applies PermuteFunction.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torchmoe::autograd {

class PermuteFunction : public torch::autograd::Function<PermuteFunction> {
 public:
  // tokens [T, H], row_map [T, k] and its inverse sorted_slots [N] -> [N, H]. Gradient: the sum
  // over each token's rows.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& tokens,
                            const at::Tensor& row_map, const at::Tensor& sorted_slots);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

class UnpermuteFunction : public torch::autograd::Function<UnpermuteFunction> {
 public:
  // permuted [N, H], row_map [T, k], probs none or [T, k] -> [T, H]. Gradients for permuted and
  // probs.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& permuted,
                            const at::Tensor& row_map, const std::optional<at::Tensor>& probs);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

/// Tokens grouped by expert, as returned by permute_tokens.
struct PermutedTokens {
  at::Tensor tokens;              // [N, H], expert e's rows contiguous, experts in order
  at::Tensor probs;               // [N]: each row's routing probability (when probs given)
  at::Tensor row_map;             // [T, k] int64: the row of each (token, choice), -1 if dropped
  std::vector<int64_t> m_splits;  // rows per expert, on the host
  at::Tensor m_splits_device;     // the same as an int64 tensor on the tokens' device
};

// tokens [T, H]; indices [T, k] int32/int64 in [0, num_experts) or -1 (dropped); probs none or
// [T, k]. Differentiable in tokens and probs.
PermutedTokens permute_tokens(const at::Tensor& tokens, const at::Tensor& indices,
                              int64_t num_experts, const std::optional<at::Tensor>& probs);

}  // namespace torchmoe::autograd
