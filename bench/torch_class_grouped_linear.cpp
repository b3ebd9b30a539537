// torchmoe's GroupedLinear as a TorchScript custom class (libtorchmoe_bench_classes.so), so that a
// Python process can time it next to TransformerEngine's te.GroupedLinear, taking turns in the
// same process (bench/bench_te_grouped_linear.py):
//
//   torch.ops.load_library("build/bench/libtorchmoe_bench_classes.so")
//   step = torch.classes.torchmoe_bench.GroupedLinearStep(experts, in_features, out_features,
//                                                         "current")
//   y = step.forward_backward(x, device_splits, host_splits, grad_output)  # host_splits may be []
//
// The layer: bf16 parameters, no bias, the library's defaults otherwise (kAuto). Each
// forward_backward is one training step of the layer as a C++ loop runs it: the gradients set to
// none, the forward under fp8::Autocast with the recipe ("bf16": none), the backward, and under
// delayed scaling the forward and backward updates of the amax histories. The weights are cast
// every call (is_first_microbatch unset), as TE's are at its defaults.

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torchmoe/torchmoe.h>

#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace {

namespace fp8 = torchmoe::fp8;

std::optional<fp8::Recipe> recipe_named(const std::string& name) {
  if (name == "bf16") return std::nullopt;
  if (name == "delayed") return fp8::Recipe(fp8::DelayedScaling());  // TE's default history
  if (name == "current") return fp8::Recipe(fp8::CurrentScaling());
  if (name == "block") return fp8::Recipe(fp8::BlockScaling());
  TORCH_CHECK(false, "GroupedLinearStep: recipe must be bf16, delayed, current or block, got '",
              name, "'");
}

class GroupedLinearStep : public torch::CustomClassHolder {
 public:
  GroupedLinearStep(int64_t experts, int64_t in_features, int64_t out_features,
                    const std::string& recipe)
      : recipe_(recipe_named(recipe)),
        layer_(torchmoe::GroupedLinearOptions(experts, in_features, out_features)
                   .bias(false)
                   .params_dtype(at::kBFloat16)
                   .device(at::kCUDA)
                   .fp8_amax_history_len(fp8::DelayedScaling().amax_history_len())) {}

  // Copies `weight` ([experts, out_features, in_features]) into the layer's weights.
  void load_weights(const at::Tensor& weight) {
    const std::vector<at::Tensor>& weights = layer_->weight_parameters();
    TORCH_CHECK(weight.dim() == 3 && weight.size(0) == static_cast<int64_t>(weights.size()) &&
                    weight[0].sizes() == weights[0].sizes(),
                "GroupedLinearStep.load_weights: weight must be [", weights.size(), ", ",
                weights[0].size(0), ", ", weights[0].size(1), "], got ", weight.sizes());
    at::NoGradGuard no_grad;
    for (size_t g = 0; g < weights.size(); ++g) weights[g].copy_(weight[g]);
  }

  // The forward alone, with autograd (what a training forward runs).
  at::Tensor forward(const at::Tensor& input, const at::Tensor& device_splits,
                     std::vector<int64_t> host_splits) {
    const fp8::Autocast guard(recipe_.value_or(fp8::Recipe(fp8::CurrentScaling())),
                              recipe_.has_value());
    return layer_(input, splits(device_splits, std::move(host_splits)));
  }

  // Weight g's gradient (after forward_backward).
  at::Tensor weight_grad(int64_t g) const {
    const std::vector<at::Tensor>& weights = layer_->weight_parameters();
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(weights.size()),
                "GroupedLinearStep.weight_grad: g must be in [0, ", weights.size(), "), got ", g);
    return weights[g].grad();
  }

  // Sets the weights' gradients to none.
  void zero_grad() {
    for (const at::Tensor& weight : layer_->weight_parameters())
      weight.mutable_grad() = at::Tensor();
  }

  // One training step; returns the forward's output.
  at::Tensor forward_backward(const at::Tensor& input, const at::Tensor& device_splits,
                              std::vector<int64_t> host_splits, const at::Tensor& grad_output) {
    input.mutable_grad() = at::Tensor();
    zero_grad();
    at::Tensor output = forward(input, device_splits, std::move(host_splits));
    output.backward(grad_output);
    if (const auto* delayed = recipe_ ? std::get_if<fp8::DelayedScaling>(&*recipe_) : nullptr) {
      fp8::update_delayed_scaling(*layer_, *delayed, fp8::Pass::kForward);
      fp8::update_delayed_scaling(*layer_, *delayed, fp8::Pass::kBackward);
    }
    return output;
  }

 private:
  static torchmoe::SplitSizes splits(const at::Tensor& device, std::vector<int64_t> host) {
    if (host.empty()) return torchmoe::SplitSizes(device);
    return torchmoe::SplitSizes(std::move(host), device);
  }

  std::optional<fp8::Recipe> recipe_;
  torchmoe::GroupedLinear layer_;
};

TORCH_LIBRARY(torchmoe_bench, m) {
  m.class_<GroupedLinearStep>("GroupedLinearStep")
      .def(torch::init<int64_t, int64_t, int64_t, std::string>())
      .def("load_weights", &GroupedLinearStep::load_weights)
      .def("weight_grad", &GroupedLinearStep::weight_grad)
      .def("zero_grad", &GroupedLinearStep::zero_grad)
      .def("forward", &GroupedLinearStep::forward)
      .def("forward_backward", &GroupedLinearStep::forward_backward);
}

}  // namespace
