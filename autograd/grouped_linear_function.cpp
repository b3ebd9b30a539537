#include "torchmoe/autograd/grouped_linear_function.h"

#include <ATen/ATen.h>

#include "torchmoe/ops/grouped_gemm.h"

namespace torchmoe::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Per-group [out, in] / [out] views of parameters given either as G tensors or one stacked tensor.
std::vector<at::Tensor> per_group(at::TensorList params, bool grouped) {
  if (params.empty()) return {};
  if (grouped) return params[0].unbind(0);
  return params.vec();
}

void check_layout(at::TensorList params, bool grouped, int64_t stacked_dim, const char* what) {
  if (!grouped) return;
  TORCH_CHECK(params.size() == 1 && params[0].dim() == stacked_dim, "GroupedLinearFunction: ", what,
              " must be one ", stacked_dim, "-D tensor when grouped, got ", params.size(),
              " tensor(s)", params.empty() ? "" : " of rank " + std::to_string(params[0].dim()));
}

// Writes weight gradients in the parameter layout; `accumulate` adds into the existing contents.
void wgrad_into(const at::Tensor& input, const at::Tensor& grad_output,
                const GroupedLinearConfig& cfg, at::TensorList weight_grads, bool accumulate,
                at::TensorList bias_grads) {
  ops::grouped_linear_wgrad(input, grad_output, cfg.m_splits,
                            per_group(weight_grads, cfg.grouped_weight), accumulate,
                            per_group(bias_grads, cfg.grouped_bias), cfg.gemm_backend);
}

// New gradient buffers in the parameter layout: one [G, ...] allocation either way, so that the
// per-group tensors are equally spaced (the sm90 kernel then needs no address table for them).
std::vector<at::Tensor> new_group_buffers(at::IntArrayRef shape, bool grouped, size_t groups,
                                          const at::TensorOptions& options) {
  std::vector<int64_t> sizes{static_cast<int64_t>(groups)};
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  at::Tensor all = at::empty(sizes, options);
  if (grouped) return {all};
  return all.unbind(0);
}

std::vector<at::Tensor> new_weight_grads(const at::Tensor& input, const at::Tensor& grad_output,
                                         const GroupedLinearConfig& cfg) {
  return new_group_buffers({grad_output.size(1), input.size(1)}, cfg.grouped_weight,
                           cfg.m_splits.size(), input.options());
}

}  // namespace

at::Tensor GroupedLinearFunction::forward(AutogradContext* ctx, const at::Tensor& input,
                                          const std::optional<at::Tensor>& input_scales,
                                          at::TensorList weights, at::TensorList biases,
                                          const c10::intrusive_ptr<GroupedLinearConfig>& config) {
  TORCH_CHECK(config, "GroupedLinearFunction: config must not be null");
  check_layout(weights, config->grouped_weight, 3, "weights");
  check_layout(biases, config->grouped_bias, 2, "biases");
  TORCH_CHECK(!input_scales.has_value() || config->input_activation, "GroupedLinearFunction: ",
              "input_scales are the input activation's scales; config.input_activation is unset");
  const at::Tensor scales = input_scales.value_or(at::Tensor());
  const at::Tensor gemm_input =
      config->input_activation ? ops::glu_forward(input, scales, *config->input_activation) : input;
  at::Tensor output = ops::grouped_linear_forward(
      gemm_input, config->m_splits, per_group(weights, config->grouped_weight),
      per_group(biases, config->grouped_bias), config->gemm_backend);
  variable_list saved{input, scales};
  saved.insert(saved.end(), weights.begin(), weights.end());
  ctx->save_for_backward(saved);
  ctx->saved_data["num_biases"] = static_cast<int64_t>(biases.size());
  ctx->saved_data["config"] = c10::IValue::make_capsule(config);
  return output;
}

variable_list GroupedLinearFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor& input = saved[0];
  const at::Tensor& scales = saved[1];
  const at::TensorList weights = at::TensorList(saved).slice(2);
  const auto num_weights = weights.size();
  const auto num_biases = static_cast<size_t>(ctx->saved_data["num_biases"].toInt());
  const auto config = c10::static_intrusive_pointer_cast<GroupedLinearConfig>(
      ctx->saved_data["config"].toCapsule());
  const GroupedLinearConfig& cfg = *config;
  const at::Tensor grad_output = grad_outputs[0].contiguous();

  // Gradient slots: input, input_scales, weights..., biases..., config (one per forward
  // argument). Autograd edges exist only for tensors given: input_scales has none when absent.
  constexpr size_t kFirstWeightSlot = 2;
  const size_t first_weight = scales.defined() ? 2 : 1;  // edge index
  variable_list grads(kFirstWeightSlot + num_weights + num_biases + 1);
  const bool scales_need_grad = scales.defined() && ctx->needs_input_grad(1);
  if (ctx->needs_input_grad(0) || scales_need_grad) {
    at::Tensor grad_gemm_input = ops::grouped_linear_dgrad(
        grad_output, cfg.m_splits, per_group(weights, cfg.grouped_weight), cfg.gemm_backend);
    if (cfg.input_activation) {
      ops::GluGrads glu = ops::glu_backward(grad_gemm_input, input, scales, *cfg.input_activation,
                                            scales_need_grad);
      grads[0] = std::move(glu.grad_input);
      if (scales_need_grad) grads[1] = std::move(glu.grad_scales);
    } else {
      grads[0] = std::move(grad_gemm_input);
    }
  }
  bool weights_need_grad = false, biases_need_grad = false;
  for (size_t i = 0; i < num_weights; ++i) {
    weights_need_grad |= ctx->needs_input_grad(first_weight + i);
  }
  for (size_t i = 0; i < num_biases; ++i) {
    biases_need_grad |= ctx->needs_input_grad(first_weight + num_weights + i);
  }

  const std::vector<at::Tensor> bias_grads =
      biases_need_grad ? new_group_buffers({grad_output.size(1)}, cfg.grouped_bias,
                                           cfg.m_splits.size(), grad_output.options())
                       : std::vector<at::Tensor>{};

  // The wgrad GEMM's input: recomputed here when forward saved the pre-activation instead.
  const at::Tensor gemm_input = weights_need_grad && cfg.input_activation
                                    ? ops::glu_forward(input, scales, *cfg.input_activation)
                                    : input;
  if (weights_need_grad && cfg.wgrad_queue) {
    // Delayed: dbias now (it is cheap and autograd wants it), the wgrad GEMM in backward_dw().
    cfg.wgrad_queue->push_back(DelayedWgrad{gemm_input, grad_output, config});
    if (biases_need_grad) {
      ops::grouped_bias_grad(grad_output, cfg.m_splits, per_group(bias_grads, cfg.grouped_bias));
    }
  } else if (weights_need_grad && !cfg.main_grads.empty()) {
    wgrad_into(gemm_input, grad_output, cfg, cfg.main_grads, !cfg.overwrite_main_grad, bias_grads);
  } else if (weights_need_grad) {
    const std::vector<at::Tensor> weight_grads = new_weight_grads(gemm_input, grad_output, cfg);
    wgrad_into(gemm_input, grad_output, cfg, weight_grads, /*accumulate=*/false, bias_grads);
    std::copy(weight_grads.begin(), weight_grads.end(), grads.begin() + kFirstWeightSlot);
  } else if (biases_need_grad) {
    ops::grouped_bias_grad(grad_output, cfg.m_splits, per_group(bias_grads, cfg.grouped_bias));
  }
  std::copy(bias_grads.begin(), bias_grads.end(), grads.begin() + kFirstWeightSlot + num_weights);
  return grads;
}

std::vector<at::Tensor> run_delayed_wgrad(const DelayedWgrad& work) {
  // Called from user code (backward_dw), where grad mode is on; like backward, this writes into
  // per-group views of gradient buffers, which autograd must not track.
  const at::NoGradGuard no_grad;
  const GroupedLinearConfig& cfg = *work.config;
  if (!cfg.main_grads.empty()) {
    wgrad_into(work.input, work.grad_output, cfg, cfg.main_grads, !cfg.overwrite_main_grad, {});
    return {};
  }
  std::vector<at::Tensor> weight_grads = new_weight_grads(work.input, work.grad_output, cfg);
  wgrad_into(work.input, work.grad_output, cfg, weight_grads, /*accumulate=*/false, {});
  return weight_grads;
}

}  // namespace torchmoe::autograd
