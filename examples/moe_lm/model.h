#pragma once
// A small decoder-only transformer language model over bytes whose FFN blocks are torchmoe
// MoELayers: token + position embeddings, then per block
//   x = x + Attention(RMSNorm(x))      (causal, at::scaled_dot_product_attention)
//   x = x + MoELayer(RMSNorm(x))       (router -> permute -> GroupedMLP -> unpermute)
// and a final RMSNorm with an output projection tied to the token embedding.
//
// With expert parallelism (--ep) every MoELayer holds this rank's E/ep experts and exchanges
// tokens over the process group; the other parameters are replicated on every rank.

#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>
#include <torch/serialize/archive.h>

#include <torchmoe/torchmoe.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace moe_lm {

struct ModelConfig {
  int64_t vocab = 256;  // bytes
  int64_t layers = 4;
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t experts = 8;
  int64_t topk = 2;
  int64_t ffn = 256;
  int64_t seq = 128;  // longest context (position embeddings)
  double aux_loss_coeff = 1e-2;
  double z_loss_coeff = 1e-3;
  bool expert_bias = false;  // each router's aux-loss-free balancing bias (--expert-bias)
  // The architecture whose routing and expert rules the MoE layers take (--moe-block): mixtral,
  // olmoe, qwen3, qwen2, deepseek-v3, gpt-oss or llama4 (apply_moe_block).
  std::string moe_block = "mixtral";

  void save(torch::serialize::OutputArchive& archive) const;
  static ModelConfig load(torch::serialize::InputArchive& archive);
};

class RMSNormImpl : public torch::nn::Cloneable<RMSNormImpl> {
 public:
  RMSNormImpl(int64_t hidden, torch::TensorOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);  // statistics in fp32, returned in x's dtype

  int64_t hidden;
  torch::TensorOptions options;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

class AttentionImpl : public torch::nn::Cloneable<AttentionImpl> {
 public:
  AttentionImpl(int64_t hidden, int64_t heads, torch::TensorOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);  // [B, S, H], causal

  int64_t hidden, heads;
  torch::TensorOptions options;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(Attention);

/// The names --moe-block takes.
const std::vector<std::string>& moe_blocks();
/// `block`'s routing and expert rules (checkpoint::apply_hf_moe_rules) on options built from the
/// example's sizes: renormalised top-k (not olmoe's), deepseek-v3's groups as 4 keeping 2 (or
/// fewer for few experts) and its routed scale 2.5, and a shared expert of the experts' width
/// (qwen2, deepseek-v3, llama4).
void apply_moe_block(const std::string& block, torchmoe::MoELayerOptions& options);

/// What one forward returns: logits and the summed router losses and loads of all MoE layers.
struct ModelOutput {
  torch::Tensor logits;                          // [B, S, vocab] float32
  torch::Tensor aux_loss;                        // scalar float32
  std::vector<torch::Tensor> tokens_per_expert;  // one [E] per layer
};

class MoETransformerImpl : public torch::nn::Cloneable<MoETransformerImpl> {
 public:
  /// expert_parallel: the MoE layers' experts sharded over this group (config.experts divisible
  /// by its size). A rank's experts start as the same experts of the single-process model made
  /// with the same seed.
  /// fp8_amax_history_len: the experts' delayed-scaling state (GroupedLinearOptions'), 0 for none.
  MoETransformerImpl(ModelConfig config, torch::TensorOptions options,
                     std::optional<torchmoe::ProcessGroupOptions> expert_parallel = std::nullopt,
                     int64_t fp8_amax_history_len = 0);
  void reset() override;

  /// tokens [B, S] int64 with S <= config.seq. is_first_microbatch: true makes the experts'
  /// fused weight gradients overwrite their fp32 sums instead of adding (GroupedLinear's).
  ModelOutput forward(const torch::Tensor& tokens,
                      std::optional<bool> is_first_microbatch = std::nullopt);

  /// The MoE layers, in order (for main-grad buffers, expert-bias updates, loads).
  std::vector<torchmoe::MoELayer> moe_layers() const;

  ModelConfig config;
  torch::TensorOptions options;
  std::optional<torchmoe::ProcessGroupOptions> expert_parallel;
  int64_t fp8_amax_history_len = 0;
  torch::nn::Embedding token_embedding{nullptr}, position_embedding{nullptr};
  torch::nn::ModuleList attention_norms{nullptr}, attentions{nullptr}, moe_norms{nullptr},
      moes{nullptr};
  RMSNorm final_norm{nullptr};
};
TORCH_MODULE(MoETransformer);

}  // namespace moe_lm
