// FP8 split-quantize bandwidth on the fc1 inputs of the benchmark MoE shapes (M = tokens·topk
// rows of width K = hidden, bf16, E uniform splits given on the device), rowwise + columnwise
// e4m3 copies, for each scaling, next to a device-to-device copy of the input in the same process
// (the measurements take turns, bench_common.h).
//
//   bench_split_quantize [--json PATH] [--iters N] [--warmup N] [--shapes a,b,...]
//
// Bytes counted (each tensor once): the input [M, K] read, both FP8 copies [M, K] written, and the
// scales and amaxes written, so that the copy of the input (read 2MK, write 2MK bytes) moves the
// same data bytes. Current scaling reads a tile twice where its split is too large for the blocks
// to keep it until the split's amax is complete (docs/fp8.md), which the count does not include.
//
// Then fc2's input in an FP8 GroupedMLP: the scaled SwiGLU of the [M, 2·ffn] pre-activation cast
// to both e4m3 copies with delayed scaling, as glu_forward then split_quantize (the bf16
// activation written and read back) and as one glu_split_quantize; GB/s counts the pre-activation
// read and the two FP8 copies written (6·M·ffn bytes), against a copy in the same run.
//
// Then fc1's input in an FP8 MoE layer: T token rows [T, K] (random top-k routing over E experts)
// to both e4m3 copies of the M = T·k rows in expert order with delayed scaling, as permute_rows
// then split_quantize (the bf16 permuted copy written and read back) and as one
// gather_split_quantize; GB/s counts the tokens read once and the two FP8 copies written
// ((2·T + 2·M)·K bytes), against a copy of [M, K] in the same run.
//
// Then fc1's output gradient in an FP8 GroupedMLP with delayed scaling: the SwiGLU's input
// gradient from dy [M, ffn] and the pre-activation [M, 2·ffn], cast to both e4m3 copies, as
// glu_backward then split_quantize and as glu_backward_split_quantize's fused launch at every size
// (the op itself takes the two ops under current scaling and below 8 waves of tiles,
// ops/quantize.h); GB/s counts dy and the pre-activation read and the two
// FP8 copies written (10·M·ffn bytes), against a copy of [M, 2·ffn] in the same run.
//
// Every row also gives the peak memory of one run of each of its measurements (GiB columns, in the
// order of the times; JSON <measurement>_peak_gib): the caching allocator's peak above what was
// allocated before it (bench_common.h's peak_gib): the casts' outputs, and in the two ops' case
// the bf16 intermediate too.

#include <ATen/cuda/CUDAContext.h>
#include <torchmoe/ops/glu.h>
#include <torchmoe/ops/quantize.h>
#include <torchmoe/ops/token_permutation.h>

#include "bench_common.h"

#include <torch/torch.h>

#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

namespace {

using torchmoe::ops::QuantizeScaling;

struct Scaling {
  const char* name;
  const char* short_name;  // the GiB column's
  QuantizeScaling scaling;
};

constexpr Scaling kScalings[] = {{"current", "cur", QuantizeScaling::kCurrent},
                                 {"delayed", "dly", QuantizeScaling::kDelayed},
                                 {"block1x128", "1x128", QuantizeScaling::kBlock1x128},
                                 {"block128x128", "128x128", QuantizeScaling::kBlock128x128}};

// Scale elements written (both copies) besides the data: per tensor [G] (+ amax [G]); blocks the
// defined entries of both layouts for uniform splits.
double scale_bytes(QuantizeScaling s, int64_t m, int64_t k, int64_t groups) {
  const int64_t per = m / groups, kb = (k + 127) / 128, mb = (per + 127) / 128;
  int64_t elements = 2 * groups;  // amax, and scale_inv for per-tensor scalings
  if (s == QuantizeScaling::kBlock1x128) elements += groups * (kb * per + mb * k);
  if (s == QuantizeScaling::kBlock128x128) elements += groups * 2 * mb * kb;
  return 4.0 * static_cast<double>(elements);
}

// The fused-cast tables: a title, then per shape a copy's GB/s, the two ops' and the fused
// launch's times, the fused launch's GB/s, and the peak GiB of one run of each of the three.
void print_fused_header(const char* title) {
  std::cout << "\n"
            << title << "\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(9) << "copy"
            << std::setw(12) << "two ops ms" << std::setw(10) << "fused ms" << std::setw(9)
            << "speedup" << std::setw(10) << "fused" << std::setw(8) << "%copy" << std::setw(10)
            << "copy GiB" << std::setw(10) << "two GiB" << std::setw(10) << "fused GiB"
            << "\n";
}

// Times in ms and the peak GiB of one run of each of `fns` (bench_common.h), in their order.
struct Measured {
  std::vector<double> ms, gib;
};

Measured measure(const std::vector<std::function<void()>>& fns, const torchmoe::bench::Args& args) {
  Measured m{torchmoe::bench::median_ms_each(fns, args.iters, args.warmup), {}};
  for (const std::function<void()>& fn : fns) m.gib.push_back(torchmoe::bench::peak_gib(fn));
  return m;
}

// One row of a fused-cast table and its JSON object: {copy, two ops, fused} measured, the bytes
// each GB/s counts, and the object's leading fields (`sizes`).
void report_fused_row(std::ostream& json, const std::string& shape, const std::string& sizes,
                      const Measured& measured, double copy_bytes, double fused_bytes, bool last) {
  const std::vector<double>& ms = measured.ms;
  const std::vector<double>& gib = measured.gib;
  const double copy_gbs = copy_bytes / ms[0] * 1e-6;
  const double fused_gbs = fused_bytes / ms[2] * 1e-6;
  std::cout << std::left << std::setw(17) << shape << std::right << std::fixed
            << std::setprecision(0) << std::setw(9) << copy_gbs << std::setprecision(3)
            << std::setw(12) << ms[1] << std::setw(10) << ms[2] << std::setprecision(2)
            << std::setw(9) << ms[1] / ms[2] << std::setprecision(0) << std::setw(10) << fused_gbs
            << std::setw(7) << 100 * fused_gbs / copy_gbs << "%" << std::setprecision(3)
            << std::setw(10) << gib[0] << std::setw(10) << gib[1] << std::setw(10) << gib[2]
            << "\n";
  json << "    {\"shape\": \"" << shape << "\", " << sizes << ", \"copy\": " << copy_gbs
       << ", \"two_ops_ms\": " << ms[1] << ", \"fused_ms\": " << ms[2]
       << ", \"fused\": " << fused_gbs << ", \"copy_peak_gib\": " << gib[0]
       << ", \"two_ops_peak_gib\": " << gib[1] << ", \"fused_peak_gib\": " << gib[2] << "}"
       << (last ? "" : ",") << "\n";
}

// The fused-cast tables' cast: delayed scaling, a unit scale per split.
struct DelayedCast {
  torchmoe::ops::SplitQuantizeOptions options;
  torch::Tensor scale;
};

DelayedCast delayed_cast(int64_t groups) {
  DelayedCast c;
  c.options.scaling = QuantizeScaling::kDelayed;
  c.scale = torch::ones({groups}, torch::TensorOptions().device(torch::kCUDA));
  return c;
}

// The SwiGLU tables' operands for a shape: the bf16 pre-activation [M, 2·ffn], the fp32
// probabilities and E uniform device splits.
struct GluOperands {
  int64_t m, ffn;
  torch::Tensor z, probs;
  torchmoe::SplitSizes splits;
};

GluOperands glu_operands(const torchmoe::bench::Shape& shape) {
  const auto on_gpu = torch::TensorOptions().device(torch::kCUDA);
  const int64_t m = shape.tokens * shape.topk;
  return {m, shape.ffn, torch::randn({m, 2 * shape.ffn}, on_gpu.dtype(torch::kBFloat16)),
          torch::rand({m}, on_gpu),
          torchmoe::SplitSizes::uniform(shape.experts, m / shape.experts, torch::kCUDA)};
}

}  // namespace

int main(int argc, char** argv) {
  const torchmoe::bench::Setup setup =
      torchmoe::bench::setup(argc, argv, "bench_split_quantize", {"bench_split_quantize.json", 20});
  if (setup.exit_code != 0) return setup.exit_code;
  const torchmoe::bench::Args& args = setup.args;
  const std::string device = at::cuda::getCurrentDeviceProperties()->name;
  std::cout << "device: " << device
            << ", bf16 input -> e4m3 rowwise + columnwise, device splits (GB/s; copy = "
               "device-to-device copy of the input)\n"
            << std::left << std::setw(17) << "shape" << std::right << std::setw(9) << "copy";
  for (const Scaling& s : kScalings)
    std::cout << std::setw(14) << s.name << std::setw(8) << "%copy";
  std::cout << std::setw(10) << "copy GiB";
  for (const Scaling& s : kScalings)
    std::cout << std::setw(12) << std::string(s.short_name) + " GiB";
  std::cout << "\n";
  std::ofstream json(args.json_path);
  json << "{\n  \"device\": \"" << device << "\",\n  \"unit\": \"GB/s\",\n  \"results\": [\n";
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const std::vector<torchmoe::bench::Shape> shapes = torchmoe::bench::selected_shapes(args);
  for (size_t i = 0; i < shapes.size(); ++i) {
    const torchmoe::bench::Shape& shape = shapes[i];
    const int64_t m = shape.tokens * shape.topk, k = shape.hidden, groups = shape.experts;
    const torch::Tensor x = torch::randn({m, k}, bf16);
    torch::Tensor copy_dst = torch::empty_like(x);
    const torchmoe::SplitSizes splits =
        torchmoe::SplitSizes::uniform(groups, m / groups, torch::kCUDA);
    const torch::Tensor scale = torch::full({groups}, 1.0f, bf16.dtype(torch::kFloat));
    std::vector<std::function<void()>> fns = {[&] { copy_dst.copy_(x); }};
    for (const Scaling& s : kScalings) {
      torchmoe::ops::SplitQuantizeOptions o;
      o.scaling = s.scaling;
      const torch::Tensor sc = s.scaling == QuantizeScaling::kDelayed ? scale : torch::Tensor();
      fns.push_back([&x, &splits, o, sc] { torchmoe::ops::split_quantize(x, splits, o, sc); });
    }
    const Measured measured = measure(fns, args);
    const std::vector<double>& ms = measured.ms;
    const double data_bytes = 4.0 * static_cast<double>(m) * static_cast<double>(k);
    const double copy_gbs = data_bytes / ms[0] * 1e-6;
    std::cout << std::left << std::setw(17) << shape.name << std::right << std::fixed
              << std::setprecision(0) << std::setw(9) << copy_gbs;
    json << "    {\"shape\": \"" << shape.name << "\", \"rows\": " << m << ", \"k\": " << k
         << ", \"groups\": " << groups << ", \"copy\": " << copy_gbs;
    for (size_t s = 0; s < std::size(kScalings); ++s) {
      const double gbs =
          (data_bytes + scale_bytes(kScalings[s].scaling, m, k, groups)) / ms[s + 1] * 1e-6;
      std::cout << std::setw(14) << gbs << std::setw(7) << 100 * gbs / copy_gbs << "%";
      json << ", \"" << kScalings[s].name << "\": " << gbs;
    }
    std::cout << std::setprecision(3) << std::setw(10) << measured.gib[0];
    json << ", \"copy_peak_gib\": " << measured.gib[0];
    for (size_t s = 0; s < std::size(kScalings); ++s) {
      std::cout << std::setw(12) << measured.gib[s + 1];
      json << ", \"" << kScalings[s].name << "_peak_gib\": " << measured.gib[s + 1];
    }
    std::cout << "\n";
    json << "}" << (i + 1 < shapes.size() ? "," : "") << "\n";
  }
  json << "  ],\n  \"swiglu_delayed\": [\n";
  print_fused_header(
      "fc2's input: SwiGLU of [M, 2*ffn] with probs -> e4m3 rowwise + columnwise, delayed");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const GluOperands g = glu_operands(shapes[i]);
    const int64_t m = g.m, f = g.ffn;
    torch::Tensor copy_src = torch::randn({m, f}, bf16), copy_dst = torch::empty_like(copy_src);
    const DelayedCast cast = delayed_cast(shapes[i].experts);
    const torchmoe::ops::GluOptions glu;
    const Measured measured = measure(
        {[&] { copy_dst.copy_(copy_src); },
         [&] {
           torchmoe::ops::split_quantize(torchmoe::ops::glu_forward(g.z, g.probs, glu), g.splits,
                                         cast.options, cast.scale);
         },
         [&] {
           torchmoe::ops::glu_split_quantize(g.z, g.probs, glu, g.splits, cast.options, cast.scale);
         }},
        args);
    const double elements = static_cast<double>(m) * static_cast<double>(f);
    report_fused_row(json, shapes[i].name,
                     "\"rows\": " + std::to_string(m) + ", \"ffn\": " + std::to_string(f), measured,
                     4.0 * elements, 6.0 * elements, i + 1 == shapes.size());
  }
  json << "  ],\n  \"gather_delayed\": [\n";
  print_fused_header(
      "fc1's input in an MoE layer: T tokens -> the T*k rows in expert order -> e4m3 rowwise + "
      "columnwise, delayed");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const torchmoe::bench::Shape& shape = shapes[i];
    const int64_t t = shape.tokens, m = shape.tokens * shape.topk, k = shape.hidden;
    const torch::Tensor tokens = torch::randn({t, k}, bf16);
    const torch::Tensor indices =
        torch::randint(0, shape.experts, {t, shape.topk}, bf16.dtype(torch::kLong));
    const torchmoe::ops::RoutingMap map = torchmoe::ops::make_routing_map(indices, shape.experts);
    const torch::Tensor& source_rows = map.row_tokens;
    const torchmoe::SplitSizes splits = torchmoe::ops::split_sizes(map);
    torch::Tensor copy_src = torch::randn({m, k}, bf16), copy_dst = torch::empty_like(copy_src);
    const DelayedCast cast = delayed_cast(shape.experts);
    const Measured measured =
        measure({[&] { copy_dst.copy_(copy_src); },
                 [&] {
                   torchmoe::ops::split_quantize(
                       torchmoe::ops::permute_rows(tokens, map.row_map, map.sorted_slots, {}),
                       splits, cast.options, cast.scale);
                 },
                 [&] {
                   torchmoe::ops::gather_split_quantize(tokens, source_rows, splits, cast.options,
                                                        cast.scale);
                 }},
                args);
    report_fused_row(json, shape.name,
                     "\"tokens\": " + std::to_string(t) + ", \"rows\": " + std::to_string(m) +
                         ", \"k\": " + std::to_string(k),
                     measured, 4.0 * static_cast<double>(m) * k,
                     2.0 * static_cast<double>(t + m) * k, i + 1 == shapes.size());
  }
  json << "  ],\n  \"swiglu_backward_delayed\": [\n";
  print_fused_header(
      "fc1's output gradient: SwiGLU backward of dy [M, ffn] -> e4m3 rowwise + columnwise of "
      "[M, 2*ffn], delayed");
  for (size_t i = 0; i < shapes.size(); ++i) {
    const GluOperands g = glu_operands(shapes[i]);
    const int64_t m = g.m, f = g.ffn;
    const torch::Tensor dy = torch::randn({m, f}, bf16);
    torch::Tensor copy_src = torch::randn({m, 2 * f}, bf16), copy_dst = torch::empty_like(copy_src);
    const DelayedCast cast = delayed_cast(shapes[i].experts);
    const torchmoe::ops::GluOptions glu;
    const Measured measured =
        measure({[&] { copy_dst.copy_(copy_src); },
                 [&] {
                   torchmoe::ops::split_quantize(
                       torchmoe::ops::glu_backward(dy, g.z, g.probs, glu, true).grad_input,
                       g.splits, cast.options, cast.scale);
                 },
                 [&] {
                   torchmoe::ops::detail::glu_backward_split_quantize(
                       dy, g.z, g.probs, glu, true, g.splits, cast.options, cast.scale,
                       torch::Tensor(), 0.0);
                 }},
                args);
    const double elements = static_cast<double>(m) * static_cast<double>(f);
    report_fused_row(json, shapes[i].name,
                     "\"rows\": " + std::to_string(m) + ", \"ffn\": " + std::to_string(f), measured,
                     8.0 * elements, 10.0 * elements, i + 1 == shapes.size());
  }
  json << "  ]\n}\n";
  std::cout << "wrote " << args.json_path << "\n";
  return 0;
}
