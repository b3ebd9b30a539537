#pragma once
// What MoELayer reaches inside a TopKRouter: its forward with the gradient link that MoELayer
// shares between the router and the permutation. Internal, not installed: it names an autograd
// type, which no installed header does.

#include <torch/types.h>

#include <memory>

#include "torchmoe/autograd/router_function.h"
#include "torchmoe/modules/router.h"

namespace torchmoe::detail {

struct TopKRouterCalls {
  // TopKRouterImpl::forward with grad_link: MoELayer forks x between the router and the
  // permutation (autograd::ForkFunction) and takes the router's gradient of x through it, and may
  // hand the probabilities' gradient to the router through it (autograd::route_tokens); the
  // router's two Functions also pass the logits' gradient split in bf16 halves through it.
  static RouterOutput forward(TopKRouterImpl& router, const torch::Tensor& x,
                              const std::shared_ptr<autograd::RouterGradLink>& grad_link);
};

}  // namespace torchmoe::detail
