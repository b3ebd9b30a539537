#include "torchmoe/modules/grouped_mlp.h"

#include <utility>

#include "torchmoe/autograd/glu_function.h"

namespace torchmoe {
namespace {

constexpr const char* kModule = "GroupedMLP";

GroupedLinearOptions layer_options(const GroupedMLPOptions& o, int64_t in, int64_t out) {
  return GroupedLinearOptions(o.num_experts(), in, out)
      .bias(o.bias())
      .params_dtype(o.params_dtype())
      .device(o.device())
      .fuse_wgrad_accumulation(o.fuse_wgrad_accumulation())
      .delay_wgrad_compute(o.delay_wgrad_compute())
      .single_grouped_weight(o.single_grouped_weight())
      .single_grouped_bias(o.single_grouped_bias())
      .gemm_backend(o.gemm_backend());
}

}  // namespace

GroupedMLPOptions::GroupedMLPOptions(int64_t num_experts, int64_t hidden, int64_t ffn_hidden)
    : num_experts_(num_experts), hidden_(hidden), ffn_hidden_(ffn_hidden) {}

GroupedMLPImpl::GroupedMLPImpl(GroupedMLPOptions options_) : options(std::move(options_)) {
  reset();
}

void GroupedMLPImpl::reset() {
  TORCH_CHECK(options.ffn_hidden() > 0, kModule, ": ffn_hidden must be positive, got ",
              options.ffn_hidden());
  fc1 = register_module(
      "fc1", GroupedLinear(layer_options(options, options.hidden(), 2 * options.ffn_hidden())));
  fc2 = register_module(
      "fc2", GroupedLinear(layer_options(options, options.ffn_hidden(), options.hidden())));
}

void GroupedMLPImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "torchmoe::GroupedMLP(num_experts=" << options.num_experts()
         << ", hidden=" << options.hidden() << ", ffn_hidden=" << options.ffn_hidden()
         << ", bias=" << options.bias() << ", activation="
         << (options.activation() == GroupedMLPActivation::kSwiGLU ? "swiglu" : "clamped_swiglu")
         << ")";
}

torch::Tensor GroupedMLPImpl::forward(const torch::Tensor& x, const SplitSizes& m_splits,
                                      const torch::Tensor& probs,
                                      std::optional<bool> is_first_microbatch) {
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(1) == options.hidden(), kModule,
              ": x must be [rows, hidden=", options.hidden(), "], got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(probs.defined() && probs.dim() == 1 && probs.size(0) == x.size(0), kModule,
              ": probs must be [rows] with one probability per row of x (", x.size(0), "), got ",
              probs.defined() ? probs.sizes() : torch::IntArrayRef{});
  // One decision for both layers: device sizes stay on the device only where fc1 runs on the sm90
  // kernel (fc2 decides again for its own shape).
  const SplitSizes splits =
      ops::resolve_splits(m_splits, x, fc1->expert_weights(), options.gemm_backend());
  const torch::Tensor z = fc1(x, splits, is_first_microbatch);
  ops::GluOptions activation;
  if (options.activation() == GroupedMLPActivation::kSwiGLU) {
    activation = glu_options(SwiGLUOptions().glu_interleave_size(options.glu_interleave_size()));
  } else {
    ClampedSwiGLUOptions clamped = options.clamped();
    activation = glu_options(clamped.glu_interleave_size(options.glu_interleave_size()));
  }
  torch::Tensor y;
  if (options.recompute_activation()) {
    y = fc2->forward_with_activation(z, probs, activation, splits, is_first_microbatch);
  } else {
    const torch::Tensor h = autograd::GluFunction::apply(z, probs, activation);
    y = fc2(h, splits, is_first_microbatch);
  }
  if (options.bias() && options.scale_bias()) {
    // fc2 added b2_e; adding b2_e·(p - 1) leaves b2_e·p, with the gradients of b2 and p that
    // TE's scale_bias has (Σ dy·p and Σ dy·b2_e).
    // Row r belongs to the first expert whose cumulative size exceeds r (no host copy of device
    // sizes; padded rows past the sum map to the last expert, and fc2 left them unwritten).
    const auto on_device = torch::TensorOptions().device(x.device());
    const torch::Tensor sizes = splits.on_device()
                                    ? splits.device().to(torch::kLong)
                                    : torch::tensor(splits.host(), on_device.dtype(torch::kLong));
    const torch::Tensor expert_of_row =
        torch::searchsorted(torch::cumsum(sizes, 0), torch::arange(x.size(0), on_device),
                            /*out_int32=*/false, /*right=*/true)
            .clamp_max(options.num_experts() - 1);
    // In fp32 (or wider): the gather's backward sums each expert's rows, which must not round
    // per row in bf16.
    const auto wide = torch::promote_types(y.scalar_type(), torch::kFloat32);
    const torch::Tensor b2 =
        torch::stack(fc2->expert_biases()).to(wide).index_select(0, expert_of_row);
    y = (y.to(wide) + b2 * (probs.to(wide) - 1).unsqueeze(1)).to(y.scalar_type());
  }
  return y;
}

void GroupedMLPImpl::backward_dw() {
  fc1->backward_dw();
  fc2->backward_dw();
}

}  // namespace torchmoe
