#pragma once
// MoELayer: a dropless (or capacity-limited) Mixture-of-Experts FFN.
//
//   x [.., hidden] -> TopKRouter -> permute_tokens (rows grouped by expert)
//     -> GroupedMLP (fc1 -> ScaledSwiGLU with each row's routing probability -> fc2)
//     -> unpermute_tokens (a plain sum over each token's k expert outputs) -> [.., hidden]
//
// The probabilities are applied inside the scaled activation (Megatron's memory-efficient
// permutation), so unpermute needs no weights and no copy of the expert outputs is kept for the
// probabilities' gradient.

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <optional>
#include <ostream>

#include "torchmoe/modules/grouped_mlp.h"
#include "torchmoe/modules/router.h"

namespace torchmoe {

/// Options for `MoELayer`: the router's and the experts' options side by side.
///
/// Example:
/// ```
/// torchmoe::MoELayer moe(torchmoe::MoELayerOptions(/*hidden=*/1024, /*ffn_hidden=*/1024,
///                                                  /*num_experts=*/32, /*topk=*/2)
///                            .aux_loss_coeff(1e-2)
///                            .params_dtype(torch::kBFloat16)
///                            .device(torch::kCUDA));
/// torchmoe::MoEOutput out = moe(x);  // x [B, S, 1024]
/// loss = task_loss(out.output) + out.aux_loss;
/// ```
struct MoELayerOptions {
  MoELayerOptions(int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t topk);

  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(int64_t, ffn_hidden);
  TORCH_ARG(int64_t, num_experts);
  TORCH_ARG(int64_t, topk);
  // Router (see TopKRouterOptions).
  TORCH_ARG(RouterScore, score_function) = RouterScore::kSoftmax;
  TORCH_ARG(bool, normalize_topk) = true;
  TORCH_ARG(double, aux_loss_coeff) = 1e-2;
  TORCH_ARG(double, z_loss_coeff) = 0.0;
  TORCH_ARG(bool, expert_bias) = false;
  TORCH_ARG(double, expert_bias_update_rate) = 1e-3;
  TORCH_ARG(std::optional<double>, capacity_factor) = std::nullopt;
  // Experts (see GroupedMLPOptions).
  TORCH_ARG(bool, bias) = false;
  TORCH_ARG(GroupedMLPActivation, activation) = GroupedMLPActivation::kSwiGLU;
  TORCH_ARG(ClampedSwiGLUOptions, clamped) = {};
  TORCH_ARG(std::optional<int64_t>, glu_interleave_size) = std::nullopt;
  TORCH_ARG(bool, fuse_wgrad_accumulation) = false;
  TORCH_ARG(bool, delay_wgrad_compute) = false;
  TORCH_ARG(bool, recompute_activation) = false;
  TORCH_ARG(bool, single_grouped_weight) = false;
  TORCH_ARG(bool, single_grouped_bias) = false;
  TORCH_ARG(ops::GemmBackendChoice, gemm_backend) = ops::GemmBackendChoice::kAuto;
  // Both.
  TORCH_ARG(torch::Dtype, params_dtype) = torch::kFloat32;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

struct MoEOutput {
  torch::Tensor output;             // x's shape and dtype
  torch::Tensor aux_loss;           // router load-balancing loss + z-loss, scalar float32
  torch::Tensor tokens_per_expert;  // [E] int64, before capacity dropping
};

class MoELayerImpl : public torch::nn::Cloneable<MoELayerImpl> {
 public:
  MoELayerImpl(int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t topk)
      : MoELayerImpl(MoELayerOptions(hidden, ffn_hidden, num_experts, topk)) {}
  explicit MoELayerImpl(MoELayerOptions options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// x [..., hidden] in params_dtype. is_first_microbatch as in GroupedLinear (main-grad
  /// overwrite).
  MoEOutput forward(const torch::Tensor& x, std::optional<bool> is_first_microbatch = std::nullopt);

  /// Runs the oldest delayed weight-gradient computation of the experts.
  void backward_dw();

  MoELayerOptions options;
  TopKRouter router{nullptr};
  GroupedMLP experts{nullptr};
};

TORCH_MODULE(MoELayer);

}  // namespace torchmoe
