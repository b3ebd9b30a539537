#include "torchmoe/autograd/grouped_linear_function.h"

#include <ATen/ATen.h>

#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <variant>

#include "torchmoe/autograd/once_differentiable.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_fp8.h"
#include "torchmoe/ops/token_permutation.h"

namespace torchmoe::autograd {
namespace {

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
  return ops::new_empty(sizes, options);
}

// The gradients autograd receives for parameters in the given layout.
std::vector<at::Tensor> in_layout(const at::Tensor& buffer, bool stacked) {
  if (stacked) return {buffer};
  return buffer.unbind(0);
}

// The row map the GEMMs read the input through, or none (no map, or a gathered copy).
at::Tensor gather_rows_of(const GroupedLinearConfig& config) {
  return config.input_gather && !config.input_gather->gathered.defined() ? config.input_gather->rows
                                                                         : at::Tensor();
}

// What the 16-bit GEMMs read as their input when it is not an activation: the caller's gathered
// copy, or `input` (itself, or read through gather_rows_of).
const at::Tensor& gemm_rows(const GroupedLinearConfig& config, const at::Tensor& input) {
  return config.input_gather && config.input_gather->gathered.defined()
             ? config.input_gather->gathered
             : input;
}

// Where forward adds its output rows (config.output_scatter), or nowhere.
ops::RowScatter output_scatter_of(const GroupedLinearConfig& config) {
  if (!config.output_scatter) return {};
  return {config.output_scatter->rows, config.output_scatter->token_rows.size(0)};
}

// Whether dgrad adds its rows into the un-gathered input's (RowGather): at most two per input row.
bool scatters_input_grad(const GroupedLinearConfig& config) {
  return config.input_gather && !config.fp8 && config.input_gather->token_rows.size(1) <= 2;
}

// Which gradients a forward must keep what for (FP8 keeps only the copies backward reads).
struct BackwardNeeds {
  bool input = false;    // d input (or d input_scales): dgrad reads the weights' columnwise copy
  bool weights = false;  // d weights: wgrad reads the input's columnwise copy
};

// split_quantize's arguments for `role`'s tensor: the plan's options for it, the copies asked for,
// and with delayed scaling the layer's scale and the amax row this call's amax is maxed into (row
// 0 of the history).
struct Fp8QuantizeArgs {
  ops::SplitQuantizeOptions options;
  at::Tensor scale, amax;
};

Fp8QuantizeArgs quantize_args(const ops::SplitQuantizeOptions& planned, const fp8::Fp8State& state,
                              fp8::TensorRole role, bool rowwise, bool columnwise) {
  Fp8QuantizeArgs args;
  args.options = planned;
  args.options.rowwise = rowwise;
  args.options.columnwise = columnwise;
  if (planned.scaling == ops::QuantizeScaling::kDelayed) {
    TORCH_INTERNAL_ASSERT(state, "GroupedLinearFunction: delayed scaling without FP8 state");
    const fp8::DelayedScalingTensors& t = state->tensors(role);
    args.scale = t.scale;
    args.amax = t.amax_history.select(0, 0);
  }
  return args;
}

}  // namespace

at::Tensor linked_gradient_placeholder(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::zeros({1}, options).expand(sizes);
}

ops::SplitQuantized quantize_linked_gradient(const Fp8GradLink& link, const at::Tensor& grad,
                                             const at::Tensor& gather_rows) {
  TORCH_INTERNAL_ASSERT(link.armed, "quantize_linked_gradient: the link is not armed");
  const Fp8QuantizeArgs args = quantize_args(link.options, link.state, fp8::TensorRole::kGradOutput,
                                             link.rowwise, link.columnwise);
  if (!gather_rows.defined()) {
    return ops::split_quantize(grad, *link.m_splits, args.options, args.scale, args.amax);
  }
  return ops::gather_split_quantize(grad, gather_rows, *link.m_splits, args.options, args.scale,
                                    args.amax);
}

namespace {

ops::SplitQuantized split_quantize(const at::Tensor& t, const GemmPlan& plan,
                                   const Fp8QuantizeArgs& args) {
  return ops::split_quantize(t, plan.m_splits, args.options, args.scale, args.amax);
}

// The weights' FP8 copies for this call: the optimizer's, or quantized now, or made now and cached
// (is_first_microbatch true), or the cached ones (false). A cache always holds both copies: a
// later micro-batch's backward reads the columnwise one.
ops::SplitQuantized fp8_weights(Fp8Config& f, const ops::SplitQuantizeOptions& planned,
                                const ops::GroupedTensors& weights, bool columnwise) {
  if (f.optimizer_weights) {
    // A later is_first_microbatch=false call reuses what this first micro-batch read.
    if (f.is_first_microbatch.value_or(false))
      f.weight_cache->weights = f.weight_cache->optimizer_weights;
    return f.weight_cache->optimizer_weights;
  }
  auto quantize = [&](bool both) {
    const Fp8QuantizeArgs args =
        quantize_args(planned, f.state, fp8::TensorRole::kWeight, true, both);
    return ops::quantize_weights(weights, args.options, args.scale, args.amax);
  };
  if (!f.is_first_microbatch.has_value()) return quantize(columnwise);
  Fp8WeightCache& cache = *f.weight_cache;
  if (*f.is_first_microbatch) {
    cache.weights = quantize(true);
    return cache.weights;
  }
  TORCH_CHECK(cache.weights.data.defined(), "GroupedLinear: is_first_microbatch=false reuses the ",
              "FP8 weights cached by a call with is_first_microbatch=true, and there was none");
  // The cached copies must be what this call's recipe would make: the same format and scaling (a
  // block shape or format change would otherwise meet the other operand in a GEMM it was not made
  // for).
  TORCH_CHECK(cache.weights.format == planned.format && cache.weights.scaling == planned.scaling,
              "GroupedLinear: is_first_microbatch=false under a recipe whose weights differ in ",
              "format or scaling from the cached FP8 weights; pass is_first_microbatch=true when ",
              "the recipe changes");
  return cache.weights;
}

// The FP8 forward: quantize the GEMM input and the weights, one FP8 product, keep the copies
// backward reads in the config. The GEMM input is `input` itself, its gathered rows or its
// activation, the last two made inside the quantize (neither the gathered rows nor the 16-bit
// activation is written; FP8 GEMMs read no row map).
at::Tensor fp8_forward_output(const at::Tensor& input, const at::Tensor& scales,
                              at::TensorList weights, at::TensorList biases,
                              GroupedLinearConfig& config, BackwardNeeds needs) {
  Fp8Config& f = *config.fp8;
  const GemmPlan& plan = config.plan;
  const Fp8QuantizeArgs args =
      quantize_args(plan.fp8->input, f.state, fp8::TensorRole::kInput, true, needs.weights);
  ops::SplitQuantized quantized;
  if (config.input_activation) {
    quantized = ops::glu_split_quantize(input.contiguous(), scales, *config.input_activation,
                                        plan.m_splits, args.options, args.scale, args.amax);
  } else if (config.input_gather) {
    const at::Tensor& rows = config.input_gather->rows;
    TORCH_CHECK(rows.size(0) == plan.rows, "GroupedLinearFunction: input_gather must name the ",
                "plan's ", plan.rows, " rows, got ", rows.size(0));
    quantized = ops::gather_split_quantize(input.contiguous(), rows.to(at::kLong), plan.m_splits,
                                           args.options, args.scale, args.amax);
  } else {
    TORCH_CHECK(input.size(0) == plan.rows, "GroupedLinearFunction: input must have the plan's ",
                plan.rows, " rows, got ", input.size(0));
    quantized = split_quantize(input.contiguous(), plan, args);
  }
  ops::SplitQuantized w =
      fp8_weights(f, plan.fp8->weight, grouped(weights, config.grouped_weight), needs.input);
  at::Tensor output = ops::grouped_linear_forward_fp8(
      plan, quantized, w, grouped(biases, config.grouped_bias), input.scalar_type());
  if (needs.weights) {
    quantized.data = at::Tensor();  // backward reads the columnwise copy only
    f.input = std::move(quantized);
  }
  if (needs.input) f.weights = std::move(w);
  return output;
}

// The layer's output, the same with or without autograd.
at::Tensor forward_output(const at::Tensor& input, const at::Tensor& scales, at::TensorList weights,
                          at::TensorList biases, GroupedLinearConfig& config, BackwardNeeds needs) {
  check_layout(weights, config.grouped_weight, 3, "weights");
  check_layout(biases, config.grouped_bias, 2, "biases");
  TORCH_CHECK(!config.input_activation || !config.input_gather, "GroupedLinearFunction: ",
              "config.input_activation and config.input_gather cannot both be set");
  TORCH_CHECK(config.fp8.has_value() == config.plan.fp8.has_value(), "GroupedLinearFunction: ",
              "config.fp8 must be set exactly when the plan is an FP8 plan");
  TORCH_CHECK(!config.fp8 || !config.output_scatter, "GroupedLinearFunction: ",
              "config.output_scatter is for 16-bit plans; FP8 products write their rows");
  if (config.fp8) return fp8_forward_output(input, scales, weights, biases, config, needs);
  const at::Tensor gemm_input = config.input_activation
                                    ? ops::glu_forward(input, scales, *config.input_activation)
                                    : gemm_rows(config, input);
  return ops::grouped_linear_forward(
      config.plan, gemm_input, grouped(weights, config.grouped_weight),
      grouped(biases, config.grouped_bias), gather_rows_of(config), output_scatter_of(config));
}

// The weight-gradient GEMM of either precision: from the 16-bit input and grad_output, or from
// their FP8 columnwise copies (then bias gradients come from grad_output's column sums).
void run_wgrad(const GroupedLinearConfig& cfg, const at::Tensor& input,
               const at::Tensor& gather_rows, const at::Tensor& grad_output,
               const ops::SplitQuantized& fp8_input, const ops::SplitQuantized& fp8_grad_output,
               const ops::GroupedTensors& out, bool accumulate,
               const ops::GroupedTensors& bias_grads) {
  if (!cfg.fp8) {
    ops::grouped_linear_wgrad(cfg.plan, input, grad_output, out, accumulate, bias_grads,
                              gather_rows);
    return;
  }
  ops::grouped_linear_wgrad_fp8(cfg.plan, fp8_input, fp8_grad_output, out, accumulate);
  if (!bias_grads.empty()) ops::grouped_bias_grad(cfg.plan, grad_output, bias_grads);
}

// The layer's autograd node. Its edges: the input, the input scales (when given), the weights'
// stacked edge, the biases' stacked edge (when there are biases); backward returns a gradient for
// each (undefined where none is needed) and the weights' and biases' stacked, [G, ...].
class GroupedLinearFunction final : public torch::autograd::Node {
 public:
  variable_list apply(variable_list&& grad_outputs) override;
  std::string name() const override { return "torchmoe::autograd::GroupedLinearFunction"; }
  void release_variables() override {
    input_.reset_data();
    scales_.reset_data();
    config_.reset();
  }

  torch::autograd::SavedVariable input_, scales_;
  c10::intrusive_ptr<GroupedLinearConfig> config_;
  bool has_scales_ = false, has_biases_ = false;
};

variable_list GroupedLinearFunction::apply(variable_list&& grad_outputs) {
  const OnceDifferentiable once;
  TORCH_CHECK(config_, "GroupedLinear backward: trying to backward through the graph a second ",
              "time; its saved tensors were freed by the first backward (pass retain_graph=true ",
              "to the first)");
  const at::Tensor input = input_.unpack(shared_from_this());
  const at::Tensor scales = scales_.unpack(shared_from_this());
  // Autograd hands an undefined gradient when whatever consumed the output returned none for it.
  if (!grad_outputs[0].defined()) grad_outputs[0] = input_metadata(0).zeros_like();
  const GroupedLinearConfig& cfg = *config_;
  const at::TensorList weights = *cfg.weights;
  const size_t groups = cfg.plan.shape.groups;
  // Linked (Fp8GradLink): grad_outputs[0] is a placeholder, and the FP8 copies wait in the link.
  std::optional<ops::SplitQuantized> linked_grad;
  if (cfg.grad_output_link) linked_grad.swap(cfg.grad_output_link->grad);
  if (linked_grad) {
    // Anything but the producer's placeholder (linked_gradient_placeholder: every stride 0) means
    // autograd summed another gradient into the output, which the quantized copies do not hold.
    bool placeholder = true;
    for (const int64_t stride : grad_outputs[0].strides()) placeholder &= stride == 0;
    TORCH_CHECK(placeholder, "GroupedLinear backward: this layer's output gradient was handed ",
                "over already quantized (Fp8GradLink), but the output was also used elsewhere; a ",
                "linked output must feed only the function that produces its gradient");
  }
  // A scattered output's gradient is read back in GEMM order: row i is that of its output row.
  const at::Tensor grad_output =
      linked_grad ? grad_outputs[0]
      : cfg.output_scatter
          ? ops::permute_rows(grad_outputs[0].contiguous(), cfg.output_scatter->token_rows,
                              cfg.output_scatter->sorted_slots, at::Tensor())
          : grad_outputs[0].contiguous();

  const size_t weight_edge = has_scales_ ? 2 : 1, bias_edge = weight_edge + 1;
  variable_list grads(num_outputs());
  const bool scales_need_grad = has_scales_ && task_should_compute_output(1);
  const bool input_needs_grad = task_should_compute_output(0) || scales_need_grad;
  const bool weights_need_grad = task_should_compute_output(weight_edge);
  const bool biases_need_grad = has_biases_ && task_should_compute_output(bias_edge);
  // FP8: the output gradient's rowwise copy for dgrad, its columnwise one for wgrad.
  ops::SplitQuantized fp8_grad_output;
  if (linked_grad) {
    fp8_grad_output = std::move(*linked_grad);
  } else if (cfg.fp8 && (input_needs_grad || weights_need_grad)) {
    fp8_grad_output = split_quantize(
        grad_output, cfg.plan,
        quantize_args(cfg.plan.fp8->grad_output, cfg.fp8->state, fp8::TensorRole::kGradOutput,
                      input_needs_grad, weights_need_grad));
  }

  if (input_needs_grad) {
    at::Tensor grad_gemm_input;
    if (cfg.fp8) {
      grad_gemm_input = ops::grouped_linear_dgrad_fp8(cfg.plan, fp8_grad_output, cfg.fp8->weights,
                                                      grad_output.scalar_type());
    } else {
      const std::vector<uint32_t> versions = tensor_versions(weights);
      for (size_t i = 0; i < weights.size(); ++i) {
        TORCH_CHECK(versions[i] == cfg.weight_versions[i], "GroupedLinear backward: weight ", i,
                    " was modified in place after the forward (version ", cfg.weight_versions[i],
                    ", now ", versions[i],
                    "); its gradient would be wrong. Run backward before changing the weights.");
      }
      const ops::RowScatter scatter =
          scatters_input_grad(cfg)
              ? ops::RowScatter{cfg.input_gather->rows, cfg.input_gather->token_rows.size(0)}
              : ops::RowScatter{};
      grad_gemm_input = ops::grouped_linear_dgrad(cfg.plan, grad_output,
                                                  grouped(weights, cfg.grouped_weight), scatter);
    }
    Fp8GradLink* link = cfg.grad_input_link.get();
    if (cfg.input_activation && link != nullptr && link->armed && task_should_compute_output(0)) {
      // The activation's gradient goes to the previous layer (fc1) as its FP8 copies.
      TORCH_INTERNAL_ASSERT(link->rows == cfg.plan.rows, "GroupedLinearFunction: linked layers ",
                            "must share their rows");
      const Fp8QuantizeArgs args =
          quantize_args(link->options, link->state, fp8::TensorRole::kGradOutput, link->rowwise,
                        link->columnwise);
      ops::GluGradsQuantized glu = ops::glu_backward_split_quantize(
          grad_gemm_input, input, scales, *cfg.input_activation, scales_need_grad,
          cfg.plan.m_splits, args.options, args.scale, args.amax);
      link->grad = std::move(glu.grad_input);
      grads[0] = linked_gradient_placeholder(input.sizes(), input.options());
      if (scales_need_grad) grads[1] = std::move(glu.grad_scales);
    } else if (cfg.input_activation) {
      ops::GluGrads glu = ops::glu_backward(grad_gemm_input, input, scales, *cfg.input_activation,
                                            scales_need_grad);
      grads[0] = std::move(glu.grad_input);
      if (scales_need_grad) grads[1] = std::move(glu.grad_scales);
    } else if (cfg.input_gather && !scatters_input_grad(cfg)) {
      grads[0] = ops::unpermute_rows(grad_gemm_input, cfg.input_gather->token_rows, at::Tensor());
    } else {
      grads[0] = std::move(grad_gemm_input);
    }
  }

  // Bias gradients in one [G, out] buffer, the layout of their edge.
  const at::Tensor bias_grad =
      biases_need_grad ? new_group_buffer({cfg.plan.shape.n}, groups, grad_output.options())
                       : at::Tensor();
  const ops::GroupedTensors bias_grads =
      biases_need_grad ? ops::GroupedTensors::stacked(bias_grad) : ops::GroupedTensors();

  // The 16-bit wgrad GEMM's input: recomputed here when forward saved the pre-activation instead
  // (FP8 kept the activation's columnwise copy).
  const at::Tensor gemm_input = weights_need_grad && cfg.input_activation && !cfg.fp8
                                    ? ops::glu_forward(input, scales, *cfg.input_activation)
                                    : gemm_rows(cfg, input);
  const ops::SplitQuantized fp8_input = cfg.fp8 ? cfg.fp8->input : ops::SplitQuantized();
  if (weights_need_grad && cfg.wgrad_queue) {
    // Delayed: dbias now (it is cheap and autograd wants it), the wgrad GEMM in backward_dw().
    cfg.wgrad_queue->push_back(DelayedWgrad{cfg.fp8 ? at::Tensor() : gemm_input,
                                            gather_rows_of(cfg), grad_output, fp8_input,
                                            fp8_grad_output, config_});
    if (biases_need_grad) ops::grouped_bias_grad(cfg.plan, grad_output, bias_grads);
  } else if (weights_need_grad && !cfg.main_grads.empty()) {
    run_wgrad(cfg, gemm_input, gather_rows_of(cfg), grad_output, fp8_input, fp8_grad_output,
              grouped(cfg.main_grads, cfg.grouped_weight), !cfg.overwrite_main_grad, bias_grads);
  } else if (weights_need_grad) {
    const at::Tensor weight_grad =
        new_group_buffer({cfg.plan.shape.n, cfg.plan.shape.k}, groups, grad_output.options());
    run_wgrad(cfg, gemm_input, gather_rows_of(cfg), grad_output, fp8_input, fp8_grad_output,
              ops::GroupedTensors::stacked(weight_grad), /*accumulate=*/false, bias_grads);
    grads[weight_edge] = weight_grad;
  } else if (biases_need_grad) {
    ops::grouped_bias_grad(cfg.plan, grad_output, bias_grads);
  }
  if (biases_need_grad) grads[bias_edge] = bias_grad;
  return once_differentiable("GroupedLinearFunction", once, std::move(grads));
}

// Refuses forward-mode AD, which the layer does not implement, rather than dropping tangents.
// Looked at only while a dual level exists, so that a call does not lock G tensors' metadata.
void check_no_tangents(const at::Tensor& input, const at::Tensor& scales, at::TensorList weights,
                       at::TensorList biases) {
  if (!torch::autograd::ForwardADLevel::try_get_by_idx(0)) return;
  bool tangent = input._fw_grad(0).defined() || (scales.defined() && scales._fw_grad(0).defined());
  for (const at::Tensor& t : weights) tangent |= t._fw_grad(0).defined();
  for (const at::Tensor& t : biases) tangent |= t._fw_grad(0).defined();
  TORCH_CHECK_NOT_IMPLEMENTED(!tangent,
                              "GroupedLinear: forward-mode AD (a dual tensor argument) is not "
                              "supported");
}

}  // namespace

std::vector<uint32_t> tensor_versions(at::TensorList tensors) {
  std::vector<uint32_t> versions;
  versions.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    versions.push_back(t.unsafeGetTensorImpl()->version_counter().current_version());
  }
  return versions;
}

at::Tensor grouped_linear(const at::Tensor& input, const std::optional<at::Tensor>& input_scales,
                          at::TensorList weights, at::TensorList biases,
                          const c10::intrusive_ptr<GroupedLinearConfig>& config,
                          GroupedLinearEdges* kept) {
  TORCH_CHECK(config, "GroupedLinearFunction: config must not be null");
  TORCH_CHECK(!input_scales.has_value() || config->input_activation, "GroupedLinearFunction: ",
              "input_scales are the input activation's scales; config.input_activation is unset");
  const at::Tensor scales = input_scales.value_or(at::Tensor());
  if (!at::GradMode::is_enabled()) {
    return forward_output(input, scales, weights, biases, *config, BackwardNeeds{});
  }
  GroupedLinearEdges local;
  GroupedLinearEdges& edges = kept != nullptr ? *kept : local;
  StackedGradEdge::Resolved w = edges.weights.resolve(weights, config->grouped_weight);
  StackedGradEdge::Resolved b = edges.biases.resolve(biases, config->grouped_bias);
  BackwardNeeds needs;
  needs.input = input.requires_grad() || (scales.defined() && scales.requires_grad());
  needs.weights = w.requires_grad;
  if (!needs.input && !needs.weights && !b.requires_grad) {
    return forward_output(input, scales, weights, biases, *config, BackwardNeeds{});
  }
  check_no_tangents(input, scales, weights, biases);
  at::Tensor output;
  {
    const at::AutoGradMode no_grad(false);
    output = forward_output(input, scales, weights, biases, *config, needs);
  }
  // Backward reads the input only to differentiate a fused activation (its pre-activation) or as
  // the GEMMs' 16-bit input read through a row map. FP8 reads the quantized copies kept in the
  // config, and a gathered copy (input_gather) serves wgrad in its place; a gathered input's
  // gradient has input_gather's token_rows rows. (Not holding the input matters where nothing
  // else does: the rows an expert-parallel exchange received.)
  const bool gathered_copy = config->input_gather && config->input_gather->gathered.defined();
  const bool keeps_input =
      config->input_activation || (!gathered_copy && (!config->fp8 || config->input_gather));
  if (config->grad_output_link && config->fp8) {
    Fp8GradLink& link = *config->grad_output_link;
    link.armed = !b.requires_grad;
    link.options = config->plan.fp8->grad_output;
    link.state = config->fp8->state;
    link.rows = config->plan.rows;
    link.m_splits = config->plan.m_splits;
    link.rowwise = needs.input;
    link.columnwise = needs.weights;
  }
  config->weights = std::move(w.tensors);
  config->weight_versions = tensor_versions(weights);

  auto node = std::shared_ptr<GroupedLinearFunction>(new GroupedLinearFunction(),
                                                     torch::autograd::deleteNode);
  torch::autograd::edge_list next;
  next.reserve(4);
  next.push_back(torch::autograd::impl::gradient_edge(input));
  if (scales.defined()) next.push_back(torch::autograd::impl::gradient_edge(scales));
  next.push_back(std::move(w.edge));
  if (!biases.empty()) next.push_back(std::move(b.edge));
  node->set_next_edges(std::move(next));
  node->input_ = torch::autograd::SavedVariable(keeps_input ? input : at::Tensor(), false);
  node->scales_ = torch::autograd::SavedVariable(scales, false);
  node->config_ = config;
  node->has_scales_ = scales.defined();
  node->has_biases_ = !biases.empty();
  torch::autograd::set_history(output, node);
  return output;
}

std::vector<at::Tensor> run_delayed_wgrad(const DelayedWgrad& work) {
  // Called from user code (backward_dw), where grad mode is on; like backward, this writes into
  // gradient buffers, which autograd must not track.
  const at::NoGradGuard no_grad;
  const GroupedLinearConfig& cfg = *work.config;
  if (!cfg.main_grads.empty()) {
    run_wgrad(cfg, work.input, work.gather_rows, work.grad_output, work.fp8_input,
              work.fp8_grad_output, grouped(cfg.main_grads, cfg.grouped_weight),
              !cfg.overwrite_main_grad, {});
    return {};
  }
  const at::Tensor weight_grad = new_group_buffer(
      {cfg.plan.shape.n, cfg.plan.shape.k}, cfg.plan.shape.groups, work.grad_output.options());
  run_wgrad(cfg, work.input, work.gather_rows, work.grad_output, work.fp8_input,
            work.fp8_grad_output, ops::GroupedTensors::stacked(weight_grad),
            /*accumulate=*/false, {});
  return in_layout(weight_grad, cfg.grouped_weight);
}

}  // namespace torchmoe::autograd
