// GroupedLinear module throughput in FP8 next to bf16 on a GPU: the whole module (autograd,
// quantization, GEMMs, the delayed-scaling update where there is one) of an MoE expert fc1 layer
// (bf16 parameters, no bias, uniform splits, input requiring grad), forward + backward and
// forward alone, per shape, in nine columns measured in one run taking turns (bench_common.h):
//
//   bf16          gemm_backend kAuto (torchmoe's default: the sm90 kernel on H100/H200)
//   bf16_cublaslt gemm_backend kCublasLt (per-group cuBLASLt)
//   fp8_delayed   fp8::DelayedScaling (history 16) with fp8::update_delayed_scaling after each
//                 forward (kForward) and backward (kBackward), as a training loop runs it; kAuto
//                 (here with host sizes: per-group cuBLASLt for large experts, else the sm90
//                 kernel's FP8 path on H100/H200)
//   fp8_current   fp8::CurrentScaling, kAuto
//   fp8_block     fp8::BlockScaling (1x128 input and grad, 128x128 weight), kAuto (block scales
//                 run as per-group cuBLASLt FP8 matmuls on every backend)
//   fp8_cached    fp8_delayed with is_first_microbatch = false: the FP8 weights cached by an
//                 earlier call (the later micro-batches of a step with gradient accumulation)
//   fp8_cublaslt  fp8_delayed on gemm_backend kCublasLt (per-group cuBLASLt FP8 matmuls)
//   fp8_sm90      fp8_delayed on gemm_backend kSm90 (the sm90 kernel, one launch per product)
//   fp8_grouped   fp8_delayed on gemm_backend kCublasLtGrouped (one grouped FP8 matmul per
//                 product; only when the process loaded cuBLASLt >= 13.8, else not measured)
//
// Then the three products alone, per shape, on operands made once (split_quantize and
// quantize_weights under current scaling, e4m3 x and W, e5m2 dy as HYBRID casts them): our bf16
// products (kAuto) and FP8 products on the sm90 kernel (fprop with fast accumulation, dgrad and
// wgrad with split accumulation, as TE, and with fast accumulation as CurrentScaling's
// dgrad/wgrad_split_accumulator(false) runs them), next to the peers' fprop in the same run
// taking turns: torch._grouped_mm (bf16) and torch._scaled_grouped_mm (FP8 with rowwise scales,
// fast accumulation), both called through ATen. Only on sm_90 devices (our sm90 kernel).
//
// Last, training steps with the optimizer, per shape, on one layer with a single grouped weight,
// fused wgrad accumulation into its fp32 master's gradient and FusedAdamW, in milliseconds taking
// turns: fwd+bwd in bf16, in FP8 (delayed) casting the weights, and in FP8 reading the weights
// that FusedAdamW::set_fp8_weights has the optimizer write; then the optimizer step alone, plain
// (master and its bf16 copy) and writing the FP8 weights too. A training step with one
// micro-batch is fwd+bwd plus the step of its optimizer.
//
//   bench_grouped_linear_fp8 [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//   (TORCHMOE_BENCH_TRACE=PREFIX: also Kineto traces of 5 bf16, 5 fp8_sm90 and 5 fp8_block steps
//   per shape)
//
// Shapes (E, hidden, ffn, topk, tokens) from bench_common.h; fc1: N = 2·ffn, K = hidden,
// M = tokens·topk rows in E splits of M/E (the last takes the remainder), given on the host and
// the device. FLOPs: forward 2·M·N·K, forward + backward 3 × 2·M·N·K (fprop, dgrad, wgrad). Every
// iteration drops the gradients (set to none, as optimizer.zero_grad()) so that none is
// accumulated, and the weights are quantized every call (is_first_microbatch unset: one
// micro-batch per step) except in fp8_cached. Ceilings printed for reference: the H100 SXM's dense
// spec, 989 TFLOP/s bf16 and 1979 FP8 (the 1979 / 3958 headline numbers are with 2:4 sparsity).
//
// Every row of the three tables also gives the peak memory of one run of each of its columns (GiB
// columns at the end, in the columns' order; JSON <column>_peak_gib, null where not measured): the
// caching allocator's peak above what was allocated before it (bench_common.h's peak_gib).

#include <ATen/cuda/CUDAContext.h>
#include <torchmoe/ops/grouped_gemm.h>
#include <torchmoe/ops/grouped_gemm_fp8.h>
#include <torchmoe/ops/quantize.h>
#include <torchmoe/torchmoe.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace fp8 = torchmoe::fp8;
using torchmoe::bench::median_ms_each;
using torchmoe::bench::Shape;

constexpr double kSpecBf16Dense = 989.0;  // H100 SXM, TFLOP/s, dense
constexpr double kSpecFp8Dense = 1979.0;
constexpr int64_t kHistory = 16;

const char* const kColumns[] = {"bf16",         "bf16_cublaslt", "fp8_delayed",
                                "fp8_current",  "fp8_block",     "fp8_cached",
                                "fp8_cublaslt", "fp8_sm90",      "fp8_grouped"};
constexpr size_t kNumColumns = 9;
constexpr size_t kBlockColumn = 4;
constexpr size_t kCachedColumn = 5;
constexpr size_t kPerGroupColumn = 6;
constexpr size_t kSm90Column = 7;
constexpr size_t kGroupedColumn = 8;  // last: not measured without a grouped matmul

// The module table's GiB columns: kColumns', short.
const char* const kColumnsShort[] = {"bf16", "lt",  "dly",  "cur", "blk",
                                     "cch",  "lt8", "sm90", "grp"};

struct Record {
  std::string shape, pass;
  int64_t experts, m, n, k;
  std::vector<double> tflops;    // per column
  std::vector<double> peak_gib;  // per column; NaN where not measured
};

// The peak GiB of one run of each of `fns` (bench_common.h), in their order.
std::vector<double> peaks_gib(const std::vector<std::function<void()>>& fns) {
  std::vector<double> gib;
  for (const std::function<void()>& fn : fns) gib.push_back(torchmoe::bench::peak_gib(fn));
  return gib;
}

// Writes `value`, or null for NaN (not measured).
void json_number(std::ostream& json, double value) {
  if (std::isnan(value)) {
    json << "null";
  } else {
    json << value;
  }
}

// The products table's columns: ours bf16 and FP8 per product, then the peers' fprop.
const char* const kProductColumns[] = {"bf16_fprop",       "bf16_dgrad",
                                       "bf16_wgrad",       "fp8_fprop",
                                       "fp8_dgrad",        "fp8_wgrad",
                                       "fp8_dgrad_fast",   "fp8_wgrad_fast",
                                       "grouped_mm_fprop", "scaled_grouped_mm_fprop"};
constexpr size_t kNumProductColumns = std::size(kProductColumns);

// The products table's GiB columns: kProductColumns', short.
const char* const kProductColumnsShort[] = {"bf.fp", "bf.dg",  "bf.wg",  "f8.fp", "f8.dg",
                                            "f8.wg", "f8.dgf", "f8.wgf", "gmm",   "sgmm"};

struct ProductRecord {
  std::string shape;
  std::vector<double> tflops;         // per product column
  std::vector<double> peak_gib;       // per product column
  double fp8_over_bf16_geomean;       // split accumulation in dgrad and wgrad (TE's)
  double fp8_fast_over_bf16_geomean;  // fast accumulation in all three
  double fp8_fprop_over_scaled_grouped_mm;
};

// M rows in E splits of M/E (the last takes the remainder), on the host and the device.
torchmoe::SplitSizes uniform_splits(int64_t m, int64_t e) {
  std::vector<int64_t> host(e, m / e);
  host.back() += m - m / e * e;
  const torch::Tensor device = torch::tensor(host, torch::kLong).to(torch::kCUDA);
  return torchmoe::SplitSizes(std::move(host), device);
}

// The products table of one shape (see the header).
ProductRecord measure_products(const Shape& shape, const torchmoe::bench::Args& args) {
  namespace ops = torchmoe::ops;
  const int64_t m = shape.tokens * shape.topk, n = 2 * shape.ffn, k = shape.hidden;
  const int64_t e = shape.experts;
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torchmoe::SplitSizes splits = uniform_splits(m, e);
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({m, k}, bf16), dy = torch::randn({m, n}, bf16);
  const torch::Tensor w = torch::randn({e, n, k}, bf16) * (1.0 / std::sqrt(k));
  const ops::GroupedTensors weights = ops::GroupedTensors::stacked(w);
  const torch::Tensor dw = torch::empty_like(w);
  const ops::GroupedTensors weight_grads = ops::GroupedTensors::stacked(dw);
  const std::vector<ops::GemmShape> gemm{{n, k, static_cast<size_t>(e), true}};
  const ops::GemmPlan plan =
      ops::plan_grouped_gemms("bench", x, gemm, splits, torchmoe::GemmBackend::kAuto)[0];
  // Current scaling, e4m3 x and W, e5m2 dy (both copies); TE's accumulation, and fast
  // accumulation in all three products.
  ops::Fp8GemmOptions options;
  options.grad_output.format = ops::Fp8Format::kE5M2;
  ops::Fp8GemmOptions fast_options = options;
  fast_options.dgrad_split_accumulator = false;
  fast_options.wgrad_split_accumulator = false;
  const ops::GemmPlan fp8_plan = ops::plan_grouped_gemms(
      "bench", x, gemm, splits, torchmoe::GemmBackend::kSm90, {}, options)[0];
  const ops::GemmPlan fast_plan = ops::plan_grouped_gemms(
      "bench", x, gemm, splits, torchmoe::GemmBackend::kSm90, {}, fast_options)[0];
  const ops::SplitQuantizeOptions& forward = options.input;
  const ops::SplitQuantizeOptions& backward = options.grad_output;
  const ops::SplitQuantized xq = ops::split_quantize(x, splits, forward);
  const ops::SplitQuantized wq = ops::quantize_weights(weights, forward);
  const ops::SplitQuantized dyq = ops::split_quantize(dy, splits, backward);
  // The peers: offsets (int32 cumulative sizes), W as [E, k, n] views, unit rowwise scales.
  const torch::Tensor offsets =
      torch::tensor(splits.host(), torch::kLong).cumsum(0).to(torch::kInt).to(torch::kCUDA);
  const torch::Tensor w_t = w.transpose(-2, -1);
  const torch::Tensor w8_t = wq.data.view({e, n, k}).transpose(-2, -1);
  const torch::Tensor scale_a = torch::ones({m}, bf16.dtype(torch::kFloat));
  const torch::Tensor scale_b = torch::ones({e, n}, bf16.dtype(torch::kFloat));
  const std::vector<std::function<void()>> fns = {
      [&] { ops::grouped_linear_forward(plan, x, weights, {}); },
      [&] { ops::grouped_linear_dgrad(plan, dy, weights); },
      [&] { ops::grouped_linear_wgrad(plan, x, dy, weight_grads, false, {}); },
      [&] { ops::grouped_linear_forward_fp8(fp8_plan, xq, wq, {}, torch::kBFloat16); },
      [&] { ops::grouped_linear_dgrad_fp8(fp8_plan, dyq, wq, torch::kBFloat16); },
      [&] { ops::grouped_linear_wgrad_fp8(fp8_plan, xq, dyq, weight_grads, false); },
      [&] { ops::grouped_linear_dgrad_fp8(fast_plan, dyq, wq, torch::kBFloat16); },
      [&] { ops::grouped_linear_wgrad_fp8(fast_plan, xq, dyq, weight_grads, false); },
      [&] { at::_grouped_mm(x, w_t, offsets); },
      [&] {
        at::_scaled_grouped_mm(xq.data, w8_t, scale_a, scale_b, offsets, {}, {}, torch::kBFloat16,
                               /*use_fast_accum=*/true);
      }};
  const std::vector<double> ms = median_ms_each(fns, args.iters, args.warmup);
  const double flops = 2.0 * static_cast<double>(m) * n * k;
  ProductRecord r{shape.name, {}, peaks_gib(fns), 0.0, 0.0, 0.0};
  for (double t : ms) r.tflops.push_back(flops / t * 1e-9);
  const std::vector<double>& t = r.tflops;
  r.fp8_over_bf16_geomean = std::cbrt(t[3] / t[0] * t[4] / t[1] * t[5] / t[2]);
  r.fp8_fast_over_bf16_geomean = std::cbrt(t[3] / t[0] * t[6] / t[1] * t[7] / t[2]);
  r.fp8_fprop_over_scaled_grouped_mm = t[3] / t[9];
  return r;
}

// The training-step table's columns (see the header), in milliseconds.
const char* const kStepColumns[] = {"bf16_fwd_bwd", "fp8_fwd_bwd", "fp8_optimizer_weights_fwd_bwd",
                                    "adamw", "adamw_fp8_weights"};
constexpr size_t kNumStepColumns = std::size(kStepColumns);
// Its GiB columns, short.
const char* const kStepColumnsShort[] = {"bf16", "fp8", "fp8 opt", "adamw", "adamw8"};

struct StepRecord {
  std::string shape;
  std::vector<double> ms;               // per step column
  std::vector<double> peak_gib;         // per step column
  double fwd_bwd_ratio;                 // bf16 over FP8 reading the optimizer's weights
  double step_ratio_cast;               // a training step: bf16 over FP8 casting its weights
  double step_ratio_optimizer_weights;  // bf16 over FP8 with the optimizer's weights
};

StepRecord measure_training_steps(const Shape& shape, const torchmoe::bench::Args& args) {
  using torchmoe::optim::FusedAdamW;
  using torchmoe::optim::FusedAdamWOptions;
  const int64_t m = shape.tokens * shape.topk, n = 2 * shape.ffn, k = shape.hidden;
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torchmoe::SplitSizes splits = uniform_splits(m, shape.experts);
  torch::manual_seed(0);
  torchmoe::GroupedLinear layer(torchmoe::GroupedLinearOptions(shape.experts, k, n)
                                    .bias(false)
                                    .params_dtype(torch::kBFloat16)
                                    .device(torch::kCUDA)
                                    .single_grouped_weight(true)
                                    .fuse_wgrad_accumulation(true)
                                    .fp8_amax_history_len(kHistory));
  const torch::Tensor weight = layer->weight_parameters()[0];
  const torch::Tensor master = weight.detach().to(torch::kFloat32).requires_grad_(true);
  master.mutable_grad() = layer->main_grads()[0];
  const FusedAdamWOptions adamw_options = FusedAdamWOptions(1e-6).weight_decay(0.1);
  FusedAdamW plain({master}, adamw_options), writing({master}, adamw_options);
  plain.set_model_copy(master, weight);
  writing.set_model_copy(master, weight);
  writing.set_fp8_weights(layer->fp8_weight_target(), {master});
  const torch::Tensor x = torch::randn({m, k}, bf16).requires_grad_(true);
  const torch::Tensor dy = torch::randn({m, n}, bf16);
  const fp8::DelayedScaling delayed = fp8::DelayedScaling().amax_history_len(kHistory);
  auto fwd_bwd = [&](bool fp8_on) {
    x.mutable_grad() = torch::Tensor();
    torch::Tensor y;
    {
      const fp8::Autocast guard(fp8::Recipe(delayed), fp8_on);
      y = layer(x, splits);
    }
    y.backward(dy);
    if (fp8_on) {
      fp8::update_delayed_scaling(*layer, delayed, fp8::Pass::kForward);
      fp8::update_delayed_scaling(*layer, delayed, fp8::Pass::kBackward);
    }
  };
  // In this order: the writing optimizer's step leaves FP8 weights that the next forward reads;
  // the casting column then moves the weight's version counter (no pass over it), so that its
  // forward casts the weights, until the writing optimizer's next step.
  const auto casting = [&] {
    torch::autograd::impl::bump_version(weight);
    fwd_bwd(true);
  };
  const std::vector<std::function<void()>> fns = {[&] { plain.step(); }, [&] { fwd_bwd(false); },
                                                  [&] { writing.step(); }, [&] { fwd_bwd(true); },
                                                  casting};
  const std::vector<double> ms = median_ms_each(fns, args.iters, args.warmup);
  // In the order timed: each run finds the weights as its turns did.
  const std::vector<double> gib = peaks_gib(fns);
  StepRecord r{shape.name,
               {ms[1], ms[4], ms[3], ms[0], ms[2]},
               {gib[1], gib[4], gib[3], gib[0], gib[2]},
               0.0,
               0.0,
               0.0};
  r.fwd_bwd_ratio = ms[1] / ms[3];
  r.step_ratio_cast = (ms[1] + ms[0]) / (ms[4] + ms[0]);
  r.step_ratio_optimizer_weights = (ms[1] + ms[0]) / (ms[3] + ms[2]);
  return r;
}

// The module table's rows of one shape (fwd, then fwd+bwd), printed and appended to `records`;
// false when an FP8 column's output is not near bf16's.
bool measure_module(const Shape& shape, const torchmoe::bench::Args& args,
                    std::vector<Record>& records) {
  const fp8::DelayedScaling delayed = fp8::DelayedScaling().amax_history_len(kHistory);
  const std::optional<fp8::Recipe> recipes[kNumColumns] = {std::nullopt,
                                                           std::nullopt,
                                                           fp8::Recipe(delayed),
                                                           fp8::Recipe(fp8::CurrentScaling()),
                                                           fp8::Recipe(fp8::BlockScaling()),
                                                           fp8::Recipe(delayed),
                                                           fp8::Recipe(delayed),
                                                           fp8::Recipe(delayed),
                                                           fp8::Recipe(delayed)};
  const bool grouped_loaded = torchmoe::loaded_cublaslt().grouped;
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  {
    const int64_t m = shape.tokens * shape.topk, n = 2 * shape.ffn, k = shape.hidden;
    const torchmoe::SplitSizes splits = uniform_splits(m, shape.experts);
    torch::manual_seed(0);
    const auto options = torchmoe::GroupedLinearOptions(shape.experts, k, n)
                             .bias(false)
                             .params_dtype(torch::kBFloat16)
                             .device(torch::kCUDA);
    // One layer for kAuto and its delayed-scaling state; ones with the same weights forced to
    // per-group cuBLASLt and to the grouped matmul.
    torchmoe::GroupedLinear layer(
        torchmoe::GroupedLinearOptions(options).fp8_amax_history_len(kHistory));
    torchmoe::GroupedLinear lt_layer(
        torchmoe::GroupedLinearOptions(options).fp8_amax_history_len(kHistory).gemm_backend(
            torchmoe::GemmBackend::kCublasLt));
    torchmoe::GroupedLinear sm90_layer(
        torchmoe::GroupedLinearOptions(options).fp8_amax_history_len(kHistory).gemm_backend(
            torchmoe::GemmBackend::kSm90));
    torchmoe::GroupedLinear grouped_layer(
        torchmoe::GroupedLinearOptions(options).fp8_amax_history_len(kHistory).gemm_backend(
            torchmoe::GemmBackend::kCublasLtGrouped));
    {
      torch::NoGradGuard no_grad;
      const std::vector<torch::Tensor> from = layer->expert_weights();
      for (torchmoe::GroupedLinear* other : {&lt_layer, &sm90_layer, &grouped_layer}) {
        const std::vector<torch::Tensor> to = (*other)->expert_weights();
        for (size_t e = 0; e < from.size(); ++e) to[e].copy_(from[e]);
      }
    }
    const torch::Tensor x = torch::randn({m, k}, bf16).requires_grad_(true);
    const torch::Tensor dy = torch::randn({m, n}, bf16);

    // One training step of one column: forward (under its recipe), backward, the delayed update.
    auto step = [&](size_t column, bool backward) {
      torchmoe::GroupedLinear& l = column == 1 || column == kPerGroupColumn ? lt_layer
                                   : column == kSm90Column                  ? sm90_layer
                                   : column == kGroupedColumn               ? grouped_layer
                                                                            : layer;
      l->zero_grad();  // set to none: nothing accumulates
      x.mutable_grad() = torch::Tensor();
      torch::Tensor y;
      {
        const fp8::Autocast guard(recipes[column].value_or(fp8::Recipe(delayed)),
                                  recipes[column].has_value());
        y = l(x, splits,
              column == kCachedColumn ? std::optional<bool>(false) : std::optional<bool>());
      }
      if (backward) y.backward(dy);
      if (column == 2 || column >= kCachedColumn) {
        fp8::update_delayed_scaling(*l, delayed, fp8::Pass::kForward);
        if (backward) fp8::update_delayed_scaling(*l, delayed, fp8::Pass::kBackward);
      }
      return y;
    };

    // One correctness look per shape: each FP8 column's output near bf16's (e4m3 quantization
    // leaves ~0.04 relative error; a wrong scale is off by orders of magnitude). The delayed one
    // after a calibration step (its first step casts with scale 1).
    step(2, true);
    step(kPerGroupColumn, true);
    step(kSm90Column, true);
    if (grouped_loaded) step(kGroupedColumn, true);
    {
      // fp8_cached's weights: the first micro-batch's call quantizes and keeps them.
      const fp8::Autocast guard{fp8::Recipe(delayed)};
      layer(x, splits, true);
    }
    const torch::Tensor reference = step(0, false).detach().to(torch::kFloat);
    for (size_t column = 2; column < kNumColumns; ++column) {
      if (column == kGroupedColumn && !grouped_loaded) continue;
      const torch::Tensor y = step(column, false).detach().to(torch::kFloat);
      const double rel = ((y - reference).norm() / reference.norm()).item<double>();
      if (!(rel < 0.1)) {
        std::cerr << "bench_grouped_linear_fp8: " << shape.name << " " << kColumns[column]
                  << " output is off bf16 by " << rel << " (relative Frobenius)\n";
        return false;
      }
    }

    // TORCHMOE_BENCH_TRACE: Kineto traces of bf16's, fp8_sm90's and fp8_block's training steps
    // (the kernels' times).
    torchmoe::bench::trace_if_asked(shape.name + ".bf16", [&] { step(0, true); });
    torchmoe::bench::trace_if_asked(shape.name + ".fp8_sm90", [&] { step(kSm90Column, true); });
    torchmoe::bench::trace_if_asked(shape.name + ".fp8_block", [&] { step(kBlockColumn, true); });

    const double gemm_flops = 2.0 * static_cast<double>(m) * n * k;
    for (const bool backward : {false, true}) {
      std::vector<std::function<void()>> fns;
      for (size_t column = 0; column < kNumColumns; ++column) {
        if (column == kGroupedColumn && !grouped_loaded) continue;
        fns.push_back([&, column, backward] { step(column, backward); });
      }
      std::vector<double> ms = median_ms_each(fns, args.iters, args.warmup);
      std::vector<double> gib = peaks_gib(fns);
      if (!grouped_loaded) {  // not measured
        ms.push_back(NAN);
        gib.push_back(NAN);
      }
      const double flops = (backward ? 3.0 : 1.0) * gemm_flops;
      Record r{shape.name, backward ? "fwd+bwd" : "fwd", shape.experts, m, n, k, {}, gib};
      for (double t : ms) r.tflops.push_back(flops / t * 1e-9);
      const std::vector<double>& t = r.tflops;
      std::cout << std::left << std::setw(17) << r.shape << std::setw(9) << r.pass << std::right
                << std::fixed << std::setprecision(1);
      for (double v : t) std::cout << std::setw(15) << v;
      std::cout << std::setprecision(3) << std::setw(10) << t[2] / t[0] << std::setw(10)
                << t[3] / t[0] << std::setw(10) << t[4] / t[0] << std::setw(10) << t[5] / t[0]
                << std::setw(10) << t[8] / t[0] << std::setw(10) << t[7] / t[6]
                << std::setprecision(2);
      for (double g : r.peak_gib) std::cout << std::setw(10) << g;
      std::cout << "\n";
      records.push_back(std::move(r));
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup = torchmoe::bench::setup(
      argc, argv, "bench_grouped_linear_fp8", {"bench_grouped_linear_fp8.json", 20});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  const std::string device = at::cuda::getCurrentDeviceProperties()->name;
  std::cout << "device: " << device
            << ", GroupedLinear module (bf16 params, no bias, uniform splits), TFLOP/s; "
               "ceilings (H100 SXM spec, dense): bf16 "
            << kSpecBf16Dense << ", FP8 " << kSpecFp8Dense
            << "; then the peak GiB of one step of each column\n"
            << std::left << std::setw(17) << "shape" << std::setw(9) << "pass" << std::right;
  for (const char* column : kColumns) std::cout << std::setw(15) << column;
  std::cout << std::setw(10) << "dly/bf16" << std::setw(10) << "cur/bf16" << std::setw(10)
            << "blk/bf16" << std::setw(10) << "cch/bf16" << std::setw(10) << "grp/bf16"
            << std::setw(10) << "sm90/lt8";
  for (const char* column : kColumnsShort)
    std::cout << std::setw(10) << std::string(column) + " GiB";
  std::cout << "\n";

  std::vector<Record> records;
  for (const Shape& shape : torchmoe::bench::selected_shapes(args)) {
    if (!measure_module(shape, args, records)) return 1;
  }

  // The products table runs our FP8 products on the sm90 kernel: sm_90 devices only.
  const bool sm90 = at::cuda::getCurrentDeviceProperties()->major == 9;
  if (sm90) {
    std::cout << "\nthe products alone (operands made once; FP8 on the sm90 kernel), TFLOP/s, then "
                 "the peak GiB of one call of each\n"
              << std::left << std::setw(17) << "shape" << std::right;
    for (const char* column : kProductColumns) std::cout << " " << std::setw(12) << column;
    std::cout << std::setw(10) << "fp8/bf16" << std::setw(10) << "fast/bf16" << std::setw(11)
              << "fp8/scaled";
    for (const char* column : kProductColumnsShort) {
      std::cout << std::setw(11) << std::string(column) + " GiB";
    }
    std::cout << "\n";
  } else {
    std::cout << "\nthe products alone: not measured (they need the sm90 kernel, an sm_90 GPU)\n";
  }
  std::vector<ProductRecord> products;
  for (const Shape& shape : sm90 ? torchmoe::bench::selected_shapes(args) : std::vector<Shape>{}) {
    ProductRecord r = measure_products(shape, args);
    std::cout << std::left << std::setw(17) << r.shape << std::right << std::fixed
              << std::setprecision(1);
    for (double v : r.tflops) std::cout << " " << std::setw(12) << v;
    std::cout << std::setprecision(3) << std::setw(10) << r.fp8_over_bf16_geomean << std::setw(10)
              << r.fp8_fast_over_bf16_geomean << std::setw(11)
              << r.fp8_fprop_over_scaled_grouped_mm;
    for (double g : r.peak_gib) std::cout << std::setw(11) << g;
    std::cout << "\n";
    products.push_back(std::move(r));
  }

  std::cout
      << "\ntraining steps with FusedAdamW (one layer, single grouped weight, fp32 master), "
         "ms; bf16 over FP8: fwd+bwd with the optimizer's FP8 weights, a step casting, a "
         "step with the optimizer's FP8 weights; then the peak GiB of one run of each column\n"
      << std::left << std::setw(17) << "shape" << std::right;
  for (const char* column : kStepColumns) std::cout << " " << std::setw(12) << column;
  std::cout << std::setw(10) << "fwdbwd" << std::setw(10) << "step cast" << std::setw(10)
            << "step opt";
  for (const char* column : kStepColumnsShort) {
    std::cout << std::setw(12) << std::string(column) + " GiB";
  }
  std::cout << "\n";
  std::vector<StepRecord> steps;
  for (const Shape& shape : torchmoe::bench::selected_shapes(args)) {
    StepRecord r = measure_training_steps(shape, args);
    std::cout << std::left << std::setw(17) << r.shape << std::right << std::fixed
              << std::setprecision(3);
    for (double v : r.ms) std::cout << " " << std::setw(12) << v;
    std::cout << std::setw(10) << r.fwd_bwd_ratio << std::setw(10) << r.step_ratio_cast
              << std::setw(10) << r.step_ratio_optimizer_weights;
    for (double g : r.peak_gib) std::cout << std::setw(12) << g;
    std::cout << "\n";
    steps.push_back(std::move(r));
  }

  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << device
       << "\",\n  \"params_dtype\": \"bfloat16\",\n  \"unit\": \"TFLOP/s\",\n"
       << "  \"flops\": \"fwd: 2*M*N*K; fwd+bwd: 3*2*M*N*K\",\n"
       << "  \"spec_dense_tflops\": {\"bf16\": " << kSpecBf16Dense << ", \"fp8\": " << kSpecFp8Dense
       << ", \"device\": \"H100 SXM\"},\n  \"amax_history_len\": " << kHistory
       << ",\n  \"results\": [\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    json << "    {\"shape\": \"" << r.shape << "\", \"pass\": \"" << r.pass
         << "\", \"experts\": " << r.experts << ", \"m\": " << r.m << ", \"n\": " << r.n
         << ", \"k\": " << r.k;
    for (size_t c = 0; c < kNumColumns; ++c) {
      json << ", \"" << kColumns[c] << "\": ";
      json_number(json, r.tflops[c]);
    }
    json << ", \"fp8_delayed_over_bf16\": " << r.tflops[2] / r.tflops[0]
         << ", \"fp8_current_over_bf16\": " << r.tflops[3] / r.tflops[0]
         << ", \"fp8_block_over_bf16\": " << r.tflops[4] / r.tflops[0]
         << ", \"fp8_cached_over_bf16\": " << r.tflops[5] / r.tflops[0]
         << ", \"fp8_sm90_over_fp8_cublaslt\": " << r.tflops[7] / r.tflops[6];
    for (size_t c = 0; c < kNumColumns; ++c) {
      json << ", \"" << kColumns[c] << "_peak_gib\": ";
      json_number(json, r.peak_gib[c]);
    }
    json << "}" << (i + 1 < records.size() ? "," : "") << "\n";
  }
  json << "  ],\n  \"products\": [\n";
  for (size_t i = 0; i < products.size(); ++i) {
    const ProductRecord& r = products[i];
    json << "    {\"shape\": \"" << r.shape << "\"";
    for (size_t c = 0; c < kNumProductColumns; ++c) {
      json << ", \"" << kProductColumns[c] << "\": " << r.tflops[c];
    }
    json << ", \"fp8_over_bf16_geomean\": " << r.fp8_over_bf16_geomean
         << ", \"fp8_fast_over_bf16_geomean\": " << r.fp8_fast_over_bf16_geomean
         << ", \"fp8_fprop_over_scaled_grouped_mm\": " << r.fp8_fprop_over_scaled_grouped_mm;
    for (size_t c = 0; c < kNumProductColumns; ++c) {
      json << ", \"" << kProductColumns[c] << "_peak_gib\": " << r.peak_gib[c];
    }
    json << "}" << (i + 1 < products.size() ? "," : "") << "\n";
  }
  json << "  ],\n  \"training_steps_ms\": [\n";
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepRecord& r = steps[i];
    json << "    {\"shape\": \"" << r.shape << "\"";
    for (size_t c = 0; c < kNumStepColumns; ++c) {
      json << ", \"" << kStepColumns[c] << "\": " << r.ms[c];
    }
    json << ", \"bf16_over_fp8_optimizer_weights_fwd_bwd\": " << r.fwd_bwd_ratio
         << ", \"bf16_over_fp8_step_cast\": " << r.step_ratio_cast
         << ", \"bf16_over_fp8_step_optimizer_weights\": " << r.step_ratio_optimizer_weights;
    for (size_t c = 0; c < kNumStepColumns; ++c) {
      json << ", \"" << kStepColumns[c] << "_peak_gib\": " << r.peak_gib[c];
    }
    json << "}" << (i + 1 < steps.size() ? "," : "") << "\n";
  }
  json << "  ]\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
