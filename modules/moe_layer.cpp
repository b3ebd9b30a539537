#include "torchmoe/modules/moe_layer.h"

#include <utility>

#include "torchmoe/autograd/token_permutation_function.h"

namespace torchmoe {
namespace {

constexpr const char* kModule = "MoELayer";

}  // namespace

MoELayerOptions::MoELayerOptions(int64_t hidden, int64_t ffn_hidden, int64_t num_experts,
                                 int64_t topk)
    : router_(hidden, num_experts, topk), experts_(num_experts, hidden, ffn_hidden) {
  // MoE experts carry no bias (Mixtral, DeepSeek-V3, Qwen3-MoE), unlike a GroupedLinear.
  experts_.linear().bias(false);
}

MoELayerOptions& MoELayerOptions::params_dtype(torch::Dtype dtype) {
  router_.params_dtype(dtype);
  experts_.params_dtype(dtype);
  return *this;
}

MoELayerOptions& MoELayerOptions::device(torch::Device device) {
  router_.device(device);
  experts_.device(device);
  return *this;
}

MoELayerImpl::MoELayerImpl(MoELayerOptions options_) : options(std::move(options_)) { reset(); }

void MoELayerImpl::reset() {
  const TopKRouterOptions& r = options.router();
  const GroupedMLPOptions& e = options.experts();
  TORCH_CHECK(r.hidden() == e.hidden() && r.num_experts() == e.num_experts(), kModule,
              ": the router and the experts must agree on hidden and num_experts, got router (",
              r.hidden(), ", ", r.num_experts(), ") and experts (", e.hidden(), ", ",
              e.num_experts(), ")");
  router = register_module("router", TopKRouter(r));
  experts = register_module("experts", GroupedMLP(e));
}

void MoELayerImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmoe::MoELayer(hidden=" << options.hidden()
         << ", ffn_hidden=" << options.experts().ffn_hidden()
         << ", num_experts=" << options.num_experts() << ", topk=" << options.router().topk()
         << ")";
}

MoEOutput MoELayerImpl::forward(const torch::Tensor& x, std::optional<bool> is_first_microbatch) {
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options.hidden(), kModule,
              ": x must be [..., hidden=", options.hidden(), "], got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  const torch::Tensor weight = experts->fc1->expert_weights().front();
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), kModule, ": x must have the experts' dtype ",
              weight.scalar_type(), ", got ", x.scalar_type());
  const torch::Tensor tokens = x.reshape({-1, options.hidden()});
  const RouterOutput routing = router(tokens);
  // Without a capacity the router's top-k has no dropped slot, so the permuted row count is T·k
  // and the split sizes can stay on the device: no host sync in the layer when the experts'
  // GEMMs take device splits (sm90), which makes the step CUDA-graph capturable. With a capacity
  // the dropped count decides the row count, and the routing map copies the sizes to the host.
  const ops::IndexTrust trust =
      options.router().capacity_factor() ? ops::IndexTrust::kChecked : ops::IndexTrust::kDropless;
  const PermutedTokens routed = autograd::permute_tokens(
      tokens, routing.indices, options.num_experts(), routing.probs, trust);
  const torch::Tensor y =
      experts(routed.tokens, routed.m_splits, routed.probs, is_first_microbatch);
  MoEOutput out;
  out.output = autograd::unpermute_tokens(y, routed, std::nullopt).view(x.sizes());
  out.aux_loss = routing.aux_loss + routing.z_loss;
  out.tokens_per_expert = routing.tokens_per_expert;
  return out;
}

void MoELayerImpl::backward_dw() { experts->backward_dw(); }

}  // namespace torchmoe
