#include "torchmoe/autograd/glu_function.h"

#include "torchmoe/autograd/once_differentiable.h"
#include "torchmoe/autograd/saved_data.h"

namespace torchmoe::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {
constexpr const char* kOptionsKey = "options";
}  // namespace

at::Tensor GluFunction::forward(AutogradContext* ctx, const at::Tensor& input,
                                const std::optional<at::Tensor>& scales,
                                const ops::GluOptions& options) {
  const at::Tensor x = input.contiguous();
  const at::Tensor s = scales.has_value() ? *scales : at::Tensor();
  at::Tensor output = ops::glu_forward(x, s, options);
  ctx->save_for_backward({x, s});
  save_value(ctx, kOptionsKey, options);
  return output;
}

variable_list GluFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const variable_list saved = ctx->get_saved_variables();
  const ops::GluOptions& options = saved_value<ops::GluOptions>(ctx, kOptionsKey);
  const at::Tensor& scales = saved[1];
  const bool scales_need_grad = scales.defined() && ctx->needs_input_grad(1);
  ops::GluGrads grads =
      ops::glu_backward(grad_outputs[0].contiguous(), saved[0], scales, options, scales_need_grad);
  return once_differentiable("GluFunction", once,
                             {ctx->needs_input_grad(0) ? grads.grad_input : at::Tensor(),
                              grads.grad_scales, at::Tensor()});
}

}  // namespace torchmoe::autograd
