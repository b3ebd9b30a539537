#include "model.h"

#include <ATen/ATen.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <utility>

namespace moe_lm {
namespace {

constexpr double kInitStd = 0.02;  // GPT-2's initialisation for embeddings and projections

// GroupedLinear's default initialisation (kaiming_uniform_ with a = sqrt(5), as torch::nn::Linear)
// of the local experts, each from a generator of its own seeded by `seed` and its global index
// (first_expert + local index): a rank of an expert-parallel model draws exactly the weights its
// experts have in the single-process model, whatever the shard.
void init_experts(torchmoe::GroupedLinear& layer, uint64_t seed, int64_t first_expert) {
  torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> weights = layer->expert_weights();
  for (size_t l = 0; l < weights.size(); ++l) {
    auto gen =
        at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(first_expert) + l);
    const double bound = 1.0 / std::sqrt(static_cast<double>(weights[l].size(1)));
    weights[l].copy_(
        torch::empty(weights[l].sizes(), torch::kFloat32).uniform_(-bound, bound, gen));
  }
}

}  // namespace

void ModelConfig::save(torch::serialize::OutputArchive& archive) const {
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"vocab", vocab},
                                   {"layers", layers},
                                   {"hidden", hidden},
                                   {"heads", heads},
                                   {"experts", experts},
                                   {"topk", topk},
                                   {"ffn", ffn},
                                   {"seq", seq}}) {
    archive.write(std::string("config.") + key, c10::IValue(value));
  }
  archive.write("config.aux_loss_coeff", c10::IValue(aux_loss_coeff));
  archive.write("config.z_loss_coeff", c10::IValue(z_loss_coeff));
  archive.write("config.expert_bias", c10::IValue(expert_bias));
  archive.write("config.moe_block", c10::IValue(moe_block));
}

ModelConfig ModelConfig::load(torch::serialize::InputArchive& archive) {
  ModelConfig c;
  auto read_int = [&](const char* key, int64_t& out) {
    c10::IValue v;
    archive.read(std::string("config.") + key, v);
    out = v.toInt();
  };
  auto read_double = [&](const char* key, double& out) {
    c10::IValue v;
    archive.read(std::string("config.") + key, v);
    out = v.toDouble();
  };
  read_int("vocab", c.vocab);
  read_int("layers", c.layers);
  read_int("hidden", c.hidden);
  read_int("heads", c.heads);
  read_int("experts", c.experts);
  read_int("topk", c.topk);
  read_int("ffn", c.ffn);
  read_int("seq", c.seq);
  read_double("aux_loss_coeff", c.aux_loss_coeff);
  read_double("z_loss_coeff", c.z_loss_coeff);
  // Checkpoints from before the option have no entry: their routers had no bias.
  c10::IValue expert_bias;
  c.expert_bias = archive.try_read("config.expert_bias", expert_bias) && expert_bias.toBool();
  // Likewise for the block: theirs was the plain softmax top-k.
  c10::IValue block;
  if (archive.try_read("config.moe_block", block)) c.moe_block = block.toStringRef();
  return c;
}

const std::vector<std::string>& moe_blocks() {
  static const std::vector<std::string> blocks = {"mixtral",     "olmoe",   "qwen3", "qwen2",
                                                  "deepseek-v3", "gpt-oss", "llama4"};
  return blocks;
}

void apply_moe_block(const std::string& block, torchmoe::MoELayerOptions& options) {
  using torchmoe::checkpoint::HfMoeArch;
  static const std::map<std::string, HfMoeArch> kArchs = {
      {"mixtral", HfMoeArch::kMixtral},        {"olmoe", HfMoeArch::kOlmoe},
      {"qwen3", HfMoeArch::kQwen3Moe},         {"qwen2", HfMoeArch::kQwen2Moe},
      {"deepseek-v3", HfMoeArch::kDeepseekV3}, {"gpt-oss", HfMoeArch::kGptOss},
      {"llama4", HfMoeArch::kLlama4}};
  const auto arch = kArchs.find(block);
  TORCH_CHECK(arch != kArchs.end(), "--moe-block must be one of mixtral, olmoe, qwen3, qwen2, ",
              "deepseek-v3, gpt-oss, llama4, got '", block, "'");
  // The rules' values at the example's sizes: renormalised top-k (not OLMoE's), a shared expert of
  // the experts' width, and DeepSeek-V3's 8 groups keeping 4 of 256 experts as 4 groups keeping 2
  // where the experts divide into groups of 2 or more and those groups hold k experts.
  const int64_t experts = options.num_experts(), topk = options.router().topk();
  torchmoe::checkpoint::HfMoeRules rules;
  rules.normalize_topk = block != "olmoe";
  rules.shared_ffn_hidden = options.experts().ffn_hidden();
  int64_t groups = 4;
  while (groups > 1 && (experts % groups != 0 || experts / groups < 2 ||
                        topk > (groups / 2) * (experts / groups))) {
    groups /= 2;
  }
  rules.num_groups = groups;
  rules.topk_groups = std::max<int64_t>(1, groups / 2);
  rules.routed_scaling_factor = 2.5;
  torchmoe::checkpoint::apply_hf_moe_rules(arch->second, rules, options);
}

RMSNormImpl::RMSNormImpl(int64_t hidden_, torch::TensorOptions options_)
    : hidden(hidden_), options(options_) {
  reset();
}

void RMSNormImpl::reset() { weight = register_parameter("weight", torch::ones({hidden}, options)); }

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // ATen's RMSNorm: on CUDA one fused kernel each way with fp32 statistics (the composition of
  // casts, square, mean, rsqrt and products cost 7 kernels forward and more backward per norm:
  // about a sixth of the example's step, docs/experiments.md).
  return at::rms_norm(x, {hidden}, weight, 1e-6);
}

AttentionImpl::AttentionImpl(int64_t hidden_, int64_t heads_, torch::TensorOptions options_)
    : hidden(hidden_), heads(heads_), options(options_) {
  reset();
}

void AttentionImpl::reset() {
  qkv = register_module(
      "qkv", torch::nn::Linear(torch::nn::LinearOptions(hidden, 3 * hidden).bias(false)));
  proj = register_module("proj",
                         torch::nn::Linear(torch::nn::LinearOptions(hidden, hidden).bias(false)));
  torch::NoGradGuard no_grad;
  torch::nn::init::normal_(qkv->weight, 0, kInitStd);
  torch::nn::init::normal_(proj->weight, 0, kInitStd);
  qkv->to(options.device(), options.dtype().toScalarType());
  proj->to(options.device(), options.dtype().toScalarType());
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x) {
  const int64_t batch = x.size(0), seq = x.size(1), head_dim = hidden / heads;
  // [B, S, 3, heads, d] -> three [B, heads, S, d]
  const torch::Tensor qkv_out =
      qkv(x).view({batch, seq, 3, heads, head_dim}).permute({2, 0, 3, 1, 4});
  const torch::Tensor attended = at::scaled_dot_product_attention(
      qkv_out[0], qkv_out[1], qkv_out[2], /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
  return proj(attended.transpose(1, 2).reshape({batch, seq, hidden}));
}

MoETransformerImpl::MoETransformerImpl(
    ModelConfig config_, torch::TensorOptions options_,
    std::optional<torchmoe::ProcessGroupOptions> expert_parallel_, int64_t fp8_amax_history_len_)
    : config(std::move(config_)),
      options(options_),
      expert_parallel(std::move(expert_parallel_)),
      fp8_amax_history_len(fp8_amax_history_len_) {
  reset();
}

void MoETransformerImpl::reset() {
  const ModelConfig& c = config;
  const torch::Device device = options.device();
  const torch::Dtype dtype = options.dtype().toScalarType();
  token_embedding = register_module("token_embedding", torch::nn::Embedding(c.vocab, c.hidden));
  position_embedding = register_module("position_embedding", torch::nn::Embedding(c.seq, c.hidden));
  {
    torch::NoGradGuard no_grad;
    torch::nn::init::normal_(token_embedding->weight, 0, kInitStd);
    torch::nn::init::normal_(position_embedding->weight, 0, kInitStd);
  }
  token_embedding->to(device, dtype);
  position_embedding->to(device, dtype);
  attention_norms = register_module("attention_norms", torch::nn::ModuleList());
  attentions = register_module("attentions", torch::nn::ModuleList());
  moe_norms = register_module("moe_norms", torch::nn::ModuleList());
  moes = register_module("moes", torch::nn::ModuleList());
  for (int64_t l = 0; l < c.layers; ++l) {
    attention_norms->push_back(RMSNorm(c.hidden, options));
    attentions->push_back(Attention(c.hidden, c.heads, options));
    moe_norms->push_back(RMSNorm(c.hidden, options));
    // Expert weight gradients go straight into fp32 main-grad buffers (the trainer's). One
    // [E, out, in] weight per layer rather than E: one autograd input per GroupedLinear call
    // instead of E (LibTorch's per-input bookkeeping costs host time per expert;
    // docs/performance.md, "Host time per forward").
    torchmoe::MoELayerOptions moe(c.hidden, c.ffn, c.experts, c.topk);
    moe.params_dtype(dtype).device(device);
    moe.router().aux_loss_coeff(c.aux_loss_coeff).z_loss_coeff(c.z_loss_coeff);
    apply_moe_block(c.moe_block, moe);
    if (c.expert_bias) moe.router().expert_bias(true);
    moe.experts().linear().fuse_wgrad_accumulation(true).single_grouped_weight(true);
    moe.experts().linear().fp8_amax_history_len(fp8_amax_history_len);
    // The experts are initialised below, from the layer's own seeds: the default would draw
    // E/ep experts from the stream the other parameters come from, which would then differ
    // between the single-process model and its shards.
    moe.experts().linear().init_method([](torch::Tensor&) {});
    if (expert_parallel) moe.expert_parallel(*expert_parallel);
    const torchmoe::MoELayer layer(moe);
    const int64_t first_expert = expert_parallel ? expert_parallel->group()->getRank() *
                                                       layer->experts->options.num_experts()
                                                 : 0;
    std::vector<std::pair<torchmoe::GroupedLinear, int64_t>> projections = {
        {layer->experts->fc1, first_expert}, {layer->experts->fc2, first_expert}};
    // A shared expert (--moe-block qwen2, deepseek-v3, llama4) takes the experts' linear options,
    // the no-op init_method included: it is initialised here too, the same on every rank.
    if (layer->shared_expert) {
      projections.emplace_back(layer->shared_expert->fc1, 0);
      projections.emplace_back(layer->shared_expert->fc2, 0);
    }
    for (auto& [fc, first] : projections) {
      const auto seed = static_cast<uint64_t>(
          torch::randint(std::numeric_limits<int64_t>::max(), {}, torch::kLong).item<int64_t>());
      init_experts(fc, seed, first);
    }
    moes->push_back(layer);
  }
  final_norm = register_module("final_norm", RMSNorm(c.hidden, options));
}

std::vector<torchmoe::MoELayer> MoETransformerImpl::moe_layers() const {
  std::vector<torchmoe::MoELayer> layers;
  for (const auto& m : *moes) {
    layers.emplace_back(std::dynamic_pointer_cast<torchmoe::MoELayerImpl>(m));
  }
  return layers;
}

ModelOutput MoETransformerImpl::forward(const torch::Tensor& tokens,
                                        std::optional<bool> is_first_microbatch) {
  const int64_t seq = tokens.size(1);
  const torch::Tensor positions = torch::arange(seq, tokens.options());
  torch::Tensor x = token_embedding(tokens) + position_embedding(positions);
  ModelOutput out;
  out.aux_loss = torch::zeros({}, torch::TensorOptions(torch::kFloat32).device(tokens.device()));
  for (int64_t l = 0; l < config.layers; ++l) {
    x = x + attentions[l]->as<AttentionImpl>()->forward(
                attention_norms[l]->as<RMSNormImpl>()->forward(x));
    const torchmoe::MoEOutput moe = moes[l]->as<torchmoe::MoELayerImpl>()->forward(
        moe_norms[l]->as<RMSNormImpl>()->forward(x), is_first_microbatch);
    x = x + moe.output;
    out.aux_loss = out.aux_loss + moe.aux_loss;
    out.tokens_per_expert.push_back(moe.tokens_per_expert);
  }
  // Output projection tied to the token embedding; logits in fp32 for the loss.
  out.logits = torch::matmul(final_norm(x), token_embedding->weight.t()).to(torch::kFloat32);
  return out;
}

}  // namespace moe_lm
