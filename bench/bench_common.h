#pragma once
// Shared by the benchmark programs: the MoE shapes they measure and the timing rule.

#include <ATen/cuda/CUDAEvent.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torchmoe::bench {

// An MoE expert layer: E experts, model width `hidden`, expert width `ffn`, top-k routing of
// `tokens` tokens, so M = tokens·topk rows; fc1 is [M, hidden] -> [M, 2·ffn].
struct Shape {
  std::string name;
  int64_t experts, hidden, ffn, topk, tokens;
};

inline const std::vector<Shape>& shapes() {
  static const std::vector<Shape> kShapes = {
      {"mixtral", 8, 4096, 14336, 2, 8192},
      {"deepseek-v3-ep8", 32, 7168, 2048, 8, 8192},
      {"qwen3-30b-a3b", 128, 2048, 768, 8, 8192},
      {"olmoe", 64, 2048, 1024, 8, 8192},
  };
  return kShapes;
}

// Median time in ms of `fn` over `iters` runs after `warmup`, each bracketed by CUDA events on
// the current stream.
inline double median_ms(const std::function<void()>& fn, int iters, int warmup = 3) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    fn();
    stop.record();
    stop.synchronize();
    times.push_back(start.elapsed_time(stop));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace torchmoe::bench
