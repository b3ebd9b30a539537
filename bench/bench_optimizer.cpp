// The optimizer step of the example LM's measured config (8 layers, hidden 1024, 32 experts,
// ffn 1024: 840M parameters in the model's own tensor shapes), fp32 masters with bf16 copies:
//   fused:  torchmoe::optim::FusedAdamW, clip_grad_norm + step (which writes the bf16 copies)
//   torch:  torch::nn::utils::clip_grad_norm_ + torch::optim::AdamW + a copy into each bf16 param
// next to a device-to-device copy, in one process, taking turns (bench_common.h). Each line also
// gives the peak memory of one run (JSON fused_peak_gib, torch_peak_gib, copy_peak_gib): the
// caching allocator's peak above what was allocated before it (bench_common.h's peak_gib).
//
//   bench_optimizer [--json PATH] [--iters N] [--warmup N]
//
// Bytes of one pass, per parameter: the norm reads the gradient (4); the step reads master,
// gradient and both moments (16) and writes master, moments (12) and the bf16 copy (2): 34 bytes.

#include <ATen/cuda/CUDAContext.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <vector>

namespace {

// The example LM's parameter shapes at docs/performance.md's config (examples/moe_lm/model.cpp):
// embeddings, per layer two RMSNorm weights, qkv and proj, the router and the experts' stacked
// fc1/fc2 weights, and the final norm.
std::vector<std::vector<int64_t>> example_shapes() {
  const int64_t layers = 8, hidden = 1024, experts = 32, ffn = 1024, vocab = 256, seq = 1024;
  std::vector<std::vector<int64_t>> shapes = {{vocab, hidden}, {seq, hidden}};
  for (int64_t l = 0; l < layers; ++l) {
    for (const std::vector<int64_t>& s :
         std::vector<std::vector<int64_t>>{{hidden},
                                           {3 * hidden, hidden},
                                           {hidden, hidden},
                                           {hidden},
                                           {experts, hidden},
                                           {experts, 2 * ffn, hidden},
                                           {experts, hidden, ffn}}) {
      shapes.push_back(s);
    }
  }
  shapes.push_back({hidden});
  return shapes;
}

}  // namespace

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_optimizer", {"bench_optimizer.json", 10});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  const auto fp32 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);

  std::vector<torch::Tensor> fused_masters, torch_masters, fused_copies, torch_copies;
  int64_t params = 0;
  torch::manual_seed(0);
  for (const auto& shape : example_shapes()) {
    const torch::Tensor init = torch::randn(shape, fp32) * 0.02;
    for (auto* masters : {&fused_masters, &torch_masters}) {
      masters->push_back(init.clone().requires_grad_(true));
      masters->back().mutable_grad() = torch::randn(shape, fp32) * 1e-3;
    }
    fused_copies.push_back(torch::empty(shape, fp32.dtype(torch::kBFloat16)));
    torch_copies.push_back(torch::empty(shape, fp32.dtype(torch::kBFloat16)));
    params += init.numel();
  }
  torchmoe::optim::FusedAdamW fused(fused_masters, torchmoe::optim::FusedAdamWOptions(1e-4));
  for (size_t i = 0; i < fused_masters.size(); ++i)
    fused.set_model_copy(fused_masters[i], fused_copies[i]);
  torch::optim::AdamW reference(torch_masters, torch::optim::AdamWOptions(1e-4));

  const double bytes = 34.0 * static_cast<double>(params);
  const torch::Tensor copy_src = torch::empty({params}, fp32),
                      copy_dst = torch::empty_like(copy_src);
  const std::vector<std::function<void()>> fns = {
      [&] {
        fused.clip_grad_norm(1.0);
        fused.step();
      },
      [&] {
        torch::nn::utils::clip_grad_norm_(torch_masters, 1.0);
        reference.step();
        const torch::NoGradGuard no_grad;
        for (size_t i = 0; i < torch_masters.size(); ++i) torch_copies[i].copy_(torch_masters[i]);
      },
      [&] { copy_dst.copy_(copy_src); }};
  const std::vector<double> ms = torchmoe::bench::median_ms_each(fns, args.iters, args.warmup);
  std::vector<double> gib;  // fused, torch, copy
  for (const std::function<void()>& fn : fns) gib.push_back(torchmoe::bench::peak_gib(fn));
  const double copy_gbs = 2.0 * 4.0 * params / (ms[2] * 1e6);  // read + write
  const double floor_ms = bytes / (copy_gbs * 1e6);
  std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name << ", " << params / 1e6
            << "M parameters in " << fused_masters.size() << " tensors\n"
            << std::fixed << std::setprecision(2) << "FusedAdamW clip+step      " << ms[0]
            << " ms  (" << bytes / (ms[0] * 1e6) << " GB/s; " << ms[0] / floor_ms
            << "x one pass at copy bandwidth), peak " << std::setprecision(3) << gib[0] << " GiB\n"
            << std::setprecision(2) << "torch clip + AdamW + copy " << ms[1] << " ms  ("
            << ms[1] / ms[0] << "x FusedAdamW), peak " << std::setprecision(3) << gib[1] << " GiB\n"
            << std::setprecision(2) << "copy bandwidth            " << copy_gbs
            << " GB/s; one pass of 34 B/param " << floor_ms << " ms, peak " << std::setprecision(3)
            << gib[2] << " GiB\n";
  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
       << "\",\n  \"parameters\": " << params << ",\n  \"tensors\": " << fused_masters.size()
       << ",\n  \"fused_ms\": " << ms[0] << ",\n  \"torch_ms\": " << ms[1]
       << ",\n  \"copy_gb_per_s\": " << copy_gbs << ",\n  \"one_pass_ms\": " << floor_ms
       << ",\n  \"fused_peak_gib\": " << gib[0] << ",\n  \"torch_peak_gib\": " << gib[1]
       << ",\n  \"copy_peak_gib\": " << gib[2] << "\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
