#include "torchmoe/checkpoint/hf_moe.h"

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>
#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchmoe::checkpoint {
namespace {

using nlohmann::json;

constexpr const char* kOptionsOp = "hf_moe_layer_options";
constexpr const char* kLoadOp = "load_hf_moe";
// As deep as a config's arrays and objects may nest (serde_json's and the safetensors header's
// limit; configs need 3).
constexpr int kMaxConfigDepth = 128;

struct ArchName {
  HfMoeArch arch;
  const char* model_type;
};
constexpr ArchName kArchNames[] = {
    {HfMoeArch::kMixtral, "mixtral"},        {HfMoeArch::kOlmoe, "olmoe"},
    {HfMoeArch::kQwen2Moe, "qwen2_moe"},     {HfMoeArch::kQwen3Moe, "qwen3_moe"},
    {HfMoeArch::kDeepseekV3, "deepseek_v3"}, {HfMoeArch::kGptOss, "gpt_oss"},
    {HfMoeArch::kLlama4, "llama4_text"},
};

// What differs between the architectures' tensors (hf_moe.h's table).
struct ArchLayout {
  const char* router;     // the router's module name
  bool router_bias;       // router.bias [E]
  bool score_bias;        // gate.e_score_correction_bias [E] (the router's expert_bias)
  bool transposed;        // experts as [E, in, out]
  bool expert_biases;     // gate_up_proj_bias, down_proj_bias
  bool fused_checkpoint;  // the hub's checkpoints store the fused expert tensors
  const char* gate_name;  // per-expert names: gate, up, down
  const char* up_name;
  const char* down_name;
  const char* shared;  // the shared expert's module name, or null
  bool shared_gate;    // shared_expert_gate.weight [1, H]
};

ArchLayout layout_of(HfMoeArch arch) {
  switch (arch) {
    case HfMoeArch::kMixtral:
      return {"gate", false, false, false, false, false, "w1", "w3", "w2", nullptr, false};
    case HfMoeArch::kOlmoe:
    case HfMoeArch::kQwen3Moe:
      return {"gate",      false,     false,       false,   false, false,
              "gate_proj", "up_proj", "down_proj", nullptr, false};
    case HfMoeArch::kQwen2Moe:
      return {"gate",      false,     false,       false,           false, false,
              "gate_proj", "up_proj", "down_proj", "shared_expert", true};
    case HfMoeArch::kDeepseekV3:
      return {"gate", false,       true,      false,       false,
              false,  "gate_proj", "up_proj", "down_proj", "shared_experts",
              false};
    case HfMoeArch::kGptOss:
      return {"router", true, false, true, true, true, nullptr, nullptr, nullptr, nullptr, false};
    case HfMoeArch::kLlama4:
      return {"router", false,   false,           true, false, true, nullptr,
              nullptr,  nullptr, "shared_expert", false};
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled HfMoeArch");
}

// ---- config -------------------------------------------------------------------------------------

const json& key(const json& config, const char* name) {
  TORCH_CHECK(config.contains(name), kOptionsOp, ": the config has no '", name, "'");
  return config.at(name);
}

int64_t int_key(const json& config, const char* name) {
  const json& v = key(config, name);
  TORCH_CHECK(
      v.is_number_integer() && (!v.is_number_unsigned() ||
                                v.get<uint64_t>() <= uint64_t{std::numeric_limits<int64_t>::max()}),
      kOptionsOp, ": '", name, "' must be an integer that fits int64, got ", v.dump());
  return v.get<int64_t>();
}

// A size key that may be 0 (none), not negative.
int64_t count_key(const json& config, const char* name) {
  const int64_t value = int_key(config, name);
  TORCH_CHECK(value >= 0, kOptionsOp, ": '", name, "' must be >= 0, got ", value);
  return value;
}

double number_or(const json& config, const char* name, double fallback) {
  if (!config.contains(name) || config.at(name).is_null()) return fallback;
  const json& v = config.at(name);
  TORCH_CHECK(v.is_number(), kOptionsOp, ": '", name, "' must be a number, got ", v.dump());
  return v.get<double>();
}

bool bool_or(const json& config, const char* name, bool fallback) {
  if (!config.contains(name) || config.at(name).is_null()) return fallback;
  const json& v = config.at(name);
  TORCH_CHECK(v.is_boolean(), kOptionsOp, ": '", name, "' must be true or false, got ", v.dump());
  return v.get<bool>();
}

// The first of `names` the config has.
int64_t first_int_key(const json& config, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (config.contains(name) && !config.at(name).is_null()) return int_key(config, name);
  }
  std::string list;
  for (const char* name : names) list += std::string(list.empty() ? "" : ", ") + name;
  TORCH_CHECK(false, kOptionsOp, ": the config has none of ", list);
}

// ---- tensors ------------------------------------------------------------------------------------

at::Tensor grad_or_zeros(const at::Tensor& p) {
  return p.grad().defined() ? p.grad() : at::zeros_like(p);
}

// Expert g's weight or bias ("weight" / "bias") of a GroupedLinear, or its gradient: separate
// parameters per expert or one stacked [G, ...].
std::vector<at::Tensor> expert_tensors(const GroupedLinear& fc, const std::string& kind,
                                       bool gradients) {
  const auto params = fc->named_parameters(/*recurse=*/false);
  const int64_t groups = fc->options.num_gemms();
  std::vector<at::Tensor> out;
  if (const at::Tensor* stacked = params.find(kind)) {
    const at::Tensor t = gradients ? grad_or_zeros(*stacked) : *stacked;
    for (int64_t g = 0; g < groups; ++g) out.push_back(t[g]);
    return out;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor* p = params.find(kind + std::to_string(g));
    TORCH_INTERNAL_ASSERT(p != nullptr, "GroupedLinear has no ", kind, " of expert ", g);
    out.push_back(gradients ? grad_or_zeros(*p) : *p);
  }
  return out;
}

// The rank's first global expert and its expert count.
std::pair<int64_t, int64_t> local_experts(const MoELayer& layer) {
  const int64_t count = layer->experts->options.num_experts();
  const auto& ep = layer->options.expert_parallel();
  return {ep ? ep->group()->getRank() * count : 0, count};
}

// The loads of one load_hf_moe call: each source is checked against its HF shape when taken, and
// copied into its target once every source has been found.
class Loader {
 public:
  Loader(const TensorMap& tensors, std::string prefix, HfMoeArch arch)
      : tensors_(tensors), prefix_(std::move(prefix)), arch_(arch) {
    for (const auto& [name, tensor] : tensors_) {
      if (name.rfind(prefix_, 0) == 0) unused_.insert(name);
    }
  }

  bool has(const std::string& name) const { return tensors_.count(prefix_ + name) > 0; }

  // prefix + name, which must exist with `shape` and a floating dtype.
  at::Tensor take(const std::string& name, at::IntArrayRef shape) {
    const std::string full = prefix_ + name;
    const auto it = tensors_.find(full);
    TORCH_CHECK(it != tensors_.end(), kLoadOp, ": the ", hf_model_type(arch_), " block's tensor '",
                full, "' is missing");
    const at::Tensor& t = it->second;
    TORCH_CHECK(t.defined() && at::isFloatingType(t.scalar_type()), kLoadOp, ": '", full,
                "' must have a floating dtype, got ",
                t.defined() ? c10::toString(t.scalar_type()) : "an undefined tensor");
    // Checked here, before anything is copied: a load writes all of the layer or none of it.
    TORCH_CHECK(t.layout() == at::kStrided && !t.is_meta(), kLoadOp, ": '", full,
                "' must be a strided tensor with data, got layout ", t.layout(), " on ",
                t.device());
    TORCH_CHECK(t.sizes() == shape, kLoadOp, ": '", full, "' must have shape ", shape, ", got ",
                t.sizes());
    unused_.erase(full);
    return t;
  }

  // Names another rank loads (its experts): not unexpected here.
  void skip(const std::string& name) { unused_.erase(prefix_ + name); }

  void copy(const at::Tensor& target, const at::Tensor& source) {
    TORCH_INTERNAL_ASSERT(target.sizes() == source.sizes(), kLoadOp, ": ", target.sizes(), " vs ",
                          source.sizes());
    copies_.emplace_back(target, source);
  }

  void finish() {
    TORCH_CHECK(unused_.empty(), kLoadOp, ": '", unused_.empty() ? "" : *unused_.begin(),
                "' is not a tensor of the ", hf_model_type(arch_), " block under '", prefix_, "'");
    const at::NoGradGuard no_grad;
    for (auto& [target, source] : copies_) target.copy_(source);
  }

 private:
  const TensorMap& tensors_;
  const std::string prefix_;
  const HfMoeArch arch_;
  std::set<std::string> unused_;
  std::vector<std::pair<at::Tensor, at::Tensor>> copies_;
};

std::string expert_name(int64_t e, const char* proj) {
  return "experts." + std::to_string(e) + "." + proj + ".weight";
}

// fc1's weight [gate; up] in `fc1`'s dtype (at::cat refuses to promote between some, as FP8 and
// float).
at::Tensor concat_gate_up(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& fc1) {
  return at::cat({gate.to(fc1.scalar_type()), up.to(fc1.scalar_type())}, 0);
}

// A dense SwiGLU MLP's tensors, {module}.{gate,up,down}_proj.weight, into a GroupedMLP of one
// expert (fc1 = [gate; up]).
void load_shared(Loader& loader, const std::string& module, GroupedMLP& mlp) {
  const int64_t hidden = mlp->options.hidden(), ffn = mlp->options.ffn_hidden();
  const at::Tensor gate = loader.take(module + ".gate_proj.weight", {ffn, hidden});
  const at::Tensor up = loader.take(module + ".up_proj.weight", {ffn, hidden});
  const at::Tensor down = loader.take(module + ".down_proj.weight", {hidden, ffn});
  const at::Tensor fc1 = mlp->fc1->expert_weights()[0];
  loader.copy(fc1, concat_gate_up(gate, up, fc1));
  loader.copy(mlp->fc2->expert_weights()[0], down);
}

}  // namespace

HfMoeArch hf_moe_arch(const std::string& model_type) {
  if (model_type == "llama4") return HfMoeArch::kLlama4;
  std::string known;
  for (const ArchName& a : kArchNames) {
    if (model_type == a.model_type) return a.arch;
    known += std::string(known.empty() ? "" : ", ") + a.model_type;
  }
  TORCH_CHECK(false, "hf_moe_arch: model_type must be one of ", known, ", got '", model_type, "'");
}

const char* hf_model_type(HfMoeArch arch) {
  for (const ArchName& a : kArchNames) {
    if (a.arch == arch) return a.model_type;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled HfMoeArch");
}

MoELayerOptions hf_moe_layer_options(const std::string& config_json) {
  // The parser takes a NUL byte for the end of its input: what follows would be ignored.
  const size_t nul = config_json.find('\0');
  TORCH_CHECK(nul == std::string::npos, kOptionsOp, ": the config holds a NUL byte at offset ", nul,
              " of ", config_json.size());
  json config;
  try {
    // Values nested without limit would overflow the stack where they are copied or printed.
    config = json::parse(config_json, [](int depth, json::parse_event_t, json&) {
      TORCH_CHECK(depth <= kMaxConfigDepth, kOptionsOp, ": the config nests arrays and objects ",
                  "deeper than ", kMaxConfigDepth, " levels");
      return true;
    });
  } catch (const json::exception& e) {  // a syntax error, or a number out of range
    TORCH_CHECK(false, kOptionsOp, ": the config is not JSON: ", e.what());
  }
  TORCH_CHECK(config.is_object(), kOptionsOp, ": the config must be a JSON object");
  if (config.contains("text_config") && config.at("text_config").is_object()) {
    config = json(config.at("text_config"));
  }
  const json& type = key(config, "model_type");
  TORCH_CHECK(type.is_string(), kOptionsOp, ": 'model_type' must be a string, got ", type.dump());
  const HfMoeArch arch = hf_moe_arch(type.get<std::string>());
  const bool moe_width = arch == HfMoeArch::kQwen2Moe || arch == HfMoeArch::kQwen3Moe ||
                         arch == HfMoeArch::kDeepseekV3;
  const int64_t hidden = int_key(config, "hidden_size");
  const int64_t ffn = int_key(config, moe_width ? "moe_intermediate_size" : "intermediate_size");
  const int64_t experts =
      first_int_key(config, {"num_local_experts", "num_experts", "n_routed_experts"});
  const int64_t topk = int_key(config, "num_experts_per_tok");
  if (arch != HfMoeArch::kGptOss && config.contains("hidden_act")) {
    const json& act = config.at("hidden_act");
    TORCH_CHECK_NOT_IMPLEMENTED(act.is_string() && act.get<std::string>() == "silu", kOptionsOp,
                                ": the experts' activation must be silu (SwiGLU), got ",
                                act.dump());
  }
  HfMoeRules rules;
  switch (arch) {
    case HfMoeArch::kOlmoe:
    case HfMoeArch::kQwen3Moe:
    case HfMoeArch::kQwen2Moe:
      rules.normalize_topk = bool_or(config, "norm_topk_prob", false);
      break;
    case HfMoeArch::kDeepseekV3:
      rules.normalize_topk = bool_or(config, "norm_topk_prob", true);
      rules.num_groups = first_int_key(config, {"n_group"});
      rules.topk_groups = first_int_key(config, {"topk_group"});
      // transformers' DeepseekV3Config default; DeepSeek's own configs also name the routing,
      // which must be the one the block computes.
      rules.routed_scaling_factor = number_or(config, "routed_scaling_factor", 2.5);
      for (const auto& [name, value] :
           {std::pair{"scoring_func", "sigmoid"}, std::pair{"topk_method", "noaux_tc"}}) {
        TORCH_CHECK_NOT_IMPLEMENTED(!config.contains(name) || config.at(name) == value, kOptionsOp,
                                    ": '", name, "' must be \"", value,
                                    "\" (DeepSeek-V3's routing), got ", config.at(name).dump());
      }
      break;
    case HfMoeArch::kGptOss:
      rules.swiglu_limit = number_or(config, "swiglu_limit", 7.0);
      rules.swiglu_alpha = number_or(config, "swiglu_alpha", 1.702);
      break;
    case HfMoeArch::kMixtral:
    case HfMoeArch::kLlama4:
      break;
  }
  if (arch == HfMoeArch::kQwen2Moe) {
    rules.shared_ffn_hidden = count_key(config, "shared_expert_intermediate_size");
  } else if (arch == HfMoeArch::kDeepseekV3) {
    const int64_t shared = count_key(config, "n_shared_experts");
    TORCH_CHECK(ffn >= 0 && !c10::mul_overflows(ffn, shared, &rules.shared_ffn_hidden), kOptionsOp,
                ": the shared experts' width moe_intermediate_size (", ffn,
                ") x n_shared_experts (", shared, ") must fit int64");
  } else if (arch == HfMoeArch::kLlama4) {
    rules.shared_ffn_hidden = ffn;
  }
  MoELayerOptions options(hidden, ffn, experts, topk);
  options.router().aux_loss_coeff(static_cast<double>(topk) *
                                  number_or(config, "router_aux_loss_coef", 0.0));
  apply_hf_moe_rules(arch, rules, options);
  return options;
}

void apply_hf_moe_rules(HfMoeArch arch, const HfMoeRules& rules, MoELayerOptions& options) {
  TopKRouterOptions& router = options.router();
  GroupedMLPOptions& mlp = options.experts();
  const auto shared = [&](bool gate) {
    if (rules.shared_ffn_hidden > 0) {
      options.shared_expert(SharedExpertOptions(rules.shared_ffn_hidden).gate(gate));
    }
  };
  switch (arch) {
    case HfMoeArch::kMixtral:  // always renormalised, also at top-1
      router.normalize_topk(true);
      break;
    case HfMoeArch::kOlmoe:
    case HfMoeArch::kQwen3Moe:
      router.normalize_topk(rules.normalize_topk.value_or(false));
      break;
    case HfMoeArch::kQwen2Moe:
      router.normalize_topk(rules.normalize_topk.value_or(false));
      shared(/*gate=*/true);
      break;
    case HfMoeArch::kDeepseekV3:
      router.score_function(RouterScore::kSigmoid)
          .expert_bias(true)
          .normalize_topk(rules.normalize_topk.value_or(true))
          .num_groups(rules.num_groups)
          .topk_groups(rules.topk_groups)
          .routed_scaling_factor(rules.routed_scaling_factor);
      shared(/*gate=*/false);
      break;
    case HfMoeArch::kGptOss:
      // Softmax over the k chosen logits = the full softmax's k probabilities renormalised.
      router.normalize_topk(true).bias(true);
      mlp.activation(GluActivation::kClampedSwiGLU)
          .clamped(ClampedSwiGLUOptions()
                       .limit(rules.swiglu_limit)
                       .alpha(rules.swiglu_alpha)
                       .offset(1.0))
          .glu_interleave_size(1)
          .scale_bias(true);
      mlp.linear().bias(true);
      break;
    case HfMoeArch::kLlama4:
      router.score_function(RouterScore::kSigmoid).normalize_topk(false);
      options.scale_expert_input(true);
      shared(/*gate=*/false);
      break;
  }
}

void load_hf_moe(MoELayer& layer, HfMoeArch arch, const TensorMap& tensors,
                 const std::string& prefix) {
  const ArchLayout l = layout_of(arch);
  const int64_t all = layer->options.num_experts(), hidden = layer->options.hidden();
  const int64_t ffn = layer->experts->options.ffn_hidden();
  const auto [first, count] = local_experts(layer);
  // Parameters the block has no tensors for would keep their random initialization. (An expert
  // bias may stay: it starts at zero and only steers the choice, as in aux-loss-free balancing.)
  const auto extra = [&](bool has, const char* part, const char* option) {
    TORCH_CHECK(!has, kLoadOp, ": the layer has ", part, ", which the ", hf_model_type(arch),
                " block does not: build it without ", option);
  };
  extra(layer->router->bias.defined() && !l.router_bias, "a router bias", "router().bias(true)");
  extra(!layer->experts->fc1->expert_biases().empty() && !l.expert_biases, "expert biases",
        "experts().linear().bias(true)");
  extra(layer->shared_expert && !l.shared, "a shared expert", "shared_expert()");
  extra(layer->shared_expert_gate.defined() && !l.shared_gate, "a gate on its shared expert",
        "shared_expert().gate(true)");
  Loader loader(tensors, prefix, arch);
  const std::string router = l.router;
  loader.copy(layer->router->weight, loader.take(router + ".weight", {all, hidden}));
  if (l.router_bias) {
    TORCH_CHECK(layer->router->bias.defined(), kLoadOp, ": the ", hf_model_type(arch),
                " block's router has a bias; build the layer with router().bias(true)");
    loader.copy(layer->router->bias, loader.take(router + ".bias", {all}));
  }
  if (l.score_bias) {
    TORCH_CHECK(layer->router->expert_bias.defined(), kLoadOp, ": the ", hf_model_type(arch),
                " block's router has e_score_correction_bias; build the layer with "
                "router().expert_bias(true)");
    loader.copy(layer->router->expert_bias,
                loader.take(router + ".e_score_correction_bias", {all}));
  }
  const std::vector<at::Tensor> fc1 = layer->experts->fc1->expert_weights();
  const std::vector<at::Tensor> fc2 = layer->experts->fc2->expert_weights();
  if (l.fused_checkpoint || loader.has("experts.gate_up_proj")) {
    const at::Tensor gate_up =
        loader.take("experts.gate_up_proj", l.transposed ? at::IntArrayRef({all, hidden, 2 * ffn})
                                                         : at::IntArrayRef({all, 2 * ffn, hidden}));
    const at::Tensor down =
        loader.take("experts.down_proj", l.transposed ? at::IntArrayRef({all, ffn, hidden})
                                                      : at::IntArrayRef({all, hidden, ffn}));
    for (int64_t e = 0; e < count; ++e) {
      loader.copy(fc1[e], l.transposed ? gate_up[first + e].t() : gate_up[first + e]);
      loader.copy(fc2[e], l.transposed ? down[first + e].t() : down[first + e]);
    }
    if (l.expert_biases) {
      const at::Tensor b1 = loader.take("experts.gate_up_proj_bias", {all, 2 * ffn});
      const at::Tensor b2 = loader.take("experts.down_proj_bias", {all, hidden});
      const std::vector<at::Tensor> bias1 = layer->experts->fc1->expert_biases();
      const std::vector<at::Tensor> bias2 = layer->experts->fc2->expert_biases();
      TORCH_CHECK(
          !bias1.empty() && !bias2.empty(), kLoadOp, ": the ", hf_model_type(arch),
          " block's experts have biases; build the layer with experts().linear().bias(true)");
      for (int64_t e = 0; e < count; ++e) {
        loader.copy(bias1[e], b1[first + e]);
        loader.copy(bias2[e], b2[first + e]);
      }
    }
  } else {
    for (int64_t e = 0; e < all; ++e) {
      const std::string gate = expert_name(e, l.gate_name), up = expert_name(e, l.up_name),
                        down = expert_name(e, l.down_name);
      if (e < first || e >= first + count) {  // another rank's expert
        for (const std::string& name : {gate, up, down}) loader.skip(name);
        continue;
      }
      const at::Tensor g = loader.take(gate, {ffn, hidden});
      const at::Tensor u = loader.take(up, {ffn, hidden});
      loader.copy(fc1[e - first], concat_gate_up(g, u, fc1[e - first]));
      loader.copy(fc2[e - first], loader.take(down, {hidden, ffn}));
    }
  }
  if (l.shared) {
    TORCH_CHECK(layer->shared_expert, kLoadOp, ": the ", hf_model_type(arch),
                " block has a shared expert; build the layer with shared_expert()");
    load_shared(loader, l.shared, layer->shared_expert);
  }
  if (l.shared_gate) {
    TORCH_CHECK(layer->shared_expert_gate.defined(), kLoadOp, ": the ", hf_model_type(arch),
                " block gates its shared expert; build the layer with shared_expert().gate(true)");
    loader.copy(layer->shared_expert_gate, loader.take("shared_expert_gate.weight", {1, hidden}));
  }
  loader.finish();
}

std::vector<std::pair<std::string, at::Tensor>> hf_moe_tensors(const MoELayer& layer,
                                                               HfMoeArch arch,
                                                               HfWeightLayout layout,
                                                               const std::string& prefix,
                                                               bool gradients) {
  const ArchLayout l = layout_of(arch);
  const auto of = [&](const at::Tensor& p) { return gradients ? grad_or_zeros(p) : p.detach(); };
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    out.emplace_back(prefix + name, t.detach().contiguous());
  };
  const std::string router = l.router;
  add(router + ".weight", of(layer->router->weight));
  if (l.router_bias && layer->router->bias.defined()) {
    add(router + ".bias", of(layer->router->bias));
  }
  if (l.score_bias && layer->router->expert_bias.defined()) {
    // A buffer: no gradient.
    add(router + ".e_score_correction_bias",
        gradients ? at::zeros_like(layer->router->expert_bias) : layer->router->expert_bias);
  }
  const std::vector<at::Tensor> fc1 = expert_tensors(layer->experts->fc1, "weight", gradients);
  const std::vector<at::Tensor> fc2 = expert_tensors(layer->experts->fc2, "weight", gradients);
  const int64_t ffn = layer->experts->options.ffn_hidden();
  const int64_t first = local_experts(layer).first;
  if (l.fused_checkpoint || layout == HfWeightLayout::kModule) {
    std::vector<at::Tensor> gate_up, down;
    for (size_t e = 0; e < fc1.size(); ++e) {
      gate_up.push_back(l.transposed ? fc1[e].t() : fc1[e]);
      down.push_back(l.transposed ? fc2[e].t() : fc2[e]);
    }
    add("experts.gate_up_proj", at::stack(gate_up));
    add("experts.down_proj", at::stack(down));
    if (l.expert_biases && layer->experts->fc1->options.bias()) {
      add("experts.gate_up_proj_bias",
          at::stack(expert_tensors(layer->experts->fc1, "bias", gradients)));
      add("experts.down_proj_bias",
          at::stack(expert_tensors(layer->experts->fc2, "bias", gradients)));
    }
  } else {
    for (size_t e = 0; e < fc1.size(); ++e) {
      const int64_t global = first + static_cast<int64_t>(e);
      add(expert_name(global, l.gate_name), fc1[e].narrow(0, 0, ffn));
      add(expert_name(global, l.up_name), fc1[e].narrow(0, ffn, ffn));
      add(expert_name(global, l.down_name), fc2[e]);
    }
  }
  if (l.shared && layer->shared_expert) {
    const std::string shared = l.shared;
    const at::Tensor w1 = expert_tensors(layer->shared_expert->fc1, "weight", gradients)[0];
    const int64_t width = layer->shared_expert->options.ffn_hidden();
    add(shared + ".gate_proj.weight", w1.narrow(0, 0, width));
    add(shared + ".up_proj.weight", w1.narrow(0, width, width));
    add(shared + ".down_proj.weight",
        expert_tensors(layer->shared_expert->fc2, "weight", gradients)[0]);
  }
  if (l.shared_gate && layer->shared_expert_gate.defined()) {
    add("shared_expert_gate.weight", of(layer->shared_expert_gate));
  }
  return out;
}

}  // namespace torchmoe::checkpoint
