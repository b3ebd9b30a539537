#pragma once
// TopKRouter: the gate of an MoE layer. A linear map [hidden -> E] gives logits; a score function
// (softmax or sigmoid) turns them into expert scores; each token picks its top-k experts. Also
// produces the load-balancing auxiliary loss (Switch/GShard), the router z-loss (ST-MoE), the
// per-expert token counts, and optionally drops tokens over an expert's capacity. Logits and
// scores are computed in fp32 whatever the parameters' dtype (as Megatron-LM recommends).
//
//   logits   = x · Wᵀ (+ b with options.bias)                             [T, E]
//   scores   = softmax(logits) or sigmoid(logits)                        [T, E]
//   indices  = topk(scores + expert_bias, k)       (the bias only steers the choice; with
//              num_groups, among the experts of the topk_groups best groups)
//   probs    = scores[indices], / Σ_k when normalize_topk, · routed_scaling_factor
//   aux_loss = coeff · E / (k·T²) · Σ_e (Σ_t s[t,e]) · count_e    s = scores (sigmoid: / Σ_e)
//   z_loss   = coeff · mean_t logsumexp(logits_t)²

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/input-archive.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <ostream>

#include "torchmoe/distributed/process_group.h"

namespace torchmoe {

enum class RouterScore { kSoftmax, kSigmoid };

/// Options for `TopKRouter`.
///
/// Example:
/// ```
/// torchmoe::TopKRouter router(torchmoe::TopKRouterOptions(/*hidden=*/1024, /*num_experts=*/32,
///                                                         /*topk=*/2)
///                                 .aux_loss_coeff(1e-2)
///                                 .z_loss_coeff(1e-3));
/// torchmoe::RouterOutput r = router(x);  // x [T, 1024]: r.indices [T, 2], r.probs [T, 2]
/// ```
struct TopKRouterOptions {
  TopKRouterOptions(int64_t hidden, int64_t num_experts, int64_t topk);

  TORCH_ARG(int64_t, hidden);
  TORCH_ARG(int64_t, num_experts);
  /// Experts per token, 1 <= topk <= num_experts.
  TORCH_ARG(int64_t, topk);
  TORCH_ARG(RouterScore, score_function) = RouterScore::kSoftmax;
  /// Renormalise the k chosen probabilities to sum to 1 (Mixtral, Qwen3, DeepSeek-V3; Megatron's
  /// default for softmax). Unset: on for topk > 1 and off for topk == 1, where it would make
  /// every probability 1 and leave the gate without a gradient from the main loss (Switch
  /// Transformer keeps the score). Set, it is applied at every k: true at topk 1 gives every token
  /// the weight 1, as Hugging Face's Mixtral and Qwen3-MoE do with norm_topk_prob.
  TORCH_ARG(std::optional<bool>, normalize_topk) = std::nullopt;
  /// Group-limited routing (DeepSeek-V3's n_group and topk_group): the experts form num_groups
  /// groups of num_experts / num_groups consecutive experts (at least 2 each); each token ranks
  /// the groups by the sum of the two highest scores + expert bias in each, keeps the
  /// topk_groups best, and chooses its topk experts among theirs. 1: no groups.
  TORCH_ARG(int64_t, num_groups) = 1;
  TORCH_ARG(int64_t, topk_groups) = 1;
  /// The chosen probabilities multiplied by this after any renormalisation (DeepSeek-V3's
  /// routed_scaling_factor).
  TORCH_ARG(double, routed_scaling_factor) = 1.0;
  /// A learned bias [num_experts] added to the logits (GPT-OSS's router), parameter `bias`.
  TORCH_ARG(bool, bias) = false;
  /// Weight of the load-balancing loss (0 disables it; the returned aux_loss is then 0).
  TORCH_ARG(double, aux_loss_coeff) = 0.0;
  /// Weight of the router z-loss (0 disables it).
  TORCH_ARG(double, z_loss_coeff) = 0.0;
  /// Aux-loss-free balancing (DeepSeek-V3): a per-expert fp32 bias added to the scores for the
  /// choice only, updated by update_expert_bias() from the load seen since the last update.
  TORCH_ARG(bool, expert_bias) = false;
  TORCH_ARG(double, expert_bias_update_rate) = 1e-3;
  /// Each expert keeps at most ceil(T·k/E · capacity_factor) tokens, those with the highest
  /// probabilities; the others' slots get index -1 and probability 0. nullopt: no dropping.
  TORCH_ARG(std::optional<double>, capacity_factor) = std::nullopt;
  /// The tokens of all ranks of this group count as one batch (Megatron's global aux loss): the
  /// per-expert counts and the token count are summed over the group (one all-reduce per forward,
  /// no host sync), tokens_per_expert and the expert-bias load are the group's, and each rank's
  /// aux and z losses are its share, so that their sum over the ranks is the loss of the whole
  /// batch. Every rank of the group must call forward. MoELayer sets its expert-parallel group
  /// here unless one is given. nullopt: this rank's tokens only.
  TORCH_ARG(std::optional<ProcessGroupOptions>, process_group) = std::nullopt;
  TORCH_ARG(torch::Dtype, params_dtype) = torch::kFloat32;
  TORCH_ARG(torch::Device, device) = torch::kCPU;
};

/// The most tokens an expert keeps out of `tokens` under options.capacity_factor():
/// ceil(tokens·topk / num_experts · capacity_factor). Requires a capacity_factor.
int64_t expert_capacity(int64_t tokens, const TopKRouterOptions& options);

/// What the router returns for T tokens.
struct RouterOutput {
  torch::Tensor indices;  // [T, k] int64, -1 where dropped by capacity
  // probs and the losses are float32 (float64 for float64 input).
  torch::Tensor probs;     // [T, k], 0 where dropped
  torch::Tensor aux_loss;  // scalar, coefficient applied
  torch::Tensor z_loss;    // scalar, coefficient applied
  // [E] int64: tokens choosing each expert, before dropping (summed over process_group's ranks)
  torch::Tensor tokens_per_expert;
};

class TopKRouterImpl : public torch::nn::Cloneable<TopKRouterImpl> {
 public:
  TopKRouterImpl(int64_t hidden, int64_t num_experts, int64_t topk)
      : TopKRouterImpl(TopKRouterOptions(hidden, num_experts, topk)) {}
  explicit TopKRouterImpl(TopKRouterOptions options);

  void reset() override;
  /// kaiming_uniform_(a = sqrt(5)) as torch::nn::Linear; zeroes the expert bias and load.
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  /// x [..., hidden] (T = x.numel() / hidden tokens).
  RouterOutput forward(const torch::Tensor& x);

  /// expert_bias += rate · sign(mean load - load) from the tokens counted (in training mode)
  /// since the last call, then clears the count. No-op without expert_bias.
  void update_expert_bias();

  /// torch::load: `weight` (and with expert_bias its two buffers) must have this router's
  /// shapes; each is checked before any is copied, and copied into the router's tensors, which
  /// keep their dtype and device (Module::load would take any shape and dtype).
  void load(torch::serialize::InputArchive& archive) override;

  /// As torch::nn::Module's, except that the expert bias and load stay float32 (a bf16 load count
  /// would stop counting at 256; a bf16 bias would not move by small update rates).
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;

  TopKRouterOptions options;
  torch::Tensor weight;       // [E, hidden]
  torch::Tensor bias;         // [E] (defined with options.bias)
  torch::Tensor expert_bias;  // buffer [E] fp32 (defined with options.expert_bias)
  torch::Tensor expert_load;  // buffer [E] fp32: tokens per expert since the last update
};

TORCH_MODULE(TopKRouter);

}  // namespace torchmoe
