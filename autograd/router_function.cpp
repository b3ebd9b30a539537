#include "torchmoe/autograd/router_function.h"

#include "torchmoe/ops/router.h"

namespace torchmoe::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor RouterLogitsFunction::forward(AutogradContext* ctx, const at::Tensor& x,
                                         const at::Tensor& weight) {
  ctx->save_for_backward({x, weight});
  return ops::router_logits(x, weight);
}

variable_list RouterLogitsFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const variable_list saved = ctx->get_saved_variables();
  ops::RouterLogitsGrads grads =
      ops::router_logits_backward(grad_outputs[0].contiguous(), saved[0], saved[1],
                                  ctx->needs_input_grad(0), ctx->needs_input_grad(1));
  return {grads.grad_x, grads.grad_weight};
}

}  // namespace torchmoe::autograd
