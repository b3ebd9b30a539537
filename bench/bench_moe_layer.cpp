// MoELayer forward+backward on the benchmark MoE shapes (bf16, tokens x hidden input), split into
// its parts, in one process:
//   router     TopKRouter forward (fp32 logits, softmax, top-k, aux loss)
//   permute    permute_tokens: routing map (CUB sort) + split-size copy to the host + row copies;
//              also its two parts alone: map (ops::make_routing_map) and rows (ops::permute_rows)
//   unpermute  unpermute_tokens forward (sum over each token's k rows)
//   mlp        GroupedMLP forward+backward on the permuted rows (3 grouped GEMMs each way + GLU)
//   layer      the whole MoELayer forward+backward (default options: the permuted copy)
//   fused      the same with fuse_permutation(true): fc1 reads the tokens through the row map
//   fp8        the layer with its experts in FP8 (delayed scaling), and fp8 fus the same fused:
//              fc1's input quantize gathers the tokens
// mlp, layer, fused and the two fp8 layers take turns (bench_common.h's median_ms_each), so that
// their ratios compare them under the same clocks.
// permute/unpermute are reported in GB/s (T token rows + M = T·k permuted rows, each read or
// written once) next to the device-to-device copy bandwidth of an [M, hidden] tensor; mlp and
// layer in TFLOP/s of the expert GEMMs (6·M·hidden·3·ffn).
// Then the peak memory of one run of each of the eleven measurements, in the same order (GiB
// columns; JSON <measurement>_peak_gib): the caching allocator's peak above what was allocated
// before it (bench_common.h's peak_gib; the layer steps accumulate their gradients, made by the
// warm-up, so the peak is the saved activations and the step's temporaries, weight gradients
// before their accumulation among them). For the four layer steps (bf16, fused, fp8, fp8 fus) also
// that peak per token of the step (KiB columns; JSON <layer measurement>_peak_bytes_per_token, in
// bytes): the layer's peak activation memory per token in bf16 and in FP8 with delayed scaling;
// then, measured only, the default layer's step under current scaling and under block scaling
// (columns f8c and f8b; JSON layer_fp8_current_/layer_fp8_block_peak_bytes_per_token).
// The captured replays are timed only: they allocate nothing (their memory is the graphs' pools).
//
//   bench_moe_layer [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//
// TORCHMOE_BENCH_GRAPH=1 also times the GroupedMLP alone and the layer captured in CUDA graphs
// and replayed, taking turns (both on device split sizes, the sm90 kernel): the host's time out of
// the step, as a C++ loop captures it (examples/moe_lm --cuda-graph). The whole run then goes on a
// side stream.
//
// TORCHMOE_BENCH_TRACE=PREFIX also records Kineto traces (CPU and CUDA) of 5 layer steps per
// shape into PREFIX.<shape>.json, of 5 steps of its GroupedMLP alone into PREFIX.<shape>.mlp.json,
// and of the fused and FP8 layers into PREFIX.<shape>.{fused,fp8,fp8_fused}.json, for
// scripts/trace_summary.py.

#include <ATen/cuda/CUDAContext.h>
#include <torchmoe/ops/token_permutation.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_moe_layer", {"bench_moe_layer.json", 10});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  using torchmoe::bench::median_ms;
  using torchmoe::bench::median_ms_each;
  const bool graphs = std::getenv("TORCHMOE_BENCH_GRAPH") != nullptr;
  // Captured steps need the whole run on a side stream (bench_common.h's CapturedStep).
  std::optional<c10::cuda::CUDAStreamGuard> side_stream;
  if (graphs) side_stream.emplace(c10::cuda::getStreamFromPool());
  std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name
            << ", bf16, times in ms (GB/s, TFLOP/s), then the peak GiB of one run of each, then "
               "the layer steps' peak in KiB per token\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(8) << "router"
            << std::setw(8) << "permute" << std::setw(7) << "GB/s" << std::setw(7) << "map"
            << std::setw(7) << "rows" << std::setw(7) << "GB/s" << std::setw(8) << "unperm"
            << std::setw(7) << "GB/s" << std::setw(7) << "copy" << std::setw(8) << "mlp"
            << std::setw(7) << "TF/s" << std::setw(8) << "layer" << std::setw(7) << "TF/s"
            << std::setw(8) << "fused" << std::setw(8) << "fp8" << std::setw(8) << "fp8 fus";
  // The peaks' columns, in the order above: router, permute, map, rows, unperm, copy, mlp, layer,
  // fused, fp8, fp8 fus; then the layer steps' per token.
  for (const char* name :
       {"rtr", "prm", "map", "row", "unp", "cpy", "mlp", "lyr", "fus", "f8", "f8f"})
    std::cout << std::setw(8) << std::string(name) + " GiB";
  for (const char* name : {"lyr", "fus", "f8", "f8f", "f8c", "f8b"})
    std::cout << std::setw(9) << std::string(name) + " KiB";
  std::cout << "\n";
  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
       << "\",\n  \"results\": [\n";
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const std::vector<torchmoe::bench::Shape> shapes = torchmoe::bench::selected_shapes(args);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const torchmoe::bench::Shape& s = shapes[i];
    torch::manual_seed(0);
    torchmoe::MoELayerOptions options(s.hidden, s.ffn, s.experts, s.topk);
    options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
    options.router().aux_loss_coeff(1e-2);
    options.experts().linear().single_grouped_weight(true);
    constexpr int64_t kHistory = 16;  // the FP8 layers' state; bf16 ignores it
    options.experts().linear().fp8_amax_history_len(kHistory);
    torchmoe::MoELayer moe(torchmoe::MoELayerOptions(options).fuse_permutation(false));
    torch::manual_seed(0);  // the same weights
    torchmoe::MoELayer moe_fused(torchmoe::MoELayerOptions(options).fuse_permutation(true));
    const torch::Tensor x = torch::randn({s.tokens, s.hidden}, bf16).requires_grad_(true);
    const int64_t m = s.tokens * s.topk;
    // permute reads T token rows and writes M = T·k rows; unpermute the reverse (bf16).
    const double row_bytes = 2.0 * (m + s.tokens) * s.hidden;
    const double flops = 6.0 * m * s.hidden * 3 * s.ffn;

    torch::Tensor copy_src = torch::empty({m, s.hidden}, bf16),
                  copy_dst = torch::empty_like(copy_src);
    // Each measurement's time, then the peak memory of one more run (bench_common.h).
    struct Measured {
      double ms, gib;
    };
    auto measure = [&](const std::function<void()>& fn) {
      const double ms = median_ms(fn, args.iters, args.warmup);
      return Measured{ms, torchmoe::bench::peak_gib(fn)};
    };
    const Measured copy = measure([&] { copy_dst.copy_(copy_src); });

    torchmoe::RouterOutput routing;
    const Measured router = measure([&] { routing = moe->router(x); });
    torchmoe::PermutedTokens routed;
    const Measured permute = measure([&] {
      routed = torchmoe::functional::permute_tokens(x, routing.indices, s.experts, routing.probs);
    });
    torchmoe::ops::RoutingMap map;
    const Measured map_made =
        measure([&] { map = torchmoe::ops::make_routing_map(routing.indices, s.experts); });
    const Measured rows_permuted = measure([&] {
      torchmoe::ops::permute_rows(x.detach(), map.row_map, map.sorted_slots, torch::Tensor());
    });
    const torch::Tensor rows = routed.tokens.detach().requires_grad_(true);
    const torch::Tensor probs = routed.probs.detach().requires_grad_(true);
    const torch::Tensor dy = torch::randn({m, s.hidden}, bf16);
    const Measured unpermute = measure([&] {
      torch::NoGradGuard no_grad;
      torchmoe::functional::unpermute_tokens(routed.tokens, routed);
    });
    const double copy_ms = copy.ms, router_ms = router.ms, permute_ms = permute.ms,
                 map_ms = map_made.ms, rows_ms = rows_permuted.ms, unpermute_ms = unpermute.ms;
    // Both output gradients made once, as the MLP's dy: a step times the layer, not the seeds.
    const torch::Tensor dout = torch::randn({s.tokens, s.hidden}, bf16);
    const torch::Tensor daux = torch::ones({}, bf16.dtype(torch::kFloat32));
    auto layer_step = [&](torchmoe::MoELayer& layer) {
      const torchmoe::MoEOutput out = layer(x);
      torch::autograd::backward({out.output, out.aux_loss}, {dout, daux});
    };
    // The experts in FP8 (delayed scaling, its scales left at their initial values: the speed is
    // the same), with the permuted copy quantized, and with fc1's input quantize gathering the
    // tokens (no permuted copy).
    const torchmoe::fp8::Recipe delayed =
        torchmoe::fp8::DelayedScaling().amax_history_len(kHistory);
    auto fp8_step = [&](torchmoe::MoELayer& layer, const torchmoe::fp8::Recipe& recipe) {
      const torchmoe::fp8::Autocast fp8(recipe);
      layer_step(layer);
    };
    // The GroupedMLP alone and the layers take turns (bench_common.h), so that their ratios are
    // taken under the same clocks.
    const std::vector<std::function<void()>> steps = {
        [&] { moe->experts(rows, routed.m_splits, probs).backward(dy); }, [&] { layer_step(moe); },
        [&] { layer_step(moe_fused); }, [&] { fp8_step(moe, delayed); },
        [&] { fp8_step(moe_fused, delayed); }};
    const std::vector<double> steps_ms = median_ms_each(steps, args.iters, args.warmup);
    const double mlp_ms = steps_ms[0], layer_ms = steps_ms[1], fused_ms = steps_ms[2],
                 fp8_ms = steps_ms[3], fp8_fused_ms = steps_ms[4];
    // Peak memory: the ops above, then the steps in their turns' order.
    std::vector<double> gib = {router.gib,        permute.gib,   map_made.gib,
                               rows_permuted.gib, unpermute.gib, copy.gib};
    for (const std::function<void()>& step : steps) gib.push_back(torchmoe::bench::peak_gib(step));
    // The four layer steps' peak per token, in bytes, then the other recipes' (after a warm-up
    // step each: their first step allocates what later steps reuse).
    std::vector<int64_t> bytes_per_token;
    auto per_token = [&](double step_gib) {
      bytes_per_token.push_back(std::llround(step_gib * (int64_t{1} << 30) / s.tokens));
    };
    for (size_t g = gib.size() - 4; g < gib.size(); ++g) per_token(gib[g]);
    for (const torchmoe::fp8::Recipe& other :
         {torchmoe::fp8::Recipe(torchmoe::fp8::CurrentScaling()),
          torchmoe::fp8::Recipe(torchmoe::fp8::BlockScaling())}) {
      fp8_step(moe, other);
      per_token(torchmoe::bench::peak_gib([&] { fp8_step(moe, other); }));
    }
    double mlp_graph_ms = 0.0, layer_graph_ms = 0.0;
    if (graphs) {
      // The MLP on the device sizes alone, as the layer runs it (host sizes may choose per-group
      // matmuls, which a graph cannot hold).
      const torchmoe::SplitSizes device_splits(routed.m_splits.device());
      torchmoe::bench::CapturedStep mlp_graph(
          [&] { moe->experts(rows, device_splits, probs).backward(dy); });
      torchmoe::bench::CapturedStep layer_graph([&] { layer_step(moe); });
      const std::vector<double> graph_ms = median_ms_each(
          {[&] { mlp_graph.replay(); }, [&] { layer_graph.replay(); }}, args.iters, args.warmup);
      mlp_graph_ms = graph_ms[0];
      layer_graph_ms = graph_ms[1];
      std::cout << "  " << s.name << " captured: mlp " << std::fixed << std::setprecision(3)
                << mlp_graph_ms << " ms, layer " << layer_graph_ms << " ms, mlp/layer "
                << mlp_graph_ms / layer_graph_ms << " (eager " << mlp_ms / layer_ms << ")\n";
    }
    torchmoe::bench::trace_if_asked(s.name, [&] { layer_step(moe); });
    torchmoe::bench::trace_if_asked(
        s.name + ".mlp", [&] { moe->experts(rows, routed.m_splits, probs).backward(dy); });
    torchmoe::bench::trace_if_asked(s.name + ".fused", [&] { layer_step(moe_fused); });
    torchmoe::bench::trace_if_asked(s.name + ".fp8", [&] { fp8_step(moe, delayed); });
    torchmoe::bench::trace_if_asked(s.name + ".fp8_fused", [&] { fp8_step(moe_fused, delayed); });

    const double copy_gbs = 2.0 * 2 * m * s.hidden / copy_ms * 1e-6;
    const double permute_gbs = row_bytes / permute_ms * 1e-6;
    const double unpermute_gbs = row_bytes / unpermute_ms * 1e-6;
    std::cout << std::left << std::setw(17) << s.name << std::right << std::fixed
              << std::setprecision(2) << std::setw(8) << router_ms << std::setw(8) << permute_ms
              << std::setprecision(0) << std::setw(7) << permute_gbs << std::setprecision(2)
              << std::setw(7) << map_ms << std::setw(7) << rows_ms << std::setprecision(0)
              << std::setw(7) << row_bytes / rows_ms * 1e-6 << std::setprecision(2) << std::setw(8)
              << unpermute_ms << std::setprecision(0) << std::setw(7) << unpermute_gbs
              << std::setw(7) << copy_gbs << std::setprecision(2) << std::setw(8) << mlp_ms
              << std::setprecision(0) << std::setw(7) << flops / mlp_ms * 1e-9
              << std::setprecision(2) << std::setw(8) << layer_ms << std::setprecision(0)
              << std::setw(7) << flops / layer_ms * 1e-9 << std::setprecision(2) << std::setw(8)
              << fused_ms << std::setw(8) << fp8_ms << std::setw(8) << fp8_fused_ms;
    for (double g : gib) std::cout << std::setw(8) << g;
    std::cout << std::setprecision(1);
    for (int64_t b : bytes_per_token) std::cout << std::setw(9) << b / 1024.0;
    std::cout << "\n";
    json << std::setprecision(4) << "    {\"shape\": \"" << s.name
         << "\", \"router_ms\": " << router_ms << ", \"permute_ms\": " << permute_ms
         << ", \"permute_gbs\": " << permute_gbs << ", \"map_ms\": " << map_ms
         << ", \"rows_ms\": " << rows_ms << ", \"unpermute_ms\": " << unpermute_ms
         << ", \"unpermute_gbs\": " << unpermute_gbs << ", \"copy_gbs\": " << copy_gbs
         << ", \"mlp_ms\": " << mlp_ms << ", \"mlp_tflops\": " << flops / mlp_ms * 1e-9
         << ", \"layer_ms\": " << layer_ms << ", \"layer_tflops\": " << flops / layer_ms * 1e-9
         << ", \"layer_fused_ms\": " << fused_ms << ", \"layer_fp8_ms\": " << fp8_ms
         << ", \"layer_fp8_fused_ms\": " << fp8_fused_ms;
    const char* const names[] = {"router",         "permute", "map",   "rows",        "unpermute",
                                 "copy",           "mlp",     "layer", "layer_fused", "layer_fp8",
                                 "layer_fp8_fused"};
    for (size_t g = 0; g < gib.size(); ++g) json << ", \"" << names[g] << "_peak_gib\": " << gib[g];
    json << ", \"tokens\": " << s.tokens;
    const char* const per_token_names[] = {
        "layer",           "layer_fused",       "layer_fp8",
        "layer_fp8_fused", "layer_fp8_current", "layer_fp8_block"};
    for (size_t l = 0; l < bytes_per_token.size(); ++l) {
      json << ", \"" << per_token_names[l] << "_peak_bytes_per_token\": " << bytes_per_token[l];
    }
    if (layer_graph_ms > 0) {
      json << ", \"mlp_graph_ms\": " << mlp_graph_ms << ", \"layer_graph_ms\": " << layer_graph_ms;
    }
    json << "}" << (i + 1 < shapes.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
