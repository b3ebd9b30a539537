// MoELayer against Hugging Face transformers' own MoE blocks: test/reference/hf_moe_blocks.py runs
// each block (float64, tiny random configs, the routers' float32 casts lifted) and writes its
// parameters, input, output and gradients as safetensors; each case loads a block's file through
// hf_moe_layer_options and load_hf_moe and requires the same output, input gradient, weight
// gradients and routing. Float64 on the CPU to 1e-10; bf16 on CUDA to bf16's accuracy. Also the
// weight map both ways (both layouts, expert parallel shards) and its errors.

#include <torchmoe/checkpoint/hf_moe.h>
#include <torchmoe/checkpoint/safetensors.h>
#include <torchmoe/torchmoe.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <filesystem>
#include <map>
#include <string>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::MoELayer;
using torchmoe::checkpoint::HfMoeArch;
using torchmoe::checkpoint::HfWeightLayout;
using torchmoe::checkpoint::TensorMap;

namespace {

// One block's reference file (written by the ctest fixture hf_reference_data).
struct HfBlock {
  std::string config;
  HfMoeArch arch;
  std::map<std::string, torch::Tensor> tensors;
  TensorMap params;  // the block's parameters and buffers under their module names
};

HfBlock load_block(const std::string& name) {
  const std::string path = std::string(TORCHMOE_HF_REFERENCE_DIR) + "/" + name + ".safetensors";
  INFO("reference " << path << " (made by test/reference/hf_moe_blocks.py: ctest runs it as the "
                    << "fixture hf_reference_data)");
  REQUIRE(std::filesystem::exists(path));
  const torchmoe::checkpoint::SafetensorsFile file(path);
  HfBlock block;
  block.config = file.metadata().at("config");
  block.arch = torchmoe::checkpoint::hf_moe_arch(
      file.metadata().at("arch") == "llama4" ? "llama4_text" : file.metadata().at("arch"));
  for (const std::string& n : file.names()) {
    const torch::Tensor t = file.tensor(n);
    block.tensors[n] = t;
    for (const char* kind : {"param.", "buffer."}) {
      if (n.rfind(kind, 0) == 0) block.params[n.substr(std::string(kind).size())] = t;
    }
  }
  return block;
}

// max |a - e| / max |e| over the tensor.
double scaled_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  const torch::Tensor a = actual.detach().to(torch::kCPU, torch::kFloat64);
  const torch::Tensor e = expected.detach().to(torch::kCPU, torch::kFloat64);
  REQUIRE(a.sizes() == e.sizes());
  REQUIRE_FALSE(a.isnan().any().item<bool>());
  const double scale = e.abs().max().item<double>();
  return (a - e).abs().max().item<double>() / (scale > 0 ? scale : 1.0);
}

// ‖a - e‖ / ‖e‖.
double norm_error(const torch::Tensor& actual, const torch::Tensor& expected) {
  const torch::Tensor a = actual.detach().to(torch::kCPU, torch::kFloat64);
  const torch::Tensor e = expected.detach().to(torch::kCPU, torch::kFloat64);
  REQUIRE(a.sizes() == e.sizes());
  REQUIRE_FALSE(a.isnan().any().item<bool>());
  const double norm = e.norm().item<double>();
  return (a - e).norm().item<double>() / (norm > 0 ? norm : 1.0);
}

// The block's layer in `dtype` on `device`, loaded with its weights; the aux loss off (the
// reference's gradients are of the output alone).
MoELayer build_layer(const HfBlock& block, torch::Dtype dtype, torch::Device device) {
  torchmoe::MoELayerOptions options = torchmoe::checkpoint::hf_moe_layer_options(block.config);
  options.router().aux_loss_coeff(0.0);
  options.params_dtype(dtype).device(device);
  MoELayer layer(options);
  torchmoe::checkpoint::load_hf_moe(layer, block.arch, block.params);
  return layer;
}

// Runs the block's input through `layer` with its output gradient and checks each result against
// the reference: `bound` on the error measure `error`.
template <typename Error>
void check_against_block(MoELayer& layer, const HfBlock& block, torch::Dtype dtype,
                         torch::Device device, double bound, Error&& error) {
  const torch::Tensor x = block.tensors.at("input").to(device, dtype).detach().requires_grad_(true);
  const torchmoe::MoEOutput out = layer(x);
  out.output.backward(block.tensors.at("grad_output").to(device, dtype));
  CHECK(error(out.output, block.tensors.at("output")) <= bound);
  CHECK(error(x.grad(), block.tensors.at("grad_input")) <= bound);
  for (const auto& [name, grad] :
       torchmoe::checkpoint::hf_moe_tensors(layer, block.arch, HfWeightLayout::kModule, "",
                                            /*gradients=*/true)) {
    if (name.find("e_score_correction_bias") != std::string::npos) continue;  // a buffer
    INFO("gradient of " << name);
    CHECK(error(grad, block.tensors.at("grad." + name)) <= bound);
  }
}

const char* const kBlocks[] = {"mixtral",     "olmoe",   "qwen3_moe", "qwen2_moe",
                               "deepseek_v3", "gpt_oss", "llama4"};

}  // namespace

TEST_CASE("MoELayer equals Hugging Face's MoE blocks in float64", "[checkpoint][hf]") {
  const std::string name = GENERATE(from_range(std::begin(kBlocks), std::end(kBlocks)));
  INFO("block " << name);
  const HfBlock block = load_block(name);
  MoELayer layer = build_layer(block, torch::kFloat64, torch::kCPU);
  check_against_block(layer, block, torch::kFloat64, torch::kCPU, 1e-10, scaled_error);

  // The same experts, with the same weights (ascending expert order in both).
  const torch::Tensor x = block.tensors.at("input").reshape({-1, layer->options.hidden()});
  const torchmoe::RouterOutput routing = layer->router(x);
  const auto [indices, order] = routing.indices.sort(1);
  CHECK(torch::equal(indices, block.tensors.at("router.indices")));
  CHECK(scaled_error(routing.probs.gather(1, order), block.tensors.at("router.weights")) <= 1e-10);
}

TEST_CASE("MoELayer in bf16 on CUDA is close to Hugging Face's MoE blocks",
          "[checkpoint][hf][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const std::string name = GENERATE(from_range(std::begin(kBlocks), std::end(kBlocks)));
  INFO("block " << name);
  const HfBlock block = load_block(name);
  MoELayer layer = build_layer(block, torch::kBFloat16, torch::kCUDA);
  // bf16 operands and outputs (8 significant bits), fp32 accumulation: a few 1e-3 in norm.
  check_against_block(layer, block, torch::kBFloat16, torch::kCUDA, 2e-2, norm_error);
}

TEST_CASE("load_hf_moe and hf_moe_tensors round-trip both layouts through safetensors",
          "[checkpoint][hf]") {
  const std::string name = GENERATE(from_range(std::begin(kBlocks), std::end(kBlocks)));
  const HfWeightLayout layout = GENERATE(HfWeightLayout::kCheckpoint, HfWeightLayout::kModule);
  INFO("block " << name << ", layout " << (layout == HfWeightLayout::kModule ? "module" : "hub"));
  const HfBlock block = load_block(name);
  MoELayer source = build_layer(block, torch::kFloat64, torch::kCPU);
  const std::string prefix = "model.layers.3.mlp.";
  const auto tensors = torchmoe::checkpoint::hf_moe_tensors(source, block.arch, layout, prefix);
  if (layout == HfWeightLayout::kCheckpoint && block.arch == HfMoeArch::kMixtral) {
    CHECK(tensors[1].first == prefix + "experts.0.w1.weight");  // the hub's per-expert names
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("torchmoe_hf_" + name + ".safetensors")).string();
  torchmoe::checkpoint::save_safetensors(path, tensors);
  TensorMap read;
  for (auto& [n, t] : torchmoe::checkpoint::load_safetensors(path)) read[n] = t;
  std::filesystem::remove(path);

  torchmoe::MoELayerOptions options = torchmoe::checkpoint::hf_moe_layer_options(block.config);
  options.params_dtype(torch::kFloat32);  // converted on load
  MoELayer target(options);
  torchmoe::checkpoint::load_hf_moe(target, block.arch, read, prefix);
  const auto mine = source->named_parameters();
  for (const auto& item : target->named_parameters()) {
    INFO("parameter " << item.key());
    CHECK(torch::equal(item.value(), mine[item.key()].to(torch::kFloat32)));
  }
  if (block.arch == HfMoeArch::kDeepseekV3) {
    CHECK(
        torch::equal(target->router->expert_bias, source->router->expert_bias.to(torch::kFloat32)));
  }
}

TEST_CASE("load_hf_moe loads an expert-parallel rank's experts", "[checkpoint][hf]") {
  // A stand-in group of 2 ranks, this process rank 1: the layer holds global experts 4..7.
  const HfBlock block = load_block("mixtral");
  MoELayer whole = build_layer(block, torch::kFloat64, torch::kCPU);
  for (const HfWeightLayout layout : {HfWeightLayout::kCheckpoint, HfWeightLayout::kModule}) {
    TensorMap tensors;
    for (auto& [n, t] :
         torchmoe::checkpoint::hf_moe_tensors(whole, block.arch, layout, "", false)) {
      tensors[n] = t;
    }
    torchmoe::MoELayerOptions options = torchmoe::checkpoint::hf_moe_layer_options(block.config);
    options.params_dtype(torch::kFloat64);
    // Building and loading the layer communicates nothing: a group without a backend will do.
    options.expert_parallel(torchmoe::ProcessGroupOptions(
        c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 1, 2)));
    MoELayer shard(options);
    torchmoe::checkpoint::load_hf_moe(shard, block.arch, tensors);
    const auto whole_fc1 = whole->experts->fc1->expert_weights();
    const auto shard_fc1 = shard->experts->fc1->expert_weights();
    REQUIRE(shard_fc1.size() == 4);
    for (int64_t e = 0; e < 4; ++e) CHECK(torch::equal(shard_fc1[e], whole_fc1[4 + e]));
  }
}

TEST_CASE("load_hf_moe names the tensor it refuses", "[checkpoint][hf][errors]") {
  const HfBlock block = load_block("qwen2_moe");
  torchmoe::MoELayerOptions options = torchmoe::checkpoint::hf_moe_layer_options(block.config);
  MoELayer layer(options);
  const auto before = layer->router->weight.clone();
  const auto refused = [&](TensorMap params, const std::string& message) {
    CHECK_THROWS_WITH(torchmoe::checkpoint::load_hf_moe(layer, block.arch, params, "mlp."),
                      Contains(message));
    CHECK(torch::equal(layer->router->weight, before));  // nothing copied
  };
  TensorMap prefixed;
  for (const auto& [n, t] : block.params) prefixed["mlp." + n] = t;
  CHECK_NOTHROW(torchmoe::checkpoint::load_hf_moe(layer, block.arch, prefixed, "mlp."));
  // Tensors of different dtypes that load_hf_moe concatenates ([gate; up]): at::cat alone
  // refuses FP8 beside float64.
  TensorMap mixed = prefixed;
  at::Tensor& gate = mixed["mlp.shared_expert.gate_proj.weight"];
  gate = gate.to(torch::kFloat8_e4m3fn);
  CHECK_NOTHROW(torchmoe::checkpoint::load_hf_moe(layer, block.arch, mixed, "mlp."));
  CHECK(torch::equal(layer->shared_expert->fc1->expert_weights()[0].narrow(0, 0, gate.size(0)),
                     gate.to(layer->shared_expert->fc1->expert_weights()[0].scalar_type())));
  layer->router->weight.detach().copy_(before);

  TensorMap missing = prefixed;
  missing.erase("mlp.shared_expert.up_proj.weight");
  refused(missing,
          "load_hf_moe: the qwen2_moe block's tensor 'mlp.shared_expert.up_proj.weight' "
          "is missing");
  TensorMap shape = prefixed;
  shape["mlp.experts.down_proj"] = torch::zeros({8, 64, 31}, torch::kFloat64);
  refused(shape, "'mlp.experts.down_proj' must have shape [8, 64, 32], got [8, 64, 31]");
  TensorMap dtype = prefixed;
  dtype["mlp.gate.weight"] = torch::zeros({8, 64}, torch::kInt32);
  refused(dtype, "'mlp.gate.weight' must have a floating dtype, got Int");
  TensorMap sparse = prefixed;  // refused before the router's weight, taken first, is written
  sparse["mlp.experts.down_proj"] = torch::zeros({8, 64, 32}, torch::kFloat64).to_sparse();
  refused(sparse, "'mlp.experts.down_proj' must be a strided tensor with data, got layout Sparse");
  TensorMap unknown = prefixed;
  unknown["mlp.experts.gate_up_proj_bias"] = torch::zeros({8, 64});
  refused(unknown,
          "'mlp.experts.gate_up_proj_bias' is not a tensor of the qwen2_moe block under "
          "'mlp.'");
  // A layer built without the block's shared expert.
  torchmoe::MoELayerOptions plain = options;
  plain.shared_expert(std::nullopt);
  MoELayer without(plain);
  CHECK_THROWS_WITH(torchmoe::checkpoint::load_hf_moe(without, block.arch, prefixed, "mlp."),
                    Contains("the qwen2_moe block has a shared expert; build the layer with "
                             "shared_expert()"));
  // The other way: Qwen3-MoE's block has no shared expert to load into this layer's.
  CHECK_THROWS_WITH(
      torchmoe::checkpoint::load_hf_moe(layer, torchmoe::checkpoint::HfMoeArch::kQwen3Moe, prefixed,
                                        "mlp."),
      Contains("load_hf_moe: the layer has a shared expert, which the qwen3_moe block does not: "
               "build it without shared_expert()"));
}

TEST_CASE("hf_moe_layer_options reads each block's config and refuses bad ones",
          "[checkpoint][hf][errors]") {
  const auto deepseek =
      torchmoe::checkpoint::hf_moe_layer_options(load_block("deepseek_v3").config);
  CHECK(deepseek.router().num_groups() == 4);
  CHECK(deepseek.router().topk_groups() == 2);
  CHECK(deepseek.router().routed_scaling_factor() == 2.5);
  CHECK(deepseek.router().score_function() == torchmoe::RouterScore::kSigmoid);
  CHECK(deepseek.shared_expert()->ffn_hidden() == 32);
  const auto mixtral = torchmoe::checkpoint::hf_moe_layer_options(load_block("mixtral").config);
  CHECK(mixtral.router().aux_loss_coeff() == Approx(2 * 0.001));  // k · router_aux_loss_coef
  using torchmoe::checkpoint::hf_moe_layer_options;
  CHECK_THROWS_WITH(hf_moe_layer_options("{"), Contains("hf_moe_layer_options: the config is not "
                                                        "JSON"));
  CHECK_THROWS_WITH(hf_moe_layer_options(R"({"model_type": "bert"})"),
                    Contains("model_type must be one of mixtral, olmoe, qwen2_moe, qwen3_moe, "
                             "deepseek_v3, gpt_oss, llama4_text, got 'bert'"));
  CHECK_THROWS_WITH(hf_moe_layer_options(R"({"model_type": "mixtral"})"),
                    Contains("hf_moe_layer_options: the config has no 'hidden_size'"));
  CHECK_THROWS_WITH(hf_moe_layer_options(R"({"model_type": "mixtral", "hidden_size": "64"})"),
                    Contains("'hidden_size' must be an integer that fits int64, got \"64\""));
  const std::string mixtral_head = R"({"model_type": "mixtral", "hidden_size": )";
  CHECK_THROWS_WITH(hf_moe_layer_options(mixtral_head + "18446744073709551615}"),
                    Contains("'hidden_size' must be an integer that fits int64, got "
                             "18446744073709551615"));
  // A number JSON allows but a double cannot hold.
  CHECK_THROWS_WITH(hf_moe_layer_options(mixtral_head + "1e400}"),
                    Contains("hf_moe_layer_options: the config is not JSON") && Contains("1e400"));
  // ~65,000 levels overflowed the stack where a message printed the value.
  CHECK_THROWS_WITH(hf_moe_layer_options(mixtral_head + std::string(100000, '[') +
                                         std::string(100000, ']') + "}"),
                    Contains("the config nests arrays and objects deeper than 128 levels"));
  // What follows a NUL byte would be ignored.
  CHECK_THROWS_WITH(
      hf_moe_layer_options(R"({"model_type": "mixtral"})" + std::string(1, '\0') + "{"),
      Contains("the config holds a NUL byte at offset 25 of 27"));
  const std::string sizes =
      R"("hidden_size": 64, "moe_intermediate_size": 32, "num_experts_per_tok": 2, )";
  CHECK_THROWS_WITH(hf_moe_layer_options(R"({"model_type": "qwen2_moe", "num_experts": 8, )" +
                                         sizes + R"("shared_expert_intermediate_size": -5})"),
                    Contains("'shared_expert_intermediate_size' must be >= 0, got -5"));
  const std::string deepseek_head =
      R"({"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 1, "topk_group": 1, )" +
      sizes + R"("n_shared_experts": 1)";
  // transformers' default scale, and the routing DeepSeek's own configs name.
  CHECK(hf_moe_layer_options(deepseek_head + "}").router().routed_scaling_factor() == 2.5);
  CHECK(hf_moe_layer_options(deepseek_head + R"(, "scoring_func": "sigmoid"})")
            .router()
            .score_function() == torchmoe::RouterScore::kSigmoid);
  CHECK_THROWS_WITH(hf_moe_layer_options(deepseek_head + R"(, "scoring_func": "softmax"})"),
                    Contains("'scoring_func' must be \"sigmoid\" (DeepSeek-V3's routing), got "
                             "\"softmax\""));
  CHECK_THROWS_WITH(hf_moe_layer_options(deepseek_head + R"(, "topk_method": "greedy"})"),
                    Contains("'topk_method' must be \"noaux_tc\""));
  CHECK_THROWS_WITH(
      hf_moe_layer_options(R"({"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 1, )"
                           R"("topk_group": 1, )" +
                           sizes + R"("n_shared_experts": 576460752303423489})"),
      Contains(
          "moe_intermediate_size (32) x n_shared_experts (576460752303423489) must fit int64"));
}
