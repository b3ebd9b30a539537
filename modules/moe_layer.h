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

/// Options for `MoELayer`: the router's and the experts' options, composed.
///
/// Example:
/// ```
/// torchmoe::MoELayerOptions options(/*hidden=*/1024, /*ffn_hidden=*/1024, /*num_experts=*/32,
///                                   /*topk=*/2);
/// options.router().aux_loss_coeff(1e-2);
/// options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
/// torchmoe::MoELayer moe(options);
/// torchmoe::MoEOutput out = moe(x);  // x [B, S, 1024]
/// loss = task_loss(out.output) + out.aux_loss;
/// ```
struct MoELayerOptions {
  /// The router (hidden -> num_experts, top-k) and the experts (num_experts GroupedMLPs of
  /// hidden -> ffn_hidden -> hidden, without biases unless experts().linear().bias(true)).
  MoELayerOptions(int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t topk);

  /// Shorthands that set both the router's and the experts' dtype or device.
  MoELayerOptions& params_dtype(torch::Dtype dtype);
  MoELayerOptions& device(torch::Device device);

  int64_t hidden() const { return router_.hidden(); }
  int64_t num_experts() const { return router_.num_experts(); }

  TORCH_ARG(TopKRouterOptions, router);
  TORCH_ARG(GroupedMLPOptions, experts);
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
