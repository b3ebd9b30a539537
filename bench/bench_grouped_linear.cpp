// GroupedLinear GEMM throughput on a GPU: fprop (y = x·Wᵀ), dgrad (dx = dy·W) and wgrad
// (dW = dyᵀ·x) of an MoE expert fc1 layer, through torchmoe's ops on its CUDA backends (the sm90
// kernel and, when the process loaded cuBLASLt >= 13.8, the cuBLASLt grouped matmul, both with
// device splits; per-group cuBLASLt with host splits), next to at::_grouped_mm and a
// dense at::mm of the same FLOPs, measured in the same process. Also the host time of one forward
// with device splits, by layer (plan, op, module with and without autograd; the MoELayer by part,
// with its ATen calls counted and timed), of a training step's forward + backward, and the host's
// prices of a launch, an allocation, a fill and a view. Prints tables, writes
// JSON. Each GEMM row also gives the peak memory of one call of each of its five (GiB columns, in
// the TFLOP/s columns' order; JSON <column>_peak_gib): the caching allocator's peak above what was
// allocated before it (bench_common.h's peak_gib).
//
//   bench_grouped_linear [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//
// Shapes (E, hidden, ffn, topk, tokens); fc1 is N = 2·ffn, K = hidden, M = tokens·topk rows.
// Splits are "uniform" (M/E each) or "skewed" (expert load ~ Dirichlet(0.3)); every split is a
// multiple of 8 so at::_grouped_mm's wgrad accepts it (it asserts on the device otherwise).

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/cuda/Sleep.h>
#include <ATen/record_function.h>
#include <torchmoe/autograd/token_permutation_function.h>
#include <torchmoe/ops/grouped_gemm.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace {

using torchmoe::bench::median_ms_each;
using torchmoe::bench::Shape;

std::vector<int64_t> make_splits(int64_t experts, int64_t rows, bool skewed, uint64_t seed) {
  std::vector<int64_t> splits(experts, rows / experts);
  if (skewed) {
    std::mt19937_64 rng(seed);
    std::gamma_distribution<double> gamma(0.3, 1.0);
    std::vector<double> load(experts);
    double total = 0;
    for (double& l : load) total += (l = gamma(rng));
    int64_t used = 0;
    for (int64_t e = 0; e < experts; ++e) {
      splits[e] = static_cast<int64_t>(load[e] / total * rows / 8) * 8;
      used += splits[e];
    }
    *std::max_element(splits.begin(), splits.end()) += rows - used;
  } else {
    splits.back() += rows - rows / experts * experts;
  }
  return splits;
}

struct Record {
  std::string shape, splits, gemm;
  int64_t m, n, k, experts;
  double sm90, cublaslt, lt_grouped, grouped_mm, dense;  // TFLOP/s; lt_grouped NaN if absent
  std::vector<int64_t> m_splits;  // so that other programs can run the same cases
  // Peak GiB of one call, as the TFLOP/s: sm90, cublaslt, lt_grouped (NaN if absent), grouped_mm,
  // dense.
  std::vector<double> peak_gib;
};

namespace ops = torchmoe::ops;
constexpr auto kSm90 = torchmoe::GemmBackend::kSm90;
constexpr auto kCublasLt = torchmoe::GemmBackend::kCublasLt;
constexpr auto kLtGrouped = torchmoe::GemmBackend::kCublasLtGrouped;

ops::GemmPlan plan_for(const torch::Tensor& x, int64_t n, int64_t k,
                       const torchmoe::SplitSizes& splits, torchmoe::GemmBackend backend) {
  return ops::plan_grouped_gemms("bench", x, {ops::GemmShape{n, k, splits.size()}}, splits, backend)
      .front();
}

// Host time of one call of each of `fns`: the median over calls each timed alone, each made while
// the GPU is busy with a short spin kernel queued just before it, so the launch queue is short and
// the GPU is not idle. (Timing 200 calls in a row measured 6.5-15.9 us for the same code: each call
// queues ~0.8 ms of GPU work, so the queue can fill and the host then waits; calls made right after
// a device synchronisation measured 11-33 us, launches into an idle GPU.) The functions take turns
// call by call, so that they share the host's conditions (one function timed alone measured 2x
// apart in runs minutes apart), and each result is released after the clock stops: in training a
// forward's output lives on into backward.
// ~2 ms at the H100's clock: outlasts any call, a backward of 128 weights included.
constexpr int64_t kSpinCycles = 4000000;

std::vector<double> host_us(const std::vector<std::function<torch::Tensor()>>& fns) {
  constexpr int kCalls = 200;
  for (int i = 0; i < 10; ++i) {
    for (const auto& fn : fns) fn();
  }
  std::vector<std::vector<double>> times(fns.size());
  for (int i = 0; i < kCalls; ++i) {
    for (size_t f = 0; f < fns.size(); ++f) {
      torch::cuda::synchronize();
      at::cuda::sleep(kSpinCycles);
      const auto start = std::chrono::steady_clock::now();
      torch::Tensor result = fns[f]();
      times[f].push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count());
    }
  }
  torch::cuda::synchronize();
  std::vector<double> medians;
  for (std::vector<double>& t : times) {
    std::sort(t.begin(), t.end());
    medians.push_back(t[t.size() / 2]);
  }
  return medians;
}

// The ATen calls one `fn()` makes on this thread: at top level (each a trip through the
// dispatcher and, with autograd, its VariableType kernel) and with the calls they make nested; and
// the top-level calls' host time by name, summed per call (each call made as in host_us), with the
// time left outside them (torchmoe's own launches, the autograd Functions).
struct AtenCalls {
  int64_t top = 0, all = 0;
  std::vector<std::pair<std::string, double>> top_us;  // by name, largest first
  double outside_us = 0;
};

AtenCalls aten_calls(const std::function<torch::Tensor()>& fn) {
  constexpr int kCalls = 50;
  // RecordFunction's callbacks are plain function pointers: the tallies live in thread_locals.
  using Clock = std::chrono::steady_clock;
  static thread_local int depth = 0;
  static thread_local Clock::time_point top_start;
  static thread_local AtenCalls calls;
  static thread_local std::map<std::string, double> by_name;
  calls = {};
  by_name.clear();
  fn();  // warm: first calls build caches
  const at::CallbackHandle handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
            ++calls.all;
            if (depth++ == 0) {
              ++calls.top;
              top_start = Clock::now();
            }
            return nullptr;
          },
          [](const at::RecordFunction& record, at::ObserverContext*) {
            if (--depth == 0) {
              by_name[record.name()] +=
                  std::chrono::duration<double, std::micro>(Clock::now() - top_start).count();
            }
          })
          .scopes({at::RecordScope::FUNCTION}));
  double total_us = 0;
  for (int i = 0; i < kCalls; ++i) {
    torch::cuda::synchronize();
    at::cuda::sleep(kSpinCycles);
    const auto start = Clock::now();
    fn();
    total_us += std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  }
  at::removeCallback(handle);
  torch::cuda::synchronize();
  AtenCalls out;
  out.top = calls.top / kCalls;
  out.all = calls.all / kCalls;
  double inside_us = 0;
  for (const auto& [name, us] : by_name) {
    out.top_us.emplace_back(name, us / kCalls);
    inside_us += us;
  }
  std::sort(out.top_us.begin(), out.top_us.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  out.outside_us = (total_us - inside_us) / kCalls;
  return out;
}

// What the host pays for the pieces a layer's forward is made of, each timed as in host_us: a
// kernel launch (ATen's spin kernel, one cycle), an allocation, a zero fill (allocation and fill
// kernel), a view.
std::vector<std::pair<std::string, double>> host_prices() {
  const auto options = torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor t = torch::empty({64, 1024}, options);
  const std::vector<std::pair<std::string, std::function<torch::Tensor()>>> prices = {
      {"launch",
       [] {
         at::cuda::sleep(1);
         return torch::Tensor();
       }},
      {"at::empty",
       [&] {
         return at::empty({64, 1024}, options);
       }},
      // The CUDA allocation behind at::empty without the dispatcher: what an op would save by
      // calling it directly.
      {"at::detail::empty_cuda",
       [&] {
         return at::detail::empty_cuda({64, 1024}, at::kBFloat16, options.device(), std::nullopt);
       }},
      {"at::zeros", [&] { return at::zeros({1}, options); }},
      {"view", [&] { return t.view({-1}); }},
  };
  std::vector<std::function<torch::Tensor()>> fns;
  for (const auto& price : prices) fns.push_back(price.second);
  const std::vector<double> us = host_us(fns);
  std::vector<std::pair<std::string, double>> out;
  for (size_t i = 0; i < prices.size(); ++i) out.emplace_back(prices[i].first, us[i]);
  return out;
}

// Host time per forward with device splits, by phase: the output's allocation, planning, the op
// (checks, tensor maps, launch) on stacked weights and on G separately allocated ones, and the
// GroupedLinear module (G separate weights, its default) without and with autograd, and with a
// single grouped weight; the GroupedMLP forward (fc1, the scaled SwiGLU, fc2) with autograd; and
// the MoELayer forward on the shape's tokens (router, permutation, GroupedMLP, unpermute) and
// its parts called alone: the router, the routing map (autograd::route_tokens) and the experts on
// the routed tokens (GroupedMLP::forward_combined, the layer's bf16 path), with the forward's
// ATen calls counted.
// Then a training step's host time, in turns of its own: the module's forward + backward, with G
// weights and with the single grouped weight; setting the gradients to none first is inside the
// timed call.
struct HostTimes {
  std::string shape;
  double alloc, plan, op_stacked, op_separate, module_no_grad, module, module_single, mlp;  // us
  double moe_layer, moe_router, moe_routing, moe_experts;                                   // us
  AtenCalls moe_calls;
  double step, step_single;  // us
};

HostTimes host_times(const torchmoe::bench::Shape& shape, const torch::Tensor& x,
                     const torch::Tensor& stacked_weights, const torchmoe::SplitSizes& splits) {
  const int64_t n = 2 * shape.ffn, k = shape.hidden;
  auto options = torchmoe::GroupedLinearOptions(shape.experts, k, n)
                     .bias(false)
                     .params_dtype(torch::kBFloat16)
                     .device(torch::kCUDA);
  const torch::Tensor input = x.detach().requires_grad_(true);  // the module's autograd cost
  const ops::GemmPlan plan = plan_for(x, n, k, splits, torchmoe::GemmBackend::kAuto);
  const ops::GroupedTensors stacked = ops::GroupedTensors::stacked(stacked_weights);
  torchmoe::GroupedLinear layer(options);
  const std::vector<torch::Tensor> weights = layer->expert_weights();
  torchmoe::GroupedLinear single(options.single_grouped_weight(true));
  torchmoe::GroupedMLPOptions mlp_options(shape.experts, k, shape.ffn);
  mlp_options.linear().bias(false).params_dtype(torch::kBFloat16).device(torch::kCUDA);
  torchmoe::GroupedMLP mlp(mlp_options);
  torchmoe::MoELayerOptions layer_options(k, shape.ffn, shape.experts, shape.topk);
  layer_options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
  layer_options.experts().linear().bias(false);
  torchmoe::MoELayer moe_layer(layer_options);
  const torch::Tensor tokens =
      torch::randn({x.size(0) / shape.topk, k}, x.options()).requires_grad_(true);
  const torch::Tensor probs =
      torch::rand({x.size(0)}, x.options().dtype(torch::kFloat32)).requires_grad_(true);
  const torchmoe::RouterOutput routing = moe_layer->router(tokens);
  const torchmoe::PermutedTokens routed = torchmoe::autograd::route_tokens(
      tokens, routing.indices, shape.experts, routing.probs, ops::IndexTrust::kDropless);
  const torch::Tensor grad_output = torch::randn({x.size(0), n}, x.options());
  const auto step = [&](torchmoe::GroupedLinear& module) {
    input.mutable_grad() = torch::Tensor();
    for (const torch::Tensor& p : module->parameters()) p.mutable_grad() = torch::Tensor();
    module(input, splits).backward(grad_output);
    return torch::Tensor();
  };
  const std::vector<double> us = host_us({
      [&] {
        return torch::empty({x.size(0), n}, x.options());
      },
      [&] {
        plan_for(x, n, k, splits, torchmoe::GemmBackend::kAuto);
        return torch::Tensor();
      },
      [&] { return ops::grouped_linear_forward(plan, x, stacked, {}); },
      [&] { return ops::grouped_linear_forward(plan, x, weights, {}); },
      [&] {
        const torch::NoGradGuard no_grad;
        return layer(x, splits);
      },
      [&] { return layer(input, splits); },
      [&] { return single(input, splits); },
      [&] { return mlp(input, splits, probs); },
      [&] { return moe_layer(tokens).output; },
      [&] { return moe_layer->router(tokens).probs; },
      [&] {
        return torchmoe::autograd::route_tokens(tokens, routing.indices, shape.experts,
                                                routing.probs, ops::IndexTrust::kDropless)
            .probs;
      },
      [&] { return moe_layer->experts->forward_combined(tokens, routed); },
  });
  const AtenCalls moe_calls = aten_calls([&] { return moe_layer(tokens).output; });
  // The steps take turns apart: beside a backward of G weights every forward phase above read 2-7x
  // its time (on an H100 host, the allocation 2.1 us alone and 5-21 us beside the steps).
  const std::vector<double> steps = host_us({
      [&] { return step(layer); },
      [&] { return step(single); },
  });
  return {shape.name, us[0], us[1], us[2],  us[3],  us[4],     us[5],    us[6],
          us[7],      us[8], us[9], us[10], us[11], moe_calls, steps[0], steps[1]};
}

}  // namespace

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_grouped_linear", {"bench_grouped_linear.json", 20});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  const char* streams = std::getenv("TORCHMOE_CUBLASLT_STREAMS");
  const torchmoe::LoadedCublasLt lt = torchmoe::loaded_cublaslt();
  std::cout << "device: " << at::cuda::getCurrentDeviceProperties()->name
            << ", bf16, cuBLASLt streams: " << (streams ? streams : "4 (default)") << ", cuBLASLt "
            << lt.version << " (" << lt.library << ")"
            << (lt.grouped ? "" : ": no grouped matmul, lt_grouped column empty") << "\n";
  std::cout << std::left << std::setw(17) << "shape" << std::setw(8) << "splits" << std::setw(7)
            << "gemm" << std::right << std::setw(8) << "sm90" << std::setw(10) << "cublaslt"
            << std::setw(12) << "lt_grouped" << std::setw(12) << "grouped_mm" << std::setw(8)
            << "ratio" << std::setw(8) << "dense";
  for (const char* name : {"sm90", "lt", "ltg", "gmm", "mm"})
    std::cout << std::setw(9) << std::string(name) + " GiB";
  std::cout << "   (TFLOP/s; ratio = best torchmoe / grouped_mm; peak GiB of one call of each)\n";

  std::vector<Record> records;
  std::vector<HostTimes> host;
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  for (const Shape& shape : torchmoe::bench::selected_shapes(args)) {
    const int64_t m = shape.tokens * shape.topk, n = 2 * shape.ffn, k = shape.hidden;
    torch::manual_seed(0);
    const torch::Tensor x = torch::randn({m, k}, bf16);
    const torch::Tensor dy = torch::randn({m, n}, bf16);
    const torch::Tensor w = torch::randn({shape.experts, n, k}, bf16) * 0.02;
    const torch::Tensor dw = torch::empty({shape.experts, n, k}, bf16);
    const std::vector<torch::Tensor> w_views = w.unbind(0), dw_views = dw.unbind(0);
    const torch::Tensor w0t = w[0].t();
    const double flops = 2.0 * m * n * k;
    for (const bool skewed : {false, true}) {
      const std::vector<int64_t> splits = make_splits(shape.experts, m, skewed, 42);
      const torch::Tensor offs =
          torch::tensor(splits, torch::kInt32).cumsum(0).to(torch::kInt32).to(torch::kCUDA);
      const std::string split_name = skewed ? "skewed" : "uniform";
      const torchmoe::SplitSizes device_splits(torch::tensor(splits).to(torch::kCUDA));
      const ops::GemmPlan sm90 = plan_for(x, n, k, device_splits, kSm90);
      const ops::GemmPlan cublaslt = plan_for(x, n, k, splits, kCublasLt);
      const ops::GemmPlan lt_grouped =
          lt.grouped ? plan_for(x, n, k, device_splits, kLtGrouped) : ops::GemmPlan{};

      // One correctness look per case: each backend's fprop against at::_grouped_mm.
      const torch::Tensor ref_y = at::_grouped_mm(x, w.transpose(1, 2), offs);
      std::vector<std::pair<const char*, torch::Tensor>> outputs = {
          {"sm90", ops::grouped_linear_forward(sm90, x, w_views, {})},
          {"cublaslt", ops::grouped_linear_forward(cublaslt, x, w_views, {})}};
      if (lt.grouped) {
        outputs.emplace_back("lt_grouped", ops::grouped_linear_forward(lt_grouped, x, w_views, {}));
      }
      for (const auto& [name, y] : outputs) {
        const double rel = ((y.to(torch::kFloat32) - ref_y.to(torch::kFloat32)).norm() /
                            ref_y.to(torch::kFloat32).norm())
                               .item<double>();
        if (!(rel < 1e-2)) {
          std::cerr << "bench_grouped_linear: " << shape.name << " " << split_name << " " << name
                    << " fprop disagrees with at::_grouped_mm (relative error " << rel << ")\n";
          return 1;
        }
      }
      if (!skewed) {
        host.push_back(host_times(shape, x, w, device_splits));
      }

      const std::function<void()> dense = [&] { at::mm(x, w0t); };
      struct Gemm {
        const char* name;
        std::function<void()> sm90, cublaslt, lt_grouped, grouped_mm;
      };
      const std::vector<Gemm> gemms = {
          {"fprop", [&] { ops::grouped_linear_forward(sm90, x, w_views, {}); },
           [&] { ops::grouped_linear_forward(cublaslt, x, w_views, {}); },
           [&] { ops::grouped_linear_forward(lt_grouped, x, w_views, {}); },
           [&] { at::_grouped_mm(x, w.transpose(1, 2), offs); }},
          {"dgrad", [&] { ops::grouped_linear_dgrad(sm90, dy, w_views); },
           [&] { ops::grouped_linear_dgrad(cublaslt, dy, w_views); },
           [&] { ops::grouped_linear_dgrad(lt_grouped, dy, w_views); },
           [&] { at::_grouped_mm(dy, w, offs); }},
          {"wgrad", [&] { ops::grouped_linear_wgrad(sm90, x, dy, dw_views, false, {}); },
           [&] { ops::grouped_linear_wgrad(cublaslt, x, dy, dw_views, false, {}); },
           [&] { ops::grouped_linear_wgrad(lt_grouped, x, dy, dw_views, false, {}); },
           [&] { at::_grouped_mm(dy.t(), x, offs); }},
      };
      for (const Gemm& gemm : gemms) {
        // All take turns in one measurement (the one without a grouped cuBLASLt sits out).
        std::vector<std::function<void()>> fns = {gemm.sm90, gemm.cublaslt, gemm.grouped_mm, dense};
        if (lt.grouped) fns.push_back(gemm.lt_grouped);
        const std::vector<double> ms = median_ms_each(fns, args.iters, args.warmup);
        const double sm90_ms = ms[0], cublaslt_ms = ms[1], peer_ms = ms[2], dense_ms = ms[3];
        const double lt_grouped_ms = lt.grouped ? ms[4] : std::nan("");
        std::vector<double> gib;  // in the order of `fns`
        for (const std::function<void()>& fn : fns) gib.push_back(torchmoe::bench::peak_gib(fn));
        Record r{shape.name,
                 split_name,
                 gemm.name,
                 m,
                 n,
                 k,
                 shape.experts,
                 flops / sm90_ms * 1e-9,
                 flops / cublaslt_ms * 1e-9,
                 flops / lt_grouped_ms * 1e-9,
                 flops / peer_ms * 1e-9,
                 flops / dense_ms * 1e-9,
                 splits,
                 {gib[0], gib[1], lt.grouped ? gib[4] : std::nan(""), gib[2], gib[3]}};
        records.push_back(r);
        std::cout << std::left << std::setw(17) << r.shape << std::setw(8) << r.splits
                  << std::setw(7) << r.gemm << std::right << std::fixed << std::setprecision(1)
                  << std::setw(8) << r.sm90 << std::setw(10) << r.cublaslt << std::setw(12)
                  << r.lt_grouped << std::setw(12) << r.grouped_mm << std::setprecision(3)
                  << std::setw(8)
                  << std::max({r.sm90, r.cublaslt, lt.grouped ? r.lt_grouped : 0.0}) / r.grouped_mm
                  << std::setprecision(1) << std::setw(8) << r.dense << std::setprecision(3);
        for (double g : r.peak_gib) std::cout << std::setw(9) << g;
        std::cout << "\n";
      }
    }
  }

  std::cout << "\nhost time per forward with device splits (us, median of 200 calls; separate = G "
               "separately allocated weights, GroupedLinear's default; module with autograd; then "
               "the module's forward + backward):\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(7) << "alloc"
            << std::setw(7) << "plan" << std::setw(11) << "op stacked" << std::setw(13)
            << "op separate" << std::setw(16) << "module no-grad" << std::setw(9) << "module"
            << std::setw(15) << "module single" << std::setw(11) << "GroupedMLP" << std::setw(10)
            << "MoELayer" << std::setw(10) << "fwd+bwd" << std::setw(17) << "single fwd+bwd"
            << "\n";
  for (const HostTimes& t : host) {
    std::cout << std::left << std::setw(17) << t.shape << std::right << std::fixed
              << std::setprecision(1) << std::setw(7) << t.alloc << std::setw(7) << t.plan
              << std::setw(11) << t.op_stacked << std::setw(13) << t.op_separate << std::setw(16)
              << t.module_no_grad << std::setw(9) << t.module << std::setw(15) << t.module_single
              << std::setw(11) << t.mlp << std::setw(10) << t.moe_layer << std::setw(10) << t.step
              << std::setw(17) << t.step_single << "\n";
  }
  std::cout << "\nMoELayer forward by part (us, in the same turns; rest = the layer less its parts "
               "called alone; ATen calls of one forward, at top level / with nested):\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(10) << "MoELayer"
            << std::setw(8) << "router" << std::setw(9) << "routing" << std::setw(9) << "experts"
            << std::setw(7) << "rest" << std::setw(12) << "ATen calls"
            << "\n";
  for (const HostTimes& t : host) {
    std::cout << std::left << std::setw(17) << t.shape << std::right << std::fixed
              << std::setprecision(1) << std::setw(10) << t.moe_layer << std::setw(8)
              << t.moe_router << std::setw(9) << t.moe_routing << std::setw(9) << t.moe_experts
              << std::setw(7) << t.moe_layer - t.moe_router - t.moe_routing - t.moe_experts
              << std::setw(7) << t.moe_calls.top << " / " << t.moe_calls.all << "\n";
  }
  std::cout
      << "\nMoELayer forward's top-level ATen calls by host time (us per forward, summed over "
         "each name's calls; outside = torchmoe's launches and autograd Functions):\n";
  for (const HostTimes& t : host) {
    std::cout << std::left << std::setw(17) << t.shape << std::right << "outside "
              << t.moe_calls.outside_us;
    for (size_t i = 0; i < std::min<size_t>(6, t.moe_calls.top_us.size()); ++i) {
      std::cout << ", " << t.moe_calls.top_us[i].first << " " << t.moe_calls.top_us[i].second;
    }
    std::cout << "\n";
  }
  const std::vector<std::pair<std::string, double>> prices =
      host.empty() ? std::vector<std::pair<std::string, double>>{} : host_prices();
  std::cout << "\nhost prices (us, as the forwards above):";
  for (const auto& [name, us] : prices) std::cout << " " << name << " " << us;
  std::cout << "\n";

  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << at::cuda::getCurrentDeviceProperties()->name
       << "\",\n  \"cublaslt_version\": " << lt.version
       << ",\n  \"dtype\": \"bfloat16\",\n  \"cublaslt_streams\": \"" << (streams ? streams : "4")
       << "\",\n  \"unit\": \"TFLOP/s\",\n  \"results\": [\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    json << "    {\"shape\": \"" << r.shape << "\", \"splits\": \"" << r.splits
         << "\", \"gemm\": \"" << r.gemm << "\", \"experts\": " << r.experts << ", \"m\": " << r.m
         << ", \"n\": " << r.n << ", \"k\": " << r.k << ", \"sm90\": " << r.sm90
         << ", \"cublaslt\": " << r.cublaslt
         << ", \"cublaslt_grouped\": " << (lt.grouped ? std::to_string(r.lt_grouped) : "null")
         << ", \"grouped_mm\": " << r.grouped_mm << ", \"dense_mm\": " << r.dense;
    const char* const peak_names[] = {"sm90", "cublaslt", "cublaslt_grouped", "grouped_mm",
                                      "dense_mm"};
    for (size_t c = 0; c < r.peak_gib.size(); ++c) {
      json << ", \"" << peak_names[c] << "_peak_gib\": ";
      if (std::isnan(r.peak_gib[c])) {
        json << "null";
      } else {
        json << r.peak_gib[c];
      }
    }
    json << ", \"m_splits\": [";
    for (size_t g = 0; g < r.m_splits.size(); ++g) json << (g ? ", " : "") << r.m_splits[g];
    json << "]}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  json << "  ],\n  \"host_us_per_forward\": [\n";
  for (size_t i = 0; i < host.size(); ++i) {
    const HostTimes& t = host[i];
    json << "    {\"shape\": \"" << t.shape << "\", \"alloc\": " << t.alloc
         << ", \"plan\": " << t.plan << ", \"op_stacked\": " << t.op_stacked
         << ", \"op_separate\": " << t.op_separate << ", \"module_no_grad\": " << t.module_no_grad
         << ", \"module\": " << t.module << ", \"module_single_weight\": " << t.module_single
         << ", \"grouped_mlp\": " << t.mlp << ", \"moe_layer\": " << t.moe_layer
         << ", \"moe_layer_router\": " << t.moe_router
         << ", \"moe_layer_routing\": " << t.moe_routing
         << ", \"moe_layer_experts\": " << t.moe_experts
         << ", \"moe_layer_aten_calls\": " << t.moe_calls.top
         << ", \"moe_layer_aten_calls_nested\": " << t.moe_calls.all
         << ", \"moe_layer_outside_aten\": " << t.moe_calls.outside_us
         << ", \"moe_layer_aten_us\": {";
    for (size_t c = 0; c < t.moe_calls.top_us.size(); ++c) {
      json << (c ? ", " : "") << "\"" << t.moe_calls.top_us[c].first
           << "\": " << t.moe_calls.top_us[c].second;
    }
    json << "}"
         << ", \"module_fwd_bwd\": " << t.step
         << ", \"module_single_weight_fwd_bwd\": " << t.step_single << "}"
         << (i + 1 < host.size() ? "," : "") << "\n";
  }
  json << "  ],\n  \"host_prices_us\": {";
  for (size_t i = 0; i < prices.size(); ++i) {
    json << (i ? ", " : "") << "\"" << prices[i].first << "\": " << prices[i].second;
  }
  json << "}\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
