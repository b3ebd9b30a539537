#include "torchmoe/autograd/once_differentiable.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <string>
#include <utility>

namespace torchmoe::autograd {

torch::autograd::variable_list once_differentiable(const char* function,
                                                   const OnceDifferentiable& scope,
                                                   torch::autograd::variable_list grads) {
  if (!scope.create_graph) return grads;
  const at::AutoGradMode enable_grad(true);  // the error node is recorded
  torch::autograd::variable_list inputs;
  inputs.reserve(grads.size());
  for (const at::Tensor& g : grads) {
    inputs.push_back(g.defined() && g.is_floating_point() ? g.detach().requires_grad_(true) : g);
  }
  torch::autograd::DelayedError error(
      std::string("torchmoe::autograd::") + function +
          ": a second derivative through this function is not supported (its backward is not "
          "differentiable)",
      static_cast<int64_t>(inputs.size()));
  return error.apply(std::move(inputs));
}

}  // namespace torchmoe::autograd
