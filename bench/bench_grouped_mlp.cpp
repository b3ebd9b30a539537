// GroupedMLP forward+backward time per step on the benchmark MoE shapes (bf16, uniform splits),
// next to the sum of its parts timed alone in the same process: fc1 (GroupedLinear fwd+bwd),
// ScaledSwiGLU (fwd+bwd), fc2 (GroupedLinear fwd+bwd); and the same step with both layers' GEMMs in
// FP8 (fp8::DelayedScaling, amax history 16, the weights quantized every step, the
// delayed-scaling update after the step as a training loop runs it), and under fp8::CurrentScaling
// with TE's accumulation (split in dgrad and wgrad) and with fast accumulation in all three
// products. The seven take turns (bench_common.h's median_ms_each), so that they compare under the
// same clocks. Then the peak memory of one run of each of the seven (GiB columns, in the same
// order; JSON <measurement>_peak_gib): the caching allocator's peak above what was allocated before
// it (bench_common.h's peak_gib).
//
//   bench_grouped_mlp [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//
// TORCHMOE_BENCH_TRACE=PREFIX also records a Kineto trace of 5 FP8 steps per shape
// (PREFIX.<shape>.fp8.json; bench_common.h).

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <string>
#include <variant>
#include <vector>

namespace fp8 = torchmoe::fp8;
using torchmoe::bench::median_ms_each;
using torchmoe::bench::Shape;

constexpr int64_t kHistory = 16;

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_grouped_mlp", {"bench_grouped_mlp.json", 10});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name
            << ", bf16, uniform splits, forward+backward per step (ms), then the peak GiB of each "
               "step\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(10) << "mlp"
            << std::setw(10) << "fc1" << std::setw(10) << "act" << std::setw(10) << "fc2"
            << std::setw(10) << "parts" << std::setw(11) << "TFLOP/s" << std::setw(10) << "fp8"
            << std::setw(10) << "bf16/fp8" << std::setw(10) << "current" << std::setw(10)
            << "bf16/cur" << std::setw(10) << "cur fast" << std::setw(11) << "bf16/fast"
            << std::setw(9) << "mlp GiB" << std::setw(9) << "fc1 GiB" << std::setw(9) << "act GiB"
            << std::setw(9) << "fc2 GiB" << std::setw(9) << "fp8 GiB" << std::setw(9) << "cur GiB"
            << std::setw(9) << "fast GiB"
            << "\n";
  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
       << "\",\n  \"unit\": \"ms\",\n  \"results\": [";
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  bool first = true;
  for (const Shape& shape : torchmoe::bench::selected_shapes(args)) {
    const int64_t m = shape.tokens * shape.topk, h = shape.hidden, f = shape.ffn;
    torchmoe::GroupedMLPOptions options(shape.experts, h, f);
    options.params_dtype(torch::kBFloat16).device(torch::kCUDA).linear().bias(false);
    options.linear().fp8_amax_history_len(kHistory);  // the FP8 step's state; bf16 ignores it
    torchmoe::GroupedMLP mlp(options);
    const std::vector<int64_t> splits(shape.experts, m / shape.experts);
    const torch::Tensor x = torch::randn({m, h}, bf16).requires_grad_(true);
    const torch::Tensor probs = torch::rand({m}, bf16.dtype(torch::kFloat32)).requires_grad_(true);
    const torch::Tensor dy = torch::randn({m, h}, bf16);
    const torch::Tensor z = torch::randn({m, 2 * f}, bf16).requires_grad_(true);
    const torch::Tensor dz = torch::randn({m, 2 * f}, bf16);
    const torch::Tensor a = torch::randn({m, f}, bf16).requires_grad_(true);
    const torch::Tensor da = torch::randn({m, f}, bf16);
    auto step = [&](const std::function<torch::Tensor()>& forward, const torch::Tensor& grad) {
      return [&, forward, grad] {
        mlp->zero_grad();  // set_to_none: no gradient accumulation inside the timed step
        for (const torch::Tensor* leaf : {&x, &probs, &z, &a}) leaf->mutable_grad().reset();
        forward().backward(grad);
      };
    };
    const fp8::DelayedScaling delayed = fp8::DelayedScaling().amax_history_len(kHistory);
    // An FP8 training step under `recipe`, with delayed scaling's update after it.
    auto fp8_step = [&](const fp8::Recipe& recipe) -> std::function<void()> {
      return [&, recipe] {
        mlp->zero_grad();
        for (const torch::Tensor* leaf : {&x, &probs}) leaf->mutable_grad().reset();
        torch::Tensor y;
        {
          const fp8::Autocast guard{recipe};
          y = mlp(x, splits, probs);
        }
        y.backward(dy);
        if (const auto* d = std::get_if<fp8::DelayedScaling>(&recipe)) {
          fp8::update_delayed_scaling(*mlp, *d, fp8::Pass::kForward);
          fp8::update_delayed_scaling(*mlp, *d, fp8::Pass::kBackward);
        }
      };
    };
    const std::function<void()> delayed_step = fp8_step(fp8::Recipe(delayed));
    const fp8::CurrentScaling fast =
        fp8::CurrentScaling().dgrad_split_accumulator(false).wgrad_split_accumulator(false);
    // Taking turns (bench_common.h): the step and its parts under the same clocks.
    const std::vector<std::function<void()>> fns = {
        step([&] { return mlp(x, splits, probs); }, dy),
        step([&] { return mlp->fc1(x, splits); }, dz),
        step([&] { return torchmoe::functional::scaled_swiglu(z, probs); }, da),
        step([&] { return mlp->fc2(a, splits); }, dy),
        delayed_step,
        fp8_step(fp8::CurrentScaling()),
        fp8_step(fast)};
    const std::vector<double> ms = median_ms_each(fns, args.iters, args.warmup);
    std::vector<double> gib;  // per step, in the order of `fns`
    for (const std::function<void()>& fn : fns) gib.push_back(torchmoe::bench::peak_gib(fn));
    const double mlp_ms = ms[0], fc1_ms = ms[1], act_ms = ms[2], fc2_ms = ms[3], fp8_ms = ms[4];
    const double current_ms = ms[5], fast_ms = ms[6];
    torchmoe::bench::trace_if_asked(shape.name + ".fp8", delayed_step);
    const double tflops = 3 * 2.0 * m * (2 * f * h + f * h) / mlp_ms * 1e-9;
    std::cout << std::left << std::setw(17) << shape.name << std::right << std::fixed
              << std::setprecision(2) << std::setw(10) << mlp_ms << std::setw(10) << fc1_ms
              << std::setw(10) << act_ms << std::setw(10) << fc2_ms << std::setw(10)
              << fc1_ms + act_ms + fc2_ms << std::setprecision(0) << std::setw(11) << tflops
              << std::setprecision(2) << std::setw(10) << fp8_ms << std::setw(10) << mlp_ms / fp8_ms
              << std::setw(10) << current_ms << std::setw(10) << mlp_ms / current_ms
              << std::setw(10) << fast_ms << std::setw(11) << mlp_ms / fast_ms;
    for (double g : gib) std::cout << std::setw(9) << g;
    std::cout << "\n";
    json << (first ? "\n" : ",\n") << "    {\"shape\": \"" << shape.name
         << "\", \"mlp\": " << mlp_ms << ", \"fc1\": " << fc1_ms << ", \"act\": " << act_ms
         << ", \"fc2\": " << fc2_ms << ", \"tflops\": " << tflops
         << ", \"mlp_fp8_delayed\": " << fp8_ms << ", \"mlp_fp8_current\": " << current_ms
         << ", \"mlp_fp8_current_fast_accumulation\": " << fast_ms
         << ", \"mlp_peak_gib\": " << gib[0] << ", \"fc1_peak_gib\": " << gib[1]
         << ", \"act_peak_gib\": " << gib[2] << ", \"fc2_peak_gib\": " << gib[3]
         << ", \"mlp_fp8_delayed_peak_gib\": " << gib[4]
         << ", \"mlp_fp8_current_peak_gib\": " << gib[5]
         << ", \"mlp_fp8_current_fast_accumulation_peak_gib\": " << gib[6] << "}";
    first = false;
  }
  json << "\n  ]\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
