#pragma once
// Hugging Face MoE blocks as MoELayers: the options that build each architecture's block from its
// config.json, and the map between the block's tensors (as its checkpoints and its transformers
// module name and lay them out) and the layer's parameters, both ways.
//
// | arch        | HF block               | router                         | experts / shared expert
// |
// |-------------|------------------------|--------------------------------|-------------------------|
// | mixtral     | MixtralSparseMoeBlock  | softmax, top-k renormalised    | SwiGLU | | olmoe |
// OlmoeSparseMoeBlock    | softmax, norm_topk_prob        | SwiGLU                  | | qwen3_moe
// | Qwen3MoeSparseMoeBlock | softmax, norm_topk_prob        | SwiGLU                  | | qwen2_moe
// | Qwen2MoeSparseMoeBlock | softmax, norm_topk_prob        | SwiGLU + gated shared   | |
// deepseek_v3 | DeepseekV3MoE          | sigmoid + bias, groups, scaled | SwiGLU + shared         |
// | gpt_oss     | GptOssMLP              | softmax of top-k biased logits | clamped, interleaved,
// biases | | llama4      | Llama4TextMoe          | sigmoid of the top-1 logit     | input-scaled +
// shared   |
//
// Tensor names, below the block's prefix (e.g. "model.layers.3.mlp."), as transformers 5's modules
// hold them (HfWeightLayout::kModule):
//   router   gate.weight [E, H] (gpt_oss, llama4: router.weight; gpt_oss router.bias [E]);
//            deepseek_v3 gate.e_score_correction_bias [E] (the router's expert_bias)
//   experts  experts.gate_up_proj [E, 2I, H] (gate rows first, then up), experts.down_proj
//            [E, H, I]; gpt_oss and llama4 transposed, [E, H, 2I] and [E, I, H], gpt_oss's gate
//            and up columns alternating one by one, with gate_up_proj_bias [E, 2I] and
//            down_proj_bias [E, H]
//   shared   shared_expert.{gate,up,down}_proj.weight (deepseek_v3: shared_experts.),
//            qwen2_moe's shared_expert_gate.weight [1, H]
// and as the hub's checkpoints store the per-expert ones (HfWeightLayout::kCheckpoint):
// experts.{e}.{gate,up,down}_proj.weight (mixtral: experts.{e}.{w1,w3,w2}.weight); gpt_oss and
// llama4 checkpoints store the fused tensors. Loading takes either layout.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchmoe/modules/moe_layer.h"

namespace torchmoe::checkpoint {

enum class HfMoeArch { kMixtral, kOlmoe, kQwen2Moe, kQwen3Moe, kDeepseekV3, kGptOss, kLlama4 };

/// The arch of a config's model_type ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3",
/// "gpt_oss", "llama4_text" or "llama4"); any other is an error naming the known ones.
HfMoeArch hf_moe_arch(const std::string& model_type);
/// The model_type that names `arch` ("llama4_text" for kLlama4).
const char* hf_model_type(HfMoeArch arch);

/// What an architecture's block takes from its config beyond the sizes (hf_moe_layer_options reads
/// them from config.json; a model of other sizes, e.g. the example LM, states its own).
struct HfMoeRules {
  /// norm_topk_prob where the architecture reads it (olmoe, qwen2/3_moe, deepseek_v3); unset: the
  /// architecture's default (false, deepseek_v3 true). Mixtral and GPT-OSS always renormalise,
  /// Llama-4 never.
  std::optional<bool> normalize_topk;
  int64_t num_groups = 1;  ///< deepseek_v3's n_group and topk_group
  int64_t topk_groups = 1;
  double routed_scaling_factor = 1.0;  ///< deepseek_v3
  int64_t shared_ffn_hidden =
      0;                      ///< the shared expert's width (qwen2, deepseek_v3, llama4); 0: none
  double swiglu_limit = 7.0;  ///< gpt_oss's clamped SwiGLU
  double swiglu_alpha = 1.702;
};

/// `arch`'s routing and expert rules (the table above) applied to `options`, whose sizes and
/// other settings are kept: score function, renormalisation, groups, routed scale, router and
/// expert biases, activation and interleave, input scaling and the shared expert (gated for
/// qwen2_moe).
void apply_hf_moe_rules(HfMoeArch arch, const HfMoeRules& rules, MoELayerOptions& options);

/// The MoELayerOptions of the MoE block a Hugging Face config describes (config.json's text; a
/// Llama-4 config's text_config is taken when present): sizes, routing, the shared expert, the
/// activation and biases, with aux_loss_coeff = k · router_aux_loss_coef (transformers' loss
/// averages over the k choices) and float32 CPU parameters. Errors name a missing or ill-typed
/// key.
MoELayerOptions hf_moe_layer_options(const std::string& config_json);

enum class HfWeightLayout {
  kCheckpoint,  ///< the hub's names: per expert where its checkpoints store them so
  kModule,      ///< transformers 5's module tensors: fused experts
};

using TensorMap = std::unordered_map<std::string, at::Tensor>;

/// Copies the block's tensors `prefix` + name from `tensors` into `layer`, built for `arch` (e.g.
/// with hf_moe_layer_options): the experts in either layout; with expert parallelism this rank's
/// global experts. Each tensor is converted to its parameter's dtype and device. All or nothing:
/// every tensor is found and checked (floating, strided, shape) before anything is copied; a
/// missing tensor, a wrong shape or dtype, and a name under `prefix` that the block does not have
/// are errors naming the tensor. So is a layer with parameters the block has no tensors for (a
/// router bias, expert biases, a shared expert or its gate), which would keep their random
/// initialization; an expert bias, zero at first, may stay.
void load_hf_moe(MoELayer& layer, HfMoeArch arch, const TensorMap& tensors,
                 const std::string& prefix = "");

/// The layer's tensors under the block's names (`prefix` + name), in `layout` (on the parameters'
/// device, in their dtype; detached, and sharing memory with the parameters or gradients where
/// the layout is theirs, as a state_dict does: clone one to change it): what load_hf_moe reads
/// back. With `gradients`, the parameters' gradients in the same places (zeros where a parameter
/// has none yet), so that they compare with a reference's. With expert parallelism, the rank's
/// experts only: their tensors hold its E/ep experts.
std::vector<std::pair<std::string, at::Tensor>> hf_moe_tensors(const MoELayer& layer,
                                                               HfMoeArch arch,
                                                               HfWeightLayout layout,
                                                               const std::string& prefix = "",
                                                               bool gradients = false);

}  // namespace torchmoe::checkpoint
