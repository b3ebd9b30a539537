#pragma once
// Autograd for the router's logits (ops/router.h): fp32 logits from 16-bit operands without
// casting them, and gradients in the operands' dtypes.

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

namespace torchmoe::autograd {

class RouterLogitsFunction : public torch::autograd::Function<RouterLogitsFunction> {
 public:
  // x [T, H], weight [E, H] -> logits [T, E] fp32 (fp64 when either is fp64).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const at::Tensor& weight);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace torchmoe::autograd
