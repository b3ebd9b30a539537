#pragma once
// What a torchmoe Function's backward returns. Its backward runs kernels and ops that autograd
// does not trace, so under create_graph (grad mode on in backward) its results would be constants
// and a second derivative through it would be silently missing. A backward therefore computes
// with grad mode off (OnceDifferentiable's guard) and returns through once_differentiable, which
// under create_graph hands the gradients out through an error node: differentiating them again is
// an error naming the Function (Python's @once_differentiable does the same). In an ordinary
// backward grad mode is already off and the gradients are returned as they are.

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

namespace torchmoe::autograd {

// At the top of a backward: whether it runs under create_graph, and grad mode off for the rest.
struct OnceDifferentiable {
  const bool create_graph = at::GradMode::is_enabled();
  const at::NoGradGuard no_grad;
};

torch::autograd::variable_list once_differentiable(const char* function,
                                                   const OnceDifferentiable& scope,
                                                   torch::autograd::variable_list grads);

}  // namespace torchmoe::autograd
