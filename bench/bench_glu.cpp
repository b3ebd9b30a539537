// ScaledSwiGLU forward and backward bandwidth on the fc1 outputs of the benchmark MoE shapes
// (M = tokens·topk rows, width 2·ffn, bf16, fp32 probabilities), next to the device-to-device copy
// bandwidth and the same math composed from ATen ops (autograd for its backward), in one process;
// the five measurements take turns (bench_common.h). Then the peak memory of one run of each
// (GiB columns; JSON <measurement>_peak_gib), the caching allocator's peak above what was
// allocated before it (bench_common.h's peak_gib).
//
//   bench_glu [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//
// Bytes counted (each tensor read or written once): forward reads x [M,2F] and s [M], writes
// y [M,F]; backward reads x, dy [M,F], s, writes dx [M,2F], ds [M].

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
#include <vector>

namespace {

torch::Tensor composed(const torch::Tensor& x, const torch::Tensor& s) {
  const auto halves = x.chunk(2, -1);
  return torch::silu(halves[0]) * halves[1] * s.unsqueeze(-1).to(x.scalar_type());
}

}  // namespace

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_glu", {"bench_glu.json", 20});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name
            << ", bf16 data, fp32 scales (GB/s; copy = device-to-device copy of x; peak GiB of "
               "one run of each)\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(9) << "copy"
            << std::setw(10) << "fwd" << std::setw(8) << "%copy" << std::setw(10) << "aten fwd"
            << std::setw(10) << "bwd" << std::setw(8) << "%copy" << std::setw(10) << "aten bwd"
            << std::setw(10) << "copy GiB" << std::setw(9) << "fwd GiB" << std::setw(9) << "afw GiB"
            << std::setw(9) << "bwd GiB" << std::setw(9) << "abw GiB"
            << "\n";
  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
       << "\",\n  \"unit\": \"GB/s\",\n  \"results\": [\n";
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const std::vector<torchmoe::bench::Shape> shapes = torchmoe::bench::selected_shapes(args);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const torchmoe::bench::Shape& shape = shapes[i];
    const int64_t m = shape.tokens * shape.topk, f = shape.ffn;
    const torch::Tensor x = torch::randn({m, 2 * f}, bf16);
    const torch::Tensor s = torch::rand({m}, bf16.dtype(torch::kFloat32));
    const torch::Tensor dy = torch::randn({m, f}, bf16);
    torch::Tensor copy_dst = torch::empty_like(x);
    const double elem = 2.0;  // bf16 bytes
    const double fwd_bytes = elem * (2 * m * f + m * f) + 4.0 * m;
    const double bwd_bytes = elem * (2 * m * f + m * f + 2 * m * f) + 4.0 * 2 * m;
    torch::NoGradGuard no_grad;
    const torch::Tensor xr = x.detach().requires_grad_(true), sr = s.detach().requires_grad_(true);
    torch::Tensor y, yc;
    {
      torch::AutoGradMode enable(true);
      y = torchmoe::functional::scaled_swiglu(xr, sr);
      yc = composed(xr, sr);
    }
    const std::vector<std::function<void()>> fns = {
        [&] { copy_dst.copy_(x); }, [&] { torchmoe::functional::scaled_swiglu(x, s); },
        [&] { composed(x, s); },
        [&] {
          torch::autograd::grad({y}, {xr, sr}, {dy}, /*retain_graph=*/true);
        },
        [&] {
          torch::autograd::grad({yc}, {xr, sr}, {dy}, /*retain_graph=*/true);
        }};
    const std::vector<double> ms = torchmoe::bench::median_ms_each(fns, args.iters, args.warmup);
    std::vector<double> gib;  // copy, fwd, aten fwd, bwd, aten bwd
    for (const std::function<void()>& fn : fns) gib.push_back(torchmoe::bench::peak_gib(fn));
    const double copy_gbs = 2.0 * elem * x.numel() / ms[0] * 1e-6;
    const double fwd_ms = ms[1], aten_fwd_ms = ms[2], bwd_ms = ms[3], aten_bwd_ms = ms[4];
    const double fwd = fwd_bytes / fwd_ms * 1e-6, bwd = bwd_bytes / bwd_ms * 1e-6;
    const double aten_fwd = fwd_bytes / aten_fwd_ms * 1e-6,
                 aten_bwd = bwd_bytes / aten_bwd_ms * 1e-6;
    std::cout << std::left << std::setw(17) << shape.name << std::right << std::fixed
              << std::setprecision(0) << std::setw(9) << copy_gbs << std::setw(10) << fwd
              << std::setw(7) << 100 * fwd / copy_gbs << "%" << std::setw(10) << aten_fwd
              << std::setw(10) << bwd << std::setw(7) << 100 * bwd / copy_gbs << "%"
              << std::setw(10) << aten_bwd << std::setprecision(3) << std::setw(10) << gib[0]
              << std::setw(9) << gib[1] << std::setw(9) << gib[2] << std::setw(9) << gib[3]
              << std::setw(9) << gib[4] << "\n";
    json << "    {\"shape\": \"" << shape.name << "\", \"rows\": " << m << ", \"width\": " << 2 * f
         << ", \"copy\": " << copy_gbs << ", \"forward\": " << fwd
         << ", \"aten_forward\": " << aten_fwd << ", \"backward\": " << bwd
         << ", \"aten_backward\": " << aten_bwd << ", \"copy_peak_gib\": " << gib[0]
         << ", \"forward_peak_gib\": " << gib[1] << ", \"aten_forward_peak_gib\": " << gib[2]
         << ", \"backward_peak_gib\": " << gib[3] << ", \"aten_backward_peak_gib\": " << gib[4]
         << "}" << (i + 1 < shapes.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
