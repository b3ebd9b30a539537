// Today's MoE architectures on their own shapes (docs/moe.md's table): MoELayer forward+backward
// with each architecture's options, in bf16 and FP8 (delayed scaling), 8192 tokens, against
//   plain    the same shape with a plain softmax top-k router and no shared expert
//   router   the plain layer with the architecture's router options alone (groups, routed scale,
//            logit bias, sigmoid): their cost over plain top-k, router / plain
//   shared   the shared expert's six GEMMs (fc1, fc2 forward; dgrad and wgrad of each) as dense
//            at::mm calls on [T, hidden]: the target for the layer with a shared expert is
//            full <= 1.05 x (router + shared)
// All four take turns (bench_common.h's median_ms_each). Also the peak memory of one run of each
// of the four (bench_common.h's peak_gib: the caching allocator's peak above what was allocated
// before it): full's in the GiB column and peak_step_gib, then plain's, router's and shared's
// (JSON: plain_peak_gib, router_peak_gib, shared_gemms_peak_gib). An architecture and mode that
// does not fit in the GPU's memory (deepseek-v3 on an 80 GB card) prints a skipped line instead,
// and its JSON entry says "skipped".
//
//   bench_moe_arch [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//
// Shapes (--shapes takes these names): deepseek-v3 (256 experts top-8 in 8 groups keeping 4,
// hidden 7168, ffn 2048, a shared expert of 2048), deepseek-v3-ep8 (the 32 experts of one rank of
// eight: groups of 4), gpt-oss-20b (32 experts top-4, hidden 2880, ffn 2880, biases, clamped
// SwiGLU with alternating columns), llama-4-scout (16 experts top-1, hidden 5120, ffn 8192,
// input-scaled, a shared expert of 8192), qwen2-57b-a14b (64 experts top-8, hidden 3584, ffn 2560,
// a gated shared expert of 20480).

#include <ATen/cuda/CUDAContext.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Arch {
  std::string name;
  int64_t experts, hidden, ffn, topk;
  // The architecture's router options on top of the plain ones, and the rest of its options.
  std::function<void(torchmoe::TopKRouterOptions&)> router;
  std::function<void(torchmoe::MoELayerOptions&)> rest;
};

const std::vector<Arch>& archs() {
  static const std::vector<Arch> kArchs = {
      {"deepseek-v3", 256, 7168, 2048, 8,
       [](auto& r) {
         r.score_function(torchmoe::RouterScore::kSigmoid).expert_bias(true).num_groups(8);
         r.topk_groups(4).routed_scaling_factor(2.5);
       },
       [](auto& o) { o.shared_expert(torchmoe::SharedExpertOptions(2048)); }},
      {"deepseek-v3-ep8", 32, 7168, 2048, 8,
       [](auto& r) {
         r.score_function(torchmoe::RouterScore::kSigmoid).expert_bias(true).num_groups(8);
         r.topk_groups(4).routed_scaling_factor(2.5);
       },
       [](auto& o) { o.shared_expert(torchmoe::SharedExpertOptions(2048)); }},
      {"gpt-oss-20b", 32, 2880, 2880, 4, [](auto& r) { r.bias(true); },
       [](auto& o) {
         o.experts()
             .activation(torchmoe::GluActivation::kClampedSwiGLU)
             .glu_interleave_size(1)
             .scale_bias(true);
         o.experts().linear().bias(true);
       }},
      {"llama-4-scout", 16, 5120, 8192, 1,
       [](auto& r) { r.score_function(torchmoe::RouterScore::kSigmoid); },
       [](auto& o) {
         o.scale_expert_input(true).shared_expert(torchmoe::SharedExpertOptions(8192));
       }},
      {"qwen2-57b-a14b", 64, 3584, 2560, 8, [](auto&) {},
       [](auto& o) { o.shared_expert(torchmoe::SharedExpertOptions(20480).gate(true)); }},
  };
  return kArchs;
}

// Milliseconds and peak GiB of plain, router, full and the shared expert's GEMMs, in that order.
struct ArchTimes {
  std::vector<double> ms, gib;
};

constexpr int64_t kTokens = 8192, kHistory = 16;

ArchTimes time_arch(const Arch& a, bool fp8, const torchmoe::bench::Args& args) {
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torchmoe::MoELayerOptions plain(a.hidden, a.ffn, a.experts, a.topk);
  plain.params_dtype(torch::kBFloat16).device(torch::kCUDA);
  plain.router().aux_loss_coeff(1e-2);
  plain.experts().linear().single_grouped_weight(true).fp8_amax_history_len(kHistory);
  torchmoe::MoELayerOptions routed = plain;
  a.router(routed.router());
  torchmoe::MoELayerOptions full = routed;
  a.rest(full);
  // The three layers share one set of experts (deepseek-v3's 256 take 22 GiB of bf16
  // weights): each is built and given the first one's experts before the next is built.
  torch::manual_seed(0);
  std::vector<torchmoe::MoELayer> layers = {torchmoe::MoELayer(plain)};
  for (const torchmoe::MoELayerOptions* o : {&routed, &full}) {
    torchmoe::MoELayer layer(*o);
    layer->experts = layer->replace_module("experts", layers[0]->experts);
    layers.push_back(layer);
  }
  const torch::Tensor x = torch::randn({kTokens, a.hidden}, bf16).requires_grad_(true);
  const torch::Tensor dout = torch::randn({kTokens, a.hidden}, bf16);
  const torch::Tensor daux = torch::ones({}, bf16.dtype(torch::kFloat32));
  const auto recipe = torchmoe::fp8::DelayedScaling().amax_history_len(kHistory);
  auto step = [&](torchmoe::MoELayer& layer) {
    const torchmoe::fp8::Autocast guard =
        fp8 ? torchmoe::fp8::Autocast(recipe) : torchmoe::fp8::Autocast(false);
    const torchmoe::MoEOutput out = layer(x);
    torch::autograd::backward({out.output, out.aux_loss}, {dout, daux});
  };
  // The shared expert's GEMMs as dense bf16 products (the rate cuBLAS sustains on them).
  const int64_t width = full.shared_expert() ? full.shared_expert()->ffn_hidden() : 0;
  torch::Tensor w1, w2, h, g;
  if (width > 0) {
    w1 = torch::randn({2 * width, a.hidden}, bf16) * 0.01;
    w2 = torch::randn({a.hidden, width}, bf16) * 0.01;
    h = torch::randn({kTokens, 2 * width}, bf16);
    g = torch::randn({kTokens, width}, bf16);
  }
  auto shared_gemms = [&] {
    torch::mm(x.detach(), w1.t());  // fc1
    torch::mm(g, w2.t());           // fc2
    torch::mm(dout, w2);            // fc2 dgrad
    torch::mm(dout.t(), g);         // fc2 wgrad
    torch::mm(h, w1);               // fc1 dgrad
    torch::mm(h.t(), x.detach());   // fc1 wgrad
  };
  std::vector<std::function<void()>> fns = {[&] { step(layers[0]); }, [&] { step(layers[1]); },
                                            [&] { step(layers[2]); }};
  if (width > 0) fns.push_back(shared_gemms);
  std::vector<double> ms = torchmoe::bench::median_ms_each(fns, args.iters, args.warmup);
  // Peak memory of one run of each (bench_common.h), in the order they were timed.
  std::vector<double> gib;
  for (const std::function<void()>& fn : fns) gib.push_back(torchmoe::bench::peak_gib(fn));
  // The shared expert's column reads 0 where the architecture has none.
  ms.resize(4, 0.0);
  gib.resize(4, 0.0);
  return {ms, gib};
}

}  // namespace

int main(int argc, char** argv) {
  // --shapes names the architectures here, not bench_common.h's shapes: parsed apart.
  std::vector<std::string> names;
  std::vector<char*> rest = {argv[0]};
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--shapes" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string name; std::getline(list, name, ',');) names.push_back(name);
    } else {
      rest.push_back(argv[i]);
    }
  }
  const torchmoe::bench::Setup setup = torchmoe::bench::setup(
      static_cast<int>(rest.size()), rest.data(), "bench_moe_arch", {"bench_moe_arch.json", 10});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  for (const std::string& name : names) {
    const bool known =
        std::any_of(archs().begin(), archs().end(), [&](const Arch& a) { return a.name == name; });
    if (!known) {
      std::cerr << "error: unknown shape " << name << "\n";
      return 2;
    }
  }
  std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name
            << ", 8192 tokens, fwd+bwd ms; peak GiB of a step: full (GiB), plain, router, shared\n"
            << std::left << std::setw(17) << "shape" << std::setw(6) << "mode" << std::right
            << std::setw(9) << "plain" << std::setw(9) << "router" << std::setw(9) << "full"
            << std::setw(9) << "shared" << std::setw(10) << "rtr/pln" << std::setw(14)
            << "full/(r+sh)" << std::setw(9) << "GiB" << std::setw(9) << "pln GiB" << std::setw(9)
            << "rtr GiB" << std::setw(9) << "sh GiB"
            << "\n";
  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
       << "\",\n  \"tokens\": " << kTokens << ",\n  \"results\": [\n";
  bool first = true;
  for (const Arch& a : archs()) {
    if (!names.empty() && std::find(names.begin(), names.end(), a.name) == names.end()) continue;
    for (const bool fp8 : {false, true}) {
      const char* mode = fp8 ? "fp8" : "bf16";
      ArchTimes t;
      try {
        t = time_arch(a, fp8, args);
      } catch (const c10::OutOfMemoryError&) {
        c10::cuda::CUDACachingAllocator::emptyCache();
        std::cout << std::left << std::setw(17) << a.name << std::setw(6) << mode
                  << " skipped: out of GPU memory\n";
        json << (first ? "" : ",\n") << "    {\"shape\": \"" << a.name
             << "\", \"fp8\": " << (fp8 ? "true" : "false")
             << ", \"skipped\": \"out of GPU memory\"}";
        first = false;
        continue;
      }
      const std::vector<double>& ms = t.ms;
      const std::vector<double>& gib = t.gib;
      const double shared_ms = ms[3], shared_gib = gib[3];
      const double router_ratio = ms[1] / ms[0];
      const double shared_ratio = ms[2] / (ms[1] + shared_ms);
      std::cout << std::left << std::setw(17) << a.name << std::setw(6) << mode << std::right
                << std::fixed << std::setprecision(3) << std::setw(9) << ms[0] << std::setw(9)
                << ms[1] << std::setw(9) << ms[2] << std::setw(9) << shared_ms << std::setw(10)
                << router_ratio << std::setw(14) << shared_ratio << std::setprecision(2)
                << std::setw(9) << gib[2] << std::setw(9) << gib[0] << std::setw(9) << gib[1]
                << std::setw(9) << shared_gib << "\n";
      json << (first ? "" : ",\n") << std::setprecision(4) << "    {\"shape\": \"" << a.name
           << "\", \"fp8\": " << (fp8 ? "true" : "false") << ", \"plain_ms\": " << ms[0]
           << ", \"router_ms\": " << ms[1] << ", \"full_ms\": " << ms[2]
           << ", \"shared_gemms_ms\": " << shared_ms << ", \"router_over_plain\": " << router_ratio
           << ", \"full_over_router_plus_shared\": " << shared_ratio
           << ", \"peak_step_gib\": " << gib[2] << ", \"plain_peak_gib\": " << gib[0]
           << ", \"router_peak_gib\": " << gib[1] << ", \"shared_gemms_peak_gib\": " << shared_gib
           << "}";
      first = false;
    }
  }
  json << "\n  ]\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
