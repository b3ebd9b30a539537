#include "torchmoe/modules/grouped_mlp.h"

#include <utility>

#include "torchmoe/autograd/glu_function.h"
#include "torchmoe/autograd/grouped_linear_function.h"
#include "torchmoe/autograd/token_permutation_function.h"
#include "torchmoe/fp8/autocast.h"
#include "torchmoe/fp8/quantize_options.h"
#include "torchmoe/modules/glu_options.h"
#include "torchmoe/modules/grouped_linear_calls.h"
#include "torchmoe/modules/grouped_mlp_calls.h"
#include "torchmoe/modules/module_load.h"

namespace torchmoe {
namespace {

constexpr const char* kModule = "GroupedMLP";

GroupedLinearOptions layer_options(const GroupedMLPOptions& o, int64_t in, int64_t out) {
  return GroupedLinearOptions(o.linear())
      .num_gemms(o.num_experts())
      .in_features(in)
      .out_features(out);
}

ops::GluOptions activation_of(const GroupedMLPOptions& o) {
  if (o.activation() == GluActivation::kSwiGLU) {
    return glu_options(SwiGLUOptions().glu_interleave_size(o.glu_interleave_size()));
  }
  ClampedSwiGLUOptions clamped = o.clamped();
  return glu_options(clamped.glu_interleave_size(o.glu_interleave_size()));
}

}  // namespace

GroupedMLPOptions::GroupedMLPOptions(int64_t num_experts, int64_t hidden, int64_t ffn_hidden)
    : num_experts_(num_experts),
      hidden_(hidden),
      ffn_hidden_(ffn_hidden),
      linear_(num_experts, hidden, 2 * ffn_hidden) {}

GroupedMLPOptions& GroupedMLPOptions::params_dtype(torch::Dtype dtype) {
  linear_.params_dtype(dtype);
  return *this;
}

GroupedMLPOptions& GroupedMLPOptions::device(torch::Device device) {
  linear_.device(device);
  return *this;
}

GroupedMLPImpl::GroupedMLPImpl(GroupedMLPOptions options_) : options(std::move(options_)) {
  reset();
}

void GroupedMLPImpl::reset() {
  TORCH_CHECK(options.ffn_hidden() > 0, kModule, ": ffn_hidden must be positive, got ",
              options.ffn_hidden());
  ops::check_glu_options(kModule, activation_of(options), options.ffn_hidden());
  // Both layers share the options, which cannot split fc1's outputs and fc2's inputs alike.
  TORCH_CHECK_NOT_IMPLEMENTED(
      options.linear().parallel_mode() == ParallelMode::kNone && options.linear().tp_size() == 1,
      kModule, ": tensor parallelism is not implemented, got linear().parallel_mode ",
      options.linear().parallel_mode() == ParallelMode::kRow      ? "kRow"
      : options.linear().parallel_mode() == ParallelMode::kColumn ? "kColumn"
                                                                  : "kNone",
      " and tp_size ", options.linear().tp_size());
  fc1 = register_module(
      "fc1", GroupedLinear(layer_options(options, options.hidden(), 2 * options.ffn_hidden())));
  fc2 = register_module(
      "fc2", GroupedLinear(layer_options(options, options.ffn_hidden(), options.hidden())));
}

void GroupedMLPImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "torchmoe::GroupedMLP(num_experts=" << options.num_experts()
         << ", hidden=" << options.hidden() << ", ffn_hidden=" << options.ffn_hidden()
         << ", bias=" << fc2->options.bias() << ", activation="
         << (options.activation() == GluActivation::kSwiGLU ? "swiglu" : "clamped_swiglu") << ")";
}

torch::Tensor GroupedMLPImpl::checked_input(const torch::Tensor& x) const {
  TORCH_CHECK(x.defined() && x.dim() == 2 && x.size(1) == options.hidden(), kModule,
              ": x must be [rows, hidden=", options.hidden(), "], got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  const torch::Tensor& weight = fc1->weight_params_.front();
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), kModule,
              ": x must have the parameters' dtype ", weight.scalar_type(), ", got ",
              x.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), kModule, ": x must be on the parameters' device ",
              weight.device(), ", got ", x.device());
  return x.contiguous();
}

torch::Tensor GroupedMLPImpl::forward(const torch::Tensor& x, const SplitSizes& m_splits,
                                      const torch::Tensor& probs,
                                      std::optional<bool> is_first_microbatch) {
  const torch::Tensor rows = checked_input(x);
  const std::vector<ops::GemmPlan> plans =
      detail::GroupedMLPCalls::plan(*this, rows, m_splits, torch::Tensor());
  return detail::GroupedMLPCalls::run_layers(*this, rows, nullptr, plans, probs,
                                             is_first_microbatch);
}

torch::Tensor GroupedMLPImpl::forward_routed(const torch::Tensor& tokens,
                                             const PermutedTokens& routed,
                                             std::optional<bool> is_first_microbatch) {
  return detail::GroupedMLPCalls::forward_routed(*this, tokens, routed, is_first_microbatch,
                                                 nullptr);
}

namespace detail {

torch::Tensor GroupedMLPCalls::forward_routed(
    GroupedMLPImpl& mlp, const torch::Tensor& tokens, const PermutedTokens& routed,
    std::optional<bool> is_first_microbatch,
    std::shared_ptr<autograd::Fp8GradLink> output_grad_link) {
  const torch::Tensor x = mlp.checked_input(tokens);
  const auto [source_rows, plans] = plan_routed(mlp, x, routed);
  // fc1 reads the tokens through the map where its plan does so without a copy (the sm90 kernel's
  // loads; in FP8 the input's quantize), else from one permuted copy.
  if (plans[0].gathers_rows) {
    const autograd::RowGather gather{source_rows, routed.row_map, torch::Tensor()};
    return run_layers(mlp, x, &gather, plans, routed.probs, is_first_microbatch,
                      std::move(output_grad_link));
  }
  const torch::Tensor rows = routed.tokens.defined() ? routed.tokens.contiguous()
                                                     : autograd::PermuteFunction::apply(
                                                           x, routed.row_map, routed.sorted_slots);
  return run_layers(mlp, rows, nullptr, plans, routed.probs, is_first_microbatch,
                    std::move(output_grad_link));
}

}  // namespace detail

torch::Tensor GroupedMLPImpl::forward_combined(const torch::Tensor& tokens,
                                               const PermutedTokens& routed,
                                               std::optional<bool> is_first_microbatch) {
  const torch::Tensor x = checked_input(tokens);
  const auto [source_rows, plans] = detail::GroupedMLPCalls::plan_routed(*this, x, routed);
  const int64_t topk = routed.row_map.size(1);
  // The sums inside the GEMMs where the plans add rows there (the sm90 kernel's L2 adds), at most
  // two rows per token (their sum then does not depend on the order they land in), and fc2's
  // output left as it is (scale_bias changes it after fc2).
  const bool combine = topk <= 2 && plans[1].forward_scatters && plans[0].dgrad_scatters &&
                       !(fc2->options.bias() && options.scale_bias());
  if (!combine) {
    const torch::Tensor rows =
        autograd::PermuteFunction::apply(x, routed.row_map, routed.sorted_slots);
    return autograd::unpermute_tokens(
        detail::GroupedMLPCalls::run_layers(*this, rows, nullptr, plans, routed.probs,
                                            is_first_microbatch),
        routed, std::nullopt);
  }
  // fc1 reads a copy in expert order (a TMA load per 128-row tile, faster than reading the tokens
  // through the map: docs/experiments.md) and adds its input gradient's rows per token into the
  // tokens' gradient.
  const autograd::RowGather gather{
      source_rows, routed.row_map,
      ops::permute_rows(x, routed.row_map, routed.sorted_slots, torch::Tensor())};
  const autograd::OutputScatter scatter{source_rows, routed.row_map, routed.sorted_slots};
  return detail::GroupedMLPCalls::run_layers(*this, x, &gather, plans, routed.probs,
                                             is_first_microbatch, nullptr, &scatter);
}

namespace detail {

std::vector<ops::GemmPlan> GroupedMLPCalls::plan(const GroupedMLPImpl& mlp, const torch::Tensor& x,
                                                 const SplitSizes& m_splits,
                                                 const at::Tensor& gather_rows) {
  return ops::plan_grouped_gemms(
      kModule, x,
      {GroupedLinearCalls::gemm_shape(*mlp.fc1), GroupedLinearCalls::gemm_shape(*mlp.fc2)},
      m_splits, mlp.options.linear().gemm_backend(), gather_rows, fp8::current_gemm_options());
}

GroupedMLPCalls::RoutedPlans GroupedMLPCalls::plan_routed(const GroupedMLPImpl& mlp,
                                                          const torch::Tensor& x,
                                                          const PermutedTokens& routed) {
  TORCH_CHECK(routed.row_map.defined() && routed.row_map.dim() == 2 &&
                  routed.row_map.size(0) == x.size(0) && routed.sorted_slots.defined() &&
                  routed.sorted_slots.dim() == 1,
              kModule, ": routed must be the routing of the ", x.size(0),
              " tokens (row_map [T, k] and sorted_slots [N]), got row_map ",
              routed.row_map.defined() ? routed.row_map.sizes() : torch::IntArrayRef{});
  RoutedPlans out;
  // The routing map's tokens of the rows, or the same computed for a PermutedTokens made without.
  const torch::Tensor& row_tokens = routed.row_tokens;
  TORCH_CHECK(!row_tokens.defined() ||
                  (row_tokens.dim() == 1 && row_tokens.size(0) == routed.sorted_slots.size(0) &&
                   row_tokens.scalar_type() == torch::kLong && row_tokens.device() == x.device()),
              kModule, ": routed.row_tokens must be an int64 [", routed.sorted_slots.size(0),
              "] tensor on ", x.device(), " like sorted_slots, got ",
              row_tokens.defined() ? row_tokens.sizes() : torch::IntArrayRef{}, " ",
              row_tokens.defined() ? row_tokens.scalar_type() : torch::ScalarType::Undefined,
              " on ", row_tokens.defined() ? row_tokens.device() : x.device());
  out.source_rows = row_tokens.defined()
                        ? row_tokens
                        : ops::tokens_of_rows(routed.sorted_slots, routed.row_map.size(1));
  out.plans = plan(mlp, x, routed.m_splits, out.source_rows);
  return out;
}

torch::Tensor GroupedMLPCalls::run_layers(GroupedMLPImpl& mlp, const torch::Tensor& input,
                                          const autograd::RowGather* gather,
                                          const std::vector<ops::GemmPlan>& plans,
                                          const torch::Tensor& probs,
                                          std::optional<bool> is_first_microbatch,
                                          std::shared_ptr<autograd::Fp8GradLink> output_grad_link,
                                          const autograd::OutputScatter* scatter) {
  const GroupedMLPOptions& options = mlp.options;
  GroupedLinear& fc1 = mlp.fc1;
  GroupedLinear& fc2 = mlp.fc2;
  TORCH_INTERNAL_ASSERT(
      scatter == nullptr || !(fc2->options.bias() && options.scale_bias()),
      "GroupedMLP: scale_bias would change fc2's rows after a scatter summed them");
  const int64_t rows = plans[0].rows;
  TORCH_CHECK(probs.defined() && probs.dim() == 1 && probs.size(0) == rows, kModule,
              ": probs must be [rows] with one probability per row of x (", rows, "), got ",
              probs.defined() ? probs.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(probs.device() == input.device(), kModule, ": probs must be on ", input.device(),
              " like x, got ", probs.device());
  // FP8: fc2 always takes the pre-activation and computes the activation inside the quantize of
  // its input, so the 16-bit activation is never written nor read back. Backward recomputes
  // nothing: fc2's wgrad reads the FP8 copy, and the activation's backward the pre-activation,
  // which it reads either way; that backward quantizes its result for fc1 in the same pass (the
  // link), so the 16-bit gradient of fc1's output is not written either.
  const bool fp8 = plans[1].fp8.has_value();
  const auto link = fp8 ? std::make_shared<autograd::Fp8GradLink>() : nullptr;
  // Before fc1 runs (in FP8 it records amaxes and fills the weight cache): the options are public.
  const ops::GluOptions activation = activation_of(options);
  ops::check_glu_options(kModule, activation, options.ffn_hidden());
  const torch::Tensor z = GroupedLinearCalls::run(*fc1, input, plans[0], is_first_microbatch,
                                                  torch::Tensor(), nullptr, gather, link);
  torch::Tensor y;
  if (options.recompute_activation() || fp8) {
    // fc2's output gradient from the link only when fc2's output is this module's: scale_bias
    // below differentiates through it.
    if (!fp8 || fc2->options.bias()) output_grad_link = nullptr;
    y = GroupedLinearCalls::run(*fc2, z, plans[1], is_first_microbatch, probs, &activation, nullptr,
                                std::move(output_grad_link), link, scatter);
  } else {
    const torch::Tensor h = autograd::GluFunction::apply(z, probs, activation);
    y = GroupedLinearCalls::run(*fc2, h, plans[1], is_first_microbatch, torch::Tensor(), nullptr,
                                nullptr, nullptr, nullptr, scatter);
  }
  // fc2 as built decides whether it added a bias (options.linear() is only what it was built
  // from).
  if (fc2->options.bias() && options.scale_bias()) {
    // fc2 added b2_e; adding b2_e·(p - 1) leaves b2_e·p, with the gradients of b2 and p that
    // TE's scale_bias has (Σ dy·p and Σ dy·b2_e).
    // Row r belongs to the first expert whose cumulative size exceeds r (no host copy of device
    // sizes; padded rows past the sum map to the last expert, and fc2 left them unwritten).
    const SplitSizes& splits = plans[1].m_splits;
    const auto on_device = torch::TensorOptions().device(input.device());
    const torch::Tensor sizes = splits.has_device()
                                    ? splits.device().to(torch::kLong)
                                    : torch::tensor(splits.host(), on_device.dtype(torch::kLong));
    const torch::Tensor expert_of_row =
        torch::searchsorted(torch::cumsum(sizes, 0), torch::arange(rows, on_device),
                            /*out_int32=*/false, /*right=*/true)
            .clamp_max(options.num_experts() - 1);
    // In fp32 (or wider): the gather's backward sums each expert's rows, which must not round
    // per row in bf16. On CUDA that backward adds the rows with float atomics, so b2's gradient
    // can differ in its last bits from run to run (docs/glu_and_mlp.md).
    const auto wide = torch::promote_types(y.scalar_type(), torch::kFloat32);
    const torch::Tensor b2 =
        torch::stack(fc2->expert_biases()).to(wide).index_select(0, expert_of_row);
    y = (y.to(wide) + b2 * (probs.to(wide) - 1).unsqueeze(1)).to(y.scalar_type());
  }
  return y;
}

}  // namespace detail

void GroupedMLPImpl::check_no_queued_wgrad(const char* where) const {
  fc1->check_no_queued_wgrad(where);
  fc2->check_no_queued_wgrad(where);
}

// Both layers' checks before either moves.
void GroupedMLPImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  check_no_queued_wgrad("GroupedMLP::to");
  torch::nn::Module::to(device, dtype, non_blocking);
}

void GroupedMLPImpl::to(torch::Device device, bool non_blocking) {
  check_no_queued_wgrad("GroupedMLP::to");
  torch::nn::Module::to(device, non_blocking);
}

void GroupedMLPImpl::to(torch::Dtype dtype, bool non_blocking) {
  check_no_queued_wgrad("GroupedMLP::to");
  torch::nn::Module::to(dtype, non_blocking);
}

void GroupedMLPImpl::load(torch::serialize::InputArchive& archive) {
  detail::load_all_or_nothing(*this, [&] { torch::nn::Module::load(archive); });
}

void GroupedMLPImpl::backward_dw() {
  // A layer whose weights need no gradient queues nothing: each layer with work runs it, and a
  // call finding no work anywhere is refused before either layer changes.
  const bool fc1_queued = fc1->pending_wgrad_count() > 0;
  const bool fc2_queued = fc2->pending_wgrad_count() > 0;
  TORCH_CHECK(fc1->options.delay_wgrad_compute(), kModule,
              "::backward_dw: delay_wgrad_compute is off, so backward already computed the weight "
              "gradients");
  TORCH_CHECK(fc1_queued || fc2_queued, kModule,
              "::backward_dw: no weight-gradient computation is queued (run backward first)");
  if (fc1_queued) fc1->backward_dw();
  if (fc2_queued) fc2->backward_dw();
}

}  // namespace torchmoe
