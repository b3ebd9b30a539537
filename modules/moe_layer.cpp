#include "torchmoe/modules/moe_layer.h"

#include <utility>

#include "torchmoe/modules/token_permutation.h"

namespace torchmoe {

MoELayerOptions::MoELayerOptions(int64_t hidden, int64_t ffn_hidden, int64_t num_experts,
                                 int64_t topk)
    : hidden_(hidden), ffn_hidden_(ffn_hidden), num_experts_(num_experts), topk_(topk) {}

MoELayerImpl::MoELayerImpl(MoELayerOptions options_) : options(std::move(options_)) { reset(); }

void MoELayerImpl::reset() {
  const MoELayerOptions& o = options;
  router =
      register_module("router", TopKRouter(TopKRouterOptions(o.hidden(), o.num_experts(), o.topk())
                                               .score_function(o.score_function())
                                               .normalize_topk(o.normalize_topk())
                                               .aux_loss_coeff(o.aux_loss_coeff())
                                               .z_loss_coeff(o.z_loss_coeff())
                                               .expert_bias(o.expert_bias())
                                               .expert_bias_update_rate(o.expert_bias_update_rate())
                                               .capacity_factor(o.capacity_factor())
                                               .params_dtype(o.params_dtype())
                                               .device(o.device())));
  experts = register_module(
      "experts", GroupedMLP(GroupedMLPOptions(o.num_experts(), o.hidden(), o.ffn_hidden())
                                .bias(o.bias())
                                .activation(o.activation())
                                .clamped(o.clamped())
                                .glu_interleave_size(o.glu_interleave_size())
                                .params_dtype(o.params_dtype())
                                .device(o.device())
                                .fuse_wgrad_accumulation(o.fuse_wgrad_accumulation())
                                .delay_wgrad_compute(o.delay_wgrad_compute())
                                .recompute_activation(o.recompute_activation())
                                .single_grouped_weight(o.single_grouped_weight())
                                .single_grouped_bias(o.single_grouped_bias())
                                .gemm_backend(o.gemm_backend())));
}

void MoELayerImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmoe::MoELayer(hidden=" << options.hidden()
         << ", ffn_hidden=" << options.ffn_hidden() << ", num_experts=" << options.num_experts()
         << ", topk=" << options.topk() << ")";
}

MoEOutput MoELayerImpl::forward(const torch::Tensor& x, std::optional<bool> is_first_microbatch) {
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options.hidden(),
              "MoELayer: x must be [..., hidden=", options.hidden(), "], got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(x.scalar_type() == options.params_dtype(),
              "MoELayer: x dtype must match params_dtype=", options.params_dtype(), ", got ",
              x.scalar_type());
  const torch::Tensor tokens = x.reshape({-1, options.hidden()});
  const RouterOutput routing = router(tokens);
  const PermutedTokens routed =
      functional::permute_tokens(tokens, routing.indices, options.num_experts(), routing.probs);
  const torch::Tensor y =
      experts(routed.tokens, routed.m_splits, routed.probs, is_first_microbatch);
  MoEOutput out;
  out.output = functional::unpermute_tokens(y, routed.row_map).view(x.sizes());
  out.aux_loss = routing.aux_loss + routing.z_loss;
  out.tokens_per_expert = routing.tokens_per_expert;
  return out;
}

void MoELayerImpl::backward_dw() { experts->backward_dw(); }

}  // namespace torchmoe
