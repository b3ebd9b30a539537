#pragma once
// GroupedMLP: the expert MLP of an MoE layer, fc1 (GroupedLinear, hidden -> 2·ffn) -> scaled gated
// activation with the routing probabilities -> fc2 (GroupedLinear, ffn -> hidden). Per expert e:
//   y_e = (act(x_e·W1_eᵀ + b1_e) · p_e) · W2_eᵀ + b2_e          (b2_e · p_e with scale_bias)
// as TransformerEngine's Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear) on Hopper.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <optional>
#include <ostream>
#include <vector>

#include "torchmoe/modules/glu.h"
#include "torchmoe/modules/grouped_linear.h"

namespace torchmoe {
namespace detail {
struct GroupedMLPCalls;  // modules/grouped_mlp_calls.h (internal)
}  // namespace detail

/// Options for `GroupedMLP`: its sizes, the activation, and the settings its two GroupedLinear
/// layers share (`linear`).
///
/// Example:
/// ```
/// torchmoe::GroupedMLP experts(torchmoe::GroupedMLPOptions(/*num_experts=*/8, 1024, 2048)
///                                  .glu_interleave_size(32)
///                                  .params_dtype(torch::kBFloat16)
///                                  .device(torch::kCUDA));
/// torch::Tensor y = experts(x, m_splits, probs);  // x [M, 1024], probs [M]
/// ```
struct GroupedMLPOptions {
  GroupedMLPOptions(int64_t num_experts, int64_t hidden, int64_t ffn_hidden);

  /// Shorthands for linear().params_dtype(...) and linear().device(...), so that the options
  /// chain.
  GroupedMLPOptions& params_dtype(torch::Dtype dtype);
  GroupedMLPOptions& device(torch::Device device);

  TORCH_ARG(int64_t, num_experts);
  /// Model width: fc1's input and fc2's output.
  TORCH_ARG(int64_t, hidden);
  /// Expert width: fc1 produces 2·ffn_hidden (act and gate halves), fc2 consumes ffn_hidden.
  TORCH_ARG(int64_t, ffn_hidden);
  TORCH_ARG(GluActivation, activation) = GluActivation::kSwiGLU;
  /// ClampedSwiGLU parameters (activation == kClampedSwiGLU).
  TORCH_ARG(ClampedSwiGLUOptions, clamped) = {};
  /// fc1's output columns interleave act and gate in blocks of this size (see SwiGLUOptions).
  TORCH_ARG(std::optional<int64_t>, glu_interleave_size) = std::nullopt;
  /// fc2's bias is scaled by the routing probability too (TE's scale_bias): + b2_e · p.
  TORCH_ARG(bool, scale_bias) = false;
  /// Keep fc1's output instead of the activation for backward and recompute the activation
  /// there (saves M·ffn_hidden activations per layer for one extra activation pass).
  TORCH_ARG(bool, recompute_activation) = false;
  /// What fc1 and fc2 share: bias, params_dtype, device, init_method, fuse_wgrad_accumulation,
  /// delay_wgrad_compute, single_grouped_weight/bias and gemm_backend. Its num_gemms and feature
  /// sizes are not used: GroupedMLP sets them from num_experts, hidden and ffn_hidden.
  TORCH_ARG(GroupedLinearOptions, linear);
};

class GroupedMLPImpl : public torch::nn::Cloneable<GroupedMLPImpl> {
 public:
  GroupedMLPImpl(int64_t num_experts, int64_t hidden, int64_t ffn_hidden)
      : GroupedMLPImpl(GroupedMLPOptions(num_experts, hidden, ffn_hidden)) {}
  explicit GroupedMLPImpl(GroupedMLPOptions options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// x [M, hidden] grouped by expert, m_splits rows per expert (summing to M; see SplitSizes),
  /// probs [M] (fp32 or the parameters' dtype; receives a gradient). Returns [M, hidden].
  torch::Tensor forward(const torch::Tensor& x, const SplitSizes& m_splits,
                        const torch::Tensor& probs,
                        std::optional<bool> is_first_microbatch = std::nullopt);

  /// The experts on tokens [T, hidden] in token order, routed by `routed` (from
  /// functional::permute_tokens, or an MoELayer's routing: the routing map, split sizes and the
  /// rows' probabilities). Returns [N, hidden] in the routed (expert-grouped) order, as forward on
  /// the permuted tokens would. On the sm90 backend fc1 reads the tokens through the routing map,
  /// and in FP8 (any backend) the quantize of fc1's input does, so that the permuted copy is
  /// neither written nor kept for backward; otherwise the copy is made (routed.tokens when given).
  torch::Tensor forward_routed(const torch::Tensor& tokens, const PermutedTokens& routed,
                               std::optional<bool> is_first_microbatch = std::nullopt);

  /// The experts from tokens [T, hidden] to their output [T, hidden], routed by `routed` (the
  /// routing of these tokens, from functional::permute_tokens or an MoELayer's routing, also of
  /// the rows an expert-parallel exchange delivered; a permuted copy in it
  /// is not read: the copy is made here, its gradient the tokens'): what
  /// unpermute_tokens(forward(permuted tokens, ...), routed) returns, bit for bit. With top-1 or
  /// top-2 routing and 16-bit products on the sm90 kernel (and no scale_bias on a biased fc2),
  /// each token's expert rows are summed inside fc2's GEMM and each token's input-gradient rows
  /// inside fc1's dgrad, so that neither the expert-ordered output nor the expert-ordered
  /// gradient of fc1's input is written. Otherwise those three steps.
  torch::Tensor forward_combined(const torch::Tensor& tokens, const PermutedTokens& routed,
                                 std::optional<bool> is_first_microbatch = std::nullopt);

  /// Runs the oldest delayed weight-gradient computation of both layers.
  void backward_dw();
  /// GroupedLinear::check_no_queued_wgrad of both layers.
  void check_no_queued_wgrad(const char* where) const;

  /// As torch::nn::Module's, refused before either layer moves while one has queued delayed
  /// weight-gradient work (GroupedLinear refuses it; checked first, the two layers do not end up
  /// on different devices or dtypes).
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// torch::load, all or nothing: fc1's and fc2's entries are each checked before they are
  /// copied, and a refusal of fc2's restores what fc1 loaded.
  void load(torch::serialize::InputArchive& archive) override;

  GroupedMLPOptions options;
  GroupedLinear fc1{nullptr};
  GroupedLinear fc2{nullptr};

 private:
  // The planning and the body of the forwards, and MoELayer's FP8 forward_routed
  // (modules/grouped_mlp_calls.h, internal).
  friend struct detail::GroupedMLPCalls;

  // Checks x [rows, hidden] against the parameters; returns it contiguous.
  torch::Tensor checked_input(const torch::Tensor& x) const;
};

TORCH_MODULE(GroupedMLP);

}  // namespace torchmoe
