#pragma once
// Autograd for token permutation: PermuteFunction (token order -> expert-grouped rows),
// RowProbsFunction (the routing probabilities in the rows' order) and UnpermuteFunction (back,
// optionally weighted by the routing probabilities), plus the entry
// points the modules call: permute_tokens() builds the routing map and applies PermuteFunction;
// unpermute_tokens() applies UnpermuteFunction to a checked or a trusted map.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "torchmoe/autograd/grouped_linear_function.h"
#include "torchmoe/autograd/router_function.h"
#include "torchmoe/ops/token_permutation.h"
#include "torchmoe/ops/types.h"

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

class RowProbsFunction : public torch::autograd::Function<RowProbsFunction> {
 public:
  // A router's probabilities [T, k] -> each permuted row's [N], in map's row order: map.row_probs
  // when the map's pass wrote them (float32), else gathered here. The map is not a Function input,
  // so its rows come back without the view autograd makes of a returned input, and probs needs no
  // reshape to [T·k, 1] rows (each a view and a node: host time per forward). Gradient: each
  // slot's row's. probs_link: probs come straight from the RouterTopKFunction given the same link,
  // whose backward reads the rows' gradient through the map; this backward then only hands it
  // over (RouterGradLink).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& probs,
                            const ops::RoutingMap& map,
                            const std::shared_ptr<RouterGradLink>& probs_link);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

class UnpermuteFunction : public torch::autograd::Function<UnpermuteFunction> {
 public:
  // permuted [N, H], row_map [T, k] meeting ops::check_row_map's contract, sorted_slots: its
  // inverse [N] when the caller has it (else backward derives it), probs none or [T, k]
  // -> [T, H]. Gradients for permuted (zero on rows no slot names) and probs. grad_link: the FP8
  // layer that produced `permuted` (an FP8 MoE layer's fc2), when armed and without probs, gets
  // its output gradient quantized from grad_out's rows (Fp8GradLink), and permuted's gradient is a
  // placeholder zero; `permuted` must then be that layer's output, used nowhere else (the layer's
  // backward refuses a gradient summed from other uses).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& permuted,
                            const at::Tensor& row_map,
                            const std::optional<at::Tensor>& sorted_slots,
                            const std::optional<at::Tensor>& probs,
                            const std::shared_ptr<Fp8GradLink>& grad_link = nullptr);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

// tokens [T, H]; indices [T, k] int32/int64 in [0, num_experts) or -1 (dropped); probs none or
// [T, k]. Differentiable in tokens and probs. With IndexTrust::kDropless (a router's own top-k)
// the split sizes stay on the device: m_splits has no host copy on CUDA.
PermutedTokens permute_tokens(const at::Tensor& tokens, const at::Tensor& indices,
                              int64_t num_experts, const std::optional<at::Tensor>& probs,
                              ops::IndexTrust trust = ops::IndexTrust::kChecked);

// permute_tokens without the permuted copy: the routing map, the rows' probabilities and the split
// sizes, with `tokens` left undefined, for experts that read the tokens through the map
// (GroupedMLP::forward_routed). probs_link: probs are the top-k's of a router given the same
// link, unchanged since; the rows' probabilities' gradient then goes to it through the link
// (RowProbsFunction).
PermutedTokens route_tokens(const at::Tensor& tokens, const at::Tensor& indices,
                            int64_t num_experts, const std::optional<at::Tensor>& probs,
                            ops::IndexTrust trust = ops::IndexTrust::kChecked,
                            const std::shared_ptr<RouterGradLink>& probs_link = nullptr);

// Through a row_map the caller built: checked against the contract first (one device-to-host
// copy on CUDA).
at::Tensor unpermute_tokens(const at::Tensor& permuted, const at::Tensor& row_map,
                            const std::optional<at::Tensor>& probs);
// Through the map permute_tokens made (trusted: no check, no host sync); grad_link as
// UnpermuteFunction's.
at::Tensor unpermute_tokens(const at::Tensor& permuted, const PermutedTokens& routed,
                            const std::optional<at::Tensor>& probs,
                            const std::shared_ptr<Fp8GradLink>& grad_link = nullptr);

}  // namespace torchmoe::autograd
