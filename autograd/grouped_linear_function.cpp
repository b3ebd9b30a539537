#include "torchmoe/autograd/grouped_linear_function.h"

#include <ATen/ATen.h>

#include "torchmoe/ops/token_permutation.h"

namespace torchmoe::autograd {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Parameters (or their gradient buffers) as the ops take them: one stacked tensor or G tensors.
ops::GroupedTensors grouped(at::TensorList params, bool stacked) {
  if (params.empty()) return {};
  if (stacked) return ops::GroupedTensors::stacked(params[0]);
  return ops::GroupedTensors(params);
}

void check_layout(at::TensorList params, bool stacked, int64_t stacked_dim, const char* what) {
  if (!stacked) return;
  TORCH_CHECK(params.size() == 1 && params[0].dim() == stacked_dim, "GroupedLinearFunction: ", what,
              " must be one ", stacked_dim, "-D tensor when grouped, got ", params.size(),
              " tensor(s)", params.empty() ? "" : " of rank " + std::to_string(params[0].dim()));
}

// New [G, ...] gradient buffers, allocated in one piece either way, so that the ops find them
// equally spaced (the sm90 kernel then needs no address table).
at::Tensor new_group_buffer(at::IntArrayRef shape, size_t groups,
                            const at::TensorOptions& options) {
  std::vector<int64_t> sizes{static_cast<int64_t>(groups)};
  sizes.insert(sizes.end(), shape.begin(), shape.end());
  return at::empty(sizes, options);
}

// The gradients autograd receives for parameters in the given layout.
std::vector<at::Tensor> in_layout(const at::Tensor& buffer, bool stacked) {
  if (stacked) return {buffer};
  return buffer.unbind(0);
}

// The row map the GEMMs read the input through, or none.
at::Tensor gather_rows_of(const GroupedLinearConfig& config) {
  return config.input_gather ? config.input_gather->rows : at::Tensor();
}

// The layer's output, the same with or without autograd.
at::Tensor forward_output(const at::Tensor& input, const at::Tensor& scales, at::TensorList weights,
                          at::TensorList biases, const GroupedLinearConfig& config) {
  check_layout(weights, config.grouped_weight, 3, "weights");
  check_layout(biases, config.grouped_bias, 2, "biases");
  TORCH_CHECK(!config.input_activation || !config.input_gather, "GroupedLinearFunction: ",
              "config.input_activation and config.input_gather cannot both be set");
  const at::Tensor gemm_input =
      config.input_activation ? ops::glu_forward(input, scales, *config.input_activation) : input;
  return ops::grouped_linear_forward(config.plan, gemm_input,
                                     grouped(weights, config.grouped_weight),
                                     grouped(biases, config.grouped_bias), gather_rows_of(config));
}

}  // namespace

std::vector<GemmPlan> plan_layers(const char* module, const at::Tensor& input,
                                  c10::ArrayRef<GemmShape> shapes, const SplitSizes& m_splits,
                                  GemmBackend backend, const at::Tensor& gather_rows) {
  return ops::plan_grouped_gemms(module, input, shapes, m_splits, backend, gather_rows);
}

at::Tensor GroupedLinearFunction::forward(AutogradContext* ctx, const at::Tensor& input,
                                          const std::optional<at::Tensor>& input_scales,
                                          at::TensorList weights, at::TensorList biases,
                                          const c10::intrusive_ptr<GroupedLinearConfig>& config) {
  TORCH_CHECK(config, "GroupedLinearFunction: config must not be null");
  TORCH_CHECK(!input_scales.has_value() || config->input_activation, "GroupedLinearFunction: ",
              "input_scales are the input activation's scales; config.input_activation is unset");
  const at::Tensor scales = input_scales.value_or(at::Tensor());
  at::Tensor output = forward_output(input, scales, weights, biases, *config);
  ctx->save_for_backward({input, scales});
  config->weights = weights.vec();
  config->weight_versions.clear();
  for (const at::Tensor& w : weights) config->weight_versions.push_back(w._version());
  ctx->saved_data["num_biases"] = static_cast<int64_t>(biases.size());
  ctx->saved_data["config"] = c10::IValue::make_capsule(config);
  return output;
}

variable_list GroupedLinearFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor& input = saved[0];
  const at::Tensor& scales = saved[1];
  const auto num_biases = static_cast<size_t>(ctx->saved_data["num_biases"].toInt());
  const auto config = c10::static_intrusive_pointer_cast<GroupedLinearConfig>(
      ctx->saved_data["config"].toCapsule());
  const GroupedLinearConfig& cfg = *config;
  const at::TensorList weights = cfg.weights;
  const auto num_weights = weights.size();
  const size_t groups = cfg.plan.shape.groups;
  const at::Tensor grad_output = grad_outputs[0].contiguous();

  // Gradient slots: input, input_scales, weights..., biases..., config (one per forward
  // argument). Autograd edges exist only for tensors given: input_scales has none when absent.
  constexpr size_t kFirstWeightSlot = 2;
  const size_t first_weight = scales.defined() ? 2 : 1;  // edge index
  variable_list grads(kFirstWeightSlot + num_weights + num_biases + 1);
  const bool scales_need_grad = scales.defined() && ctx->needs_input_grad(1);
  if (ctx->needs_input_grad(0) || scales_need_grad) {
    for (size_t i = 0; i < num_weights; ++i) {
      TORCH_CHECK(weights[i]._version() == cfg.weight_versions[i],
                  "GroupedLinear backward: weight ", i, " was modified in place after the forward ",
                  "(version ", cfg.weight_versions[i], ", now ", weights[i]._version(),
                  "); its gradient would be wrong. Run backward before changing the weights.");
    }
    at::Tensor grad_gemm_input =
        ops::grouped_linear_dgrad(cfg.plan, grad_output, grouped(weights, cfg.grouped_weight));
    if (cfg.input_activation) {
      ops::GluGrads glu = ops::glu_backward(grad_gemm_input, input, scales, *cfg.input_activation,
                                            scales_need_grad);
      grads[0] = std::move(glu.grad_input);
      if (scales_need_grad) grads[1] = std::move(glu.grad_scales);
    } else if (cfg.input_gather) {
      grads[0] = ops::unpermute_rows(grad_gemm_input, cfg.input_gather->token_rows, at::Tensor());
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

  // Bias gradients in one [G, out] buffer, handed to autograd in the parameters' layout.
  const at::Tensor bias_grad =
      biases_need_grad ? new_group_buffer({cfg.plan.shape.n}, groups, grad_output.options())
                       : at::Tensor();
  const ops::GroupedTensors bias_grads =
      biases_need_grad ? ops::GroupedTensors::stacked(bias_grad) : ops::GroupedTensors();

  // The wgrad GEMM's input: recomputed here when forward saved the pre-activation instead.
  const at::Tensor gemm_input = weights_need_grad && cfg.input_activation
                                    ? ops::glu_forward(input, scales, *cfg.input_activation)
                                    : input;
  if (weights_need_grad && cfg.wgrad_queue) {
    // Delayed: dbias now (it is cheap and autograd wants it), the wgrad GEMM in backward_dw().
    cfg.wgrad_queue->push_back(DelayedWgrad{gemm_input, gather_rows_of(cfg), grad_output, config});
    if (biases_need_grad) ops::grouped_bias_grad(cfg.plan, grad_output, bias_grads);
  } else if (weights_need_grad && !cfg.main_grads.empty()) {
    ops::grouped_linear_wgrad(cfg.plan, gemm_input, grad_output,
                              grouped(cfg.main_grads, cfg.grouped_weight), !cfg.overwrite_main_grad,
                              bias_grads, gather_rows_of(cfg));
  } else if (weights_need_grad) {
    const at::Tensor weight_grad =
        new_group_buffer({cfg.plan.shape.n, cfg.plan.shape.k}, groups, gemm_input.options());
    ops::grouped_linear_wgrad(cfg.plan, gemm_input, grad_output,
                              ops::GroupedTensors::stacked(weight_grad),
                              /*accumulate=*/false, bias_grads, gather_rows_of(cfg));
    const std::vector<at::Tensor> weight_grads = in_layout(weight_grad, cfg.grouped_weight);
    std::copy(weight_grads.begin(), weight_grads.end(), grads.begin() + kFirstWeightSlot);
  } else if (biases_need_grad) {
    ops::grouped_bias_grad(cfg.plan, grad_output, bias_grads);
  }
  if (biases_need_grad) {
    const std::vector<at::Tensor> per_layout = in_layout(bias_grad, cfg.grouped_bias);
    std::copy(per_layout.begin(), per_layout.end(), grads.begin() + kFirstWeightSlot + num_weights);
  }
  return grads;
}

at::Tensor grouped_linear(const at::Tensor& input, const std::optional<at::Tensor>& input_scales,
                          at::TensorList weights, at::TensorList biases,
                          const c10::intrusive_ptr<GroupedLinearConfig>& config) {
  bool needs_grad = input.requires_grad() || (input_scales && input_scales->requires_grad());
  for (const at::Tensor& t : weights) needs_grad |= t.requires_grad();
  for (const at::Tensor& t : biases) needs_grad |= t.requires_grad();
  if (at::GradMode::is_enabled() && needs_grad) {
    return GroupedLinearFunction::apply(input, input_scales, weights, biases, config);
  }
  return forward_output(input, input_scales.value_or(at::Tensor()), weights, biases, *config);
}

std::vector<at::Tensor> run_delayed_wgrad(const DelayedWgrad& work) {
  // Called from user code (backward_dw), where grad mode is on; like backward, this writes into
  // gradient buffers, which autograd must not track.
  const at::NoGradGuard no_grad;
  const GroupedLinearConfig& cfg = *work.config;
  if (!cfg.main_grads.empty()) {
    ops::grouped_linear_wgrad(cfg.plan, work.input, work.grad_output,
                              grouped(cfg.main_grads, cfg.grouped_weight), !cfg.overwrite_main_grad,
                              {}, work.gather_rows);
    return {};
  }
  const at::Tensor weight_grad = new_group_buffer({cfg.plan.shape.n, cfg.plan.shape.k},
                                                  cfg.plan.shape.groups, work.input.options());
  ops::grouped_linear_wgrad(cfg.plan, work.input, work.grad_output,
                            ops::GroupedTensors::stacked(weight_grad),
                            /*accumulate=*/false, {}, work.gather_rows);
  return in_layout(weight_grad, cfg.grouped_weight);
}

}  // namespace torchmoe::autograd
