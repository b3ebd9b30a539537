#pragma once
// Shared by the benchmark programs: the MoE shapes they measure, the timing rule and the peak
// memory of what they time.

#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <set>
#include <sstream>
#include <stdexcept>
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
      // The MoE layers of the example LM's measured config (docs/performance.md).
      {"moe-lm", 32, 1024, 1024, 2, 8192},
  };
  return kShapes;
}

// Command line shared by every benchmark: --json PATH, --iters N, --warmup N, --shapes a,b,...
struct Args {
  std::string json_path;
  int iters = 20;
  int warmup = 3;
  std::vector<std::string> shape_names;  // empty: all shapes
};

// Throws std::invalid_argument for an unknown flag, a flag without a value or an unknown shape.
inline Args parse_args(int argc, char** argv, Args args) {
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[i + 1];
    if (flag == "--json") {
      args.json_path = value;
    } else if (flag == "--iters") {
      args.iters = std::stoi(value);
    } else if (flag == "--warmup") {
      args.warmup = std::stoi(value);
    } else if (flag == "--shapes") {
      std::stringstream list(value);
      for (std::string name; std::getline(list, name, ',');) {
        const bool known = std::any_of(shapes().begin(), shapes().end(),
                                       [&](const Shape& shape) { return shape.name == name; });
        if (!known) throw std::invalid_argument("unknown shape " + name);
        args.shape_names.push_back(name);
      }
    } else {
      throw std::invalid_argument("unknown flag " + flag);
    }
  }
  if (args.iters < 1 || args.warmup < 0)
    throw std::invalid_argument("--iters must be >= 1 and --warmup >= 0");
  return args;
}

// What every benchmark's main does first: parse the command line and make sure there is a GPU.
// exit_code != 0 means main should return it (2: bad arguments, 1: no CUDA device), with the
// reason already printed.
struct Setup {
  Args args;
  int exit_code = 0;
};

inline Setup setup(int argc, char** argv, const std::string& program, Args defaults) {
  Setup s;
  try {
    s.args = parse_args(argc, argv, std::move(defaults));
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    s.exit_code = 2;
    return s;
  }
  if (!torch::cuda::is_available()) {
    std::cerr << program << ": no CUDA device; nothing to measure\n";
    s.exit_code = 1;
  }
  // The allocator's settings change what host times and peak memory mean: named when set.
  for (const char* name : {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING"}) {
    if (const char* value = std::getenv(name)) {
      std::cout << program << ": " << name << "=" << value << "\n";
    }
  }
  return s;
}

// The shapes named on the command line, in the table's order (all when none were named).
inline std::vector<Shape> selected_shapes(const Args& args) {
  std::vector<Shape> selected;
  for (const Shape& shape : shapes()) {
    if (args.shape_names.empty() || std::find(args.shape_names.begin(), args.shape_names.end(),
                                              shape.name) != args.shape_names.end()) {
      selected.push_back(shape);
    }
  }
  return selected;
}

// Median device time in ms of each of `fns` over `iters` runs after `warmup` runs of each. Each
// run is bracketed by CUDA events on the current stream and the runs are queued back to back with
// one wait at the end: while the host stays ahead of the GPU, a run's events time its GPU work
// alone. (Waiting after every run put the host's latency to the first launch, e.g. an autograd
// backward's hand-off to its device thread, inside every interval: 5-10% of a 0.2 ms kernel.)
// When the host is slower than the GPU, its launch gaps inside a run still count; host cost is
// measured on its own where it matters (bench_grouped_linear's host time per forward).
// The functions take turns, run by run: the H100's clocks drift with power and temperature over a
// benchmark (one GEMM measured 594 and 680 TFLOP/s minutes apart), and taking turns gives every
// function the same conditions, so ratios between them hold when absolute numbers move.
inline std::vector<double> median_ms_each(const std::vector<std::function<void()>>& fns, int iters,
                                          int warmup = 3) {
  for (int i = 0; i < warmup; ++i) {
    for (const auto& fn : fns) fn();
  }
  std::vector<std::vector<at::cuda::CUDAEvent>> starts(fns.size()), stops(fns.size());
  for (int i = 0; i < iters; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      starts[f].emplace_back(cudaEventDefault).record();
      fns[f]();
      stops[f].emplace_back(cudaEventDefault).record();
    }
  }
  stops.back().back().synchronize();
  std::vector<double> medians;
  for (size_t f = 0; f < fns.size(); ++f) {
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) times.push_back(starts[f][i].elapsed_time(stops[f][i]));
    std::sort(times.begin(), times.end());
    medians.push_back(times[times.size() / 2]);
  }
  return medians;
}

inline double median_ms(const std::function<void()>& fn, int iters, int warmup = 3) {
  return median_ms_each({fn}, iters, warmup)[0];
}

// Peak GPU memory of one run of `fn`, in GiB: the caching allocator's peak of allocated bytes
// (c10::cuda::CUDACachingAllocator's statistics, all pools) during the run, above what was
// allocated when it started: what the run's outputs, temporaries and saved activations take at
// most on top of what the program holds. Called after `fn` was timed, so that its warm-up runs
// have made what is made once (gradient buffers, workspaces, FP8 state). Memory that a CUDA
// graph's replay uses lives in the graph's pool, allocated at capture: a replay shows 0.
inline double peak_gib(const std::function<void()>& fn) {
  namespace allocator = c10::cuda::CUDACachingAllocator;
  constexpr auto kAll = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  const c10::DeviceIndex device = c10::cuda::current_device();
  torch::cuda::synchronize();
  allocator::resetPeakStats(device);
  const int64_t before = allocator::getDeviceStats(device).allocated_bytes[kAll].current;
  fn();
  torch::cuda::synchronize();
  const int64_t peak = allocator::getDeviceStats(device).allocated_bytes[kAll].peak;
  return static_cast<double>(peak - before) / (int64_t{1} << 30);
}

// With TORCHMOE_BENCH_TRACE=PREFIX set, records a Kineto trace (CPU and CUDA) of 5 runs of `step`
// into PREFIX.<name>.json, for scripts/trace_summary.py and scripts/cpu_ops_summary.py.
inline void trace_if_asked(const std::string& name, const std::function<void()>& step) {
  const char* prefix = std::getenv("TORCHMOE_BENCH_TRACE");
  if (prefix == nullptr) return;
  namespace profiler = torch::autograd::profiler;
  const profiler::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  const std::set<torch::profiler::impl::ActivityType> activities{
      torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
  profiler::prepareProfiler(config, activities);
  profiler::enableProfiler(config, activities);
  for (int i = 0; i < 5; ++i) step();
  torch::cuda::synchronize();
  profiler::disableProfiler()->save(std::string(prefix) + "." + name + ".json");
}

// A training step captured in a CUDA graph, as a C++ loop runs it to take the host out of the step
// (examples/moe_lm --cuda-graph): `warmup` eager runs first make the gradients' buffers and the
// libraries' workspaces that the captured run then reuses. The step must not synchronise with the
// host, and the program must run on a side stream from the first use of the leaves it steps
// (the legacy default stream cannot be captured, and a leaf's gradient accumulator keeps the
// stream it was made on).
class CapturedStep {
 public:
  explicit CapturedStep(const std::function<void()>& step, int warmup = 3) {
    if (c10::cuda::getCurrentCUDAStream() == c10::cuda::getDefaultCUDAStream()) {
      throw std::logic_error("CapturedStep: run the program on a side stream (CUDAStreamGuard)");
    }
    for (int i = 0; i < warmup; ++i) step();
    graph_.capture_begin();
    step();
    graph_.capture_end();
    torch::cuda::synchronize();
  }
  void replay() { graph_.replay(); }

 private:
  at::cuda::CUDAGraph graph_;
};

}  // namespace torchmoe::bench
