#pragma once
// Autograd for the (scaled) gated activations: one Function, gradients for the input and the
// per-row scales. Backward recomputes the activation from the saved input (no saved output).

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

#include <optional>

#include "torchmoe/ops/glu.h"

namespace torchmoe::autograd {

class GluFunction : public torch::autograd::Function<GluFunction> {
 public:
  // input [..., 2H]; scales: none, or input.shape[:-1]. Returns [..., H].
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& scales,
                            const ops::GluOptions& options);
  // Gradients: d input, d scales (when given), none for the options.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

}  // namespace torchmoe::autograd
