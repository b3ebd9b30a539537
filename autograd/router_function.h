#pragma once
// Autograd for the router's logits (ops/router.h): fp32 logits from 16-bit operands without
// casting them, and gradients in the operands' dtypes.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <optional>

#include "torchmoe/ops/router.h"

namespace torchmoe::autograd {

class RouterLogitsFunction : public torch::autograd::Function<RouterLogitsFunction> {
 public:
  // x [T, H], weight [E, H] -> logits [T, E] fp32 (fp64 when either is fp64).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

// Scoring and top-k (ops::router_topk): logits [T, E] and an optional expert_bias [E] (no
// gradient) -> {indices, probs, aux_sums, lse, counts, aux_loss}; differentiable in logits through
// probs, aux_sums, lse and aux_loss (aux_loss_scale > 0, else an empty [0] output).
class RouterTopKFunction : public torch::autograd::Function<RouterTopKFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& logits,
                                                const std::optional<at::Tensor>& expert_bias,
                                                int64_t topk, bool sigmoid, bool normalize,
                                                bool aux, double aux_loss_scale = 0.0);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace torchmoe::autograd
