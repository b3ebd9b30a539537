// MoELayer forward+backward with expert parallelism over NCCL, and the all-to-all it rests on, on
// the benchmark MoE shapes (bf16). Run under torchrun, one process per GPU:
//
//   torchrun --no-python --nproc-per-node N build/bench/bench_moe_layer_ep [--shapes a,b,...]
//            [--iters N] [--warmup N] [--json PATH]
//
// or alone (no WORLD_SIZE) for the baseline: one GPU, no expert parallelism. Each rank routes the
// shape's `tokens` tokens, so N ranks process N·tokens per step, and holds E/N of the E experts
// (expert_parallel over the world group). Rank 0 prints and writes JSON:
//   layer ms      the MoELayer step (forward, backward of output and aux loss) on rank 0, the
//                 slowest rank's time being what a step costs (the exchanges synchronize them)
//   tokens/s      N·tokens / layer time: compare N = 1 and N = 2 for the scaling
//   a2a ms, GB/s  one all-to-all of a dispatch-sized buffer ([tokens·topk, hidden] bf16 per rank,
//                 equal splits): bytes leaving each GPU, (N-1)/N of the buffer, per second, next
//                 to NVLink's per-direction bandwidth (H100/H200 SXM: 450 GB/s)
//   GiB           the peak memory on rank 0 of one layer step (layer GiB) and of one all-to-all
//                 (a2a GiB): the caching allocator's peak above what was allocated before it
//                 (bench_common.h's peak_gib, run on every rank: the exchanges need them all);
//                 JSON layer_peak_gib, alltoall_peak_gib
// The layer's exchanges of split sizes synchronize the host (dropless routing; docs/moe.md).
// TORCHMOE_BENCH_TRACE=PREFIX records 5 layer steps per shape and rank (bench_common.h).

#include <ATen/cuda/CUDAContext.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr double kNvlinkPerDirection = 450.0;  // GB/s, H100/H200 SXM (NVLink 4, 18 links)

}  // namespace

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_moe_layer_ep", {"bench_moe_layer_ep.json", 10});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  using torchmoe::bench::median_ms;

  // With torchrun's environment: the world group (init_process_group selects LOCAL_RANK's GPU).
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  if (std::getenv("WORLD_SIZE") != nullptr) {
    group = torchmoe::distributed::init_process_group(torch::kCUDA);
  }
  const int ranks = group ? group->getSize() : 1;
  const bool report = !group || group->getRank() == 0;
  const auto bf16 = torch::TensorOptions()
                        .device(torch::kCUDA, c10::cuda::current_device())
                        .dtype(torch::kBFloat16);
  if (report) {
    std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name << " x " << ranks
              << " (expert parallel " << ranks << "), bf16, per rank: the shape's tokens\n"
              << std::left << std::setw(17) << "shape" << std::right << std::setw(10) << "layer ms"
              << std::setw(12) << "tokens/s" << std::setw(9) << "a2a ms" << std::setw(8) << "GB/s"
              << std::setw(8) << "NVLink" << std::setw(11) << "layer GiB" << std::setw(9)
              << "a2a GiB"
              << "\n";
  }
  std::ofstream json;
  if (report) {
    json.open(args.json_path);
    json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
         << "\",\n  \"ranks\": " << ranks << ",\n  \"results\": [\n";
  }
  bool first =
      true;  // no comma before the first JSON object (shapes that do not shard are left out)
  for (const torchmoe::bench::Shape& s : torchmoe::bench::selected_shapes(args)) {
    if (s.experts % ranks != 0) {
      if (report)
        std::cout << s.name << ": " << s.experts << " experts do not shard over " << ranks << "\n";
      continue;
    }
    // The same global weights on every rank (the same seed); each keeps its shard.
    torch::manual_seed(0);
    torchmoe::MoELayerOptions options(s.hidden, s.ffn, s.experts, s.topk);
    options.params_dtype(torch::kBFloat16).device(bf16.device());
    options.router().aux_loss_coeff(1e-2);
    options.experts().linear().single_grouped_weight(true);
    if (group) options.expert_parallel(torchmoe::ProcessGroupOptions(group));
    torchmoe::MoELayer moe(options);
    // Different tokens per rank.
    torch::manual_seed(1 + (group ? group->getRank() : 0));
    const torch::Tensor x = torch::randn({s.tokens, s.hidden}, bf16).requires_grad_(true);
    const torch::Tensor dout = torch::randn({s.tokens, s.hidden}, bf16);
    auto layer_step = [&] {
      const torchmoe::MoEOutput out = moe(x);
      torch::autograd::backward({out.output, out.aux_loss}, {dout, torch::ones_like(out.aux_loss)});
    };
    const double layer_ms = median_ms(layer_step, args.iters, args.warmup);
    const double layer_gib = torchmoe::bench::peak_gib(layer_step);
    torchmoe::bench::trace_if_asked(s.name + ".rank" + std::to_string(group ? group->getRank() : 0),
                                    layer_step);

    double a2a_ms = 0.0, a2a_gbs = 0.0, a2a_gib = 0.0;
    if (group) {
      const int64_t rows = s.tokens * s.topk / ranks * ranks;  // equal splits
      torch::Tensor send = torch::randn({rows, s.hidden}, bf16), recv = torch::empty_like(send);
      std::vector<int64_t> splits;
      const auto alltoall = [&] {
        auto work = group->alltoall_base(recv, send, splits, splits);
        work->wait();
      };
      a2a_ms = median_ms(alltoall, args.iters, args.warmup);
      a2a_gib = torchmoe::bench::peak_gib(alltoall);
      const double leaving = 2.0 * rows * s.hidden * (ranks - 1) / ranks;
      a2a_gbs = leaving / a2a_ms * 1e-6;
    }
    const double tokens_per_s = ranks * s.tokens / layer_ms * 1e3;
    if (report) {
      std::cout << std::left << std::setw(17) << s.name << std::right << std::fixed
                << std::setprecision(3) << std::setw(10) << layer_ms << std::setprecision(0)
                << std::setw(12) << tokens_per_s << std::setprecision(3) << std::setw(9) << a2a_ms
                << std::setprecision(0) << std::setw(8) << a2a_gbs << std::setw(8)
                << kNvlinkPerDirection << std::setprecision(2) << std::setw(11) << layer_gib
                << std::setprecision(3) << std::setw(9) << a2a_gib << "\n";
      json << (first ? "" : ",\n") << std::setprecision(5) << "    {\"shape\": \"" << s.name
           << "\", \"layer_ms\": " << layer_ms << ", \"tokens_per_s\": " << tokens_per_s
           << ", \"alltoall_ms\": " << a2a_ms << ", \"alltoall_gbs\": " << a2a_gbs
           << ", \"nvlink_gbs\": " << kNvlinkPerDirection << ", \"layer_peak_gib\": " << layer_gib
           << ", \"alltoall_peak_gib\": " << a2a_gib << "}";
      first = false;
    }
  }
  if (report) {
    json << "\n  ]\n}\n";
    std::cout << "wrote " << args.json_path << "\n";
  }
  if (group) group->barrier()->wait();
  return 0;
}
