#pragma once
// Helpers of the FP8 grouped GEMM op tests (test_grouped_gemm_fp8.cpp,
// test_grouped_gemm_fp8_errors.cpp): the dequantizer that reads split_quantize's layouts
// independently of the op, the scaling and shape cases, quantized operands, FP8 plans, problems and
// the accumulation tolerance.

#include <torchmoe/kernels/split_quantize.h>
#include <torchmoe/ops/grouped_gemm.h>
#include <torchmoe/ops/grouped_gemm_fp8.h>
#include <torchmoe/ops/quantize.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "ops/fp8_reference.h"
#include "test_utils.h"

namespace torchmoe::test::fp8_gemm {

using torchmoe::GemmBackend;
using torchmoe::SplitSizes;
using torchmoe::kernels::round_up_columnwise;
using torchmoe::ops::Fp8Format;
using torchmoe::ops::GroupedTensors;
using torchmoe::ops::QuantizeScaling;
using torchmoe::ops::SplitQuantized;
using torchmoe::ops::SplitQuantizeOptions;
namespace ops = torchmoe::ops;

inline constexpr int64_t kBlock = 128;
inline constexpr auto kE4M3 = Fp8Format::kE4M3;
inline constexpr auto kE5M2 = Fp8Format::kE5M2;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t r4(int64_t n) { return ceil_div(n, 4) * 4; }
inline double format_max(Fp8Format f) { return f == kE4M3 ? 448.0 : 57344.0; }
inline const char* format_name(Fp8Format f) { return f == kE4M3 ? "e4m3" : "e5m2"; }

// ---- Dequantizer: split_quantize's layouts (kernels/split_quantize.h), read back ---------------

// Which entries of a [m, kk] matrix (one split) each scale covers, expanded to one scale per
// element: `per_block` [rows_of_blocks, cols_of_blocks] with blocks of `br` rows and `bc` columns.
inline torch::Tensor expand_blocks(const torch::Tensor& per_block, int64_t br, int64_t bc,
                                   int64_t m, int64_t kk) {
  const torch::Tensor rows = per_block.repeat_interleave(br, 0).narrow(0, 0, m);
  return rows.repeat_interleave(bc, 1).narrow(1, 0, kk);
}

// The [rows, k] float64 matrix that one copy of `q` encodes (rows = Σ sizes): the rowwise copy as
// it is, the columnwise copy (split g's transpose [k, r16(m_g)] at element k·Σ_{h<g} r16(m_h))
// transposed back, each element times its scale_inv (per split, per 1x128 block or per 128×128
// tile, at the offsets of the layout comment).
inline torch::Tensor dequantize(const SplitQuantized& q, bool rowwise,
                                const std::vector<int64_t>& sizes, int64_t k) {
  const bool block = torchmoe::kernels::is_block_scaling(q.scaling);
  const torch::Tensor data =
      (rowwise ? q.data : q.columnwise_data).cpu().to(torch::kFloat).to(torch::kFloat64).view(-1);
  const torch::Tensor scales =
      (rowwise || !block ? q.scale_inv : q.columnwise_scale_inv).cpu().to(torch::kFloat64);
  int64_t rows = 0;
  for (int64_t m : sizes) rows += m;
  torch::Tensor out = torch::zeros({rows, k}, torch::kFloat64);
  const int64_t kb = ceil_div(k, kBlock);
  // Σ_{h<g} of: m_h, r16(m_h), r4(m_h), ceil(m_h/128), r4(ceil(m_h/128)).
  int64_t start = 0, rows16 = 0, rows4 = 0, tiles = 0, tiles4 = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const int64_t m = sizes[g], mb = ceil_div(m, kBlock), m16 = round_up_columnwise(m);
    if (m > 0) {
      const torch::Tensor values =
          rowwise ? data.narrow(0, k * start, k * m).view({m, k})
                  : data.narrow(0, k * rows16, k * m16).view({k, m16}).narrow(1, 0, m).t();
      torch::Tensor s;  // [m, k]: each element's scale_inv
      switch (q.scaling) {
        case QuantizeScaling::kCurrent:
        case QuantizeScaling::kDelayed:
          s = scales[static_cast<int64_t>(g)].expand({m, k});
          break;
        case QuantizeScaling::kBlock1x128:
          s = rowwise
                  // [KB, r4(m)] at KB·Σ r4(m_h): s[kb][r] covers row r, columns of block kb
                  ? expand_blocks(scales.narrow(0, kb * rows4, kb * r4(m))
                                      .view({kb, r4(m)})
                                      .narrow(1, 0, m)
                                      .t(),
                                  1, kBlock, m, k)
                  // [MB, r4(k)] at r4(k)·Σ MB_h: s[mb][c] covers column c, rows of block mb
                  : expand_blocks(scales.narrow(0, r4(k) * tiles, mb * r4(k))
                                      .view({mb, r4(k)})
                                      .narrow(1, 0, k),
                                  kBlock, 1, m, k);
          break;
        case QuantizeScaling::kBlock128x128:
          s = rowwise
                  // [MB, r4(KB)] at r4(KB)·Σ MB_h: s[mb][kb]
                  ? expand_blocks(scales.narrow(0, r4(kb) * tiles, mb * r4(kb))
                                      .view({mb, r4(kb)})
                                      .narrow(1, 0, kb),
                                  kBlock, kBlock, m, k)
                  // [KB, r4(MB)] at KB·Σ r4(MB_h): s[kb][mb], the same values transposed
                  : expand_blocks(scales.narrow(0, kb * tiles4, kb * r4(mb))
                                      .view({kb, r4(mb)})
                                      .narrow(1, 0, mb)
                                      .t(),
                                  kBlock, kBlock, m, k);
          break;
      }
      out.narrow(0, start, m).copy_(values * s);
    }
    start += m;
    rows16 += m16;
    rows4 += r4(m);
    tiles += mb;
    tiles4 += r4(mb);
  }
  return out;
}

// ---- Problems and their quantized operands -----------------------------------------------------

struct ScalingCase {
  const char* name;
  QuantizeScaling input, weight, grad;
};

inline const ScalingCase kScalingCases[] = {
    {"current", QuantizeScaling::kCurrent, QuantizeScaling::kCurrent, QuantizeScaling::kCurrent},
    {"delayed", QuantizeScaling::kDelayed, QuantizeScaling::kDelayed, QuantizeScaling::kDelayed},
    {"block: 1x128 input and grad, 128x128 weight", QuantizeScaling::kBlock1x128,
     QuantizeScaling::kBlock128x128, QuantizeScaling::kBlock1x128},
    {"block: all 1x128", QuantizeScaling::kBlock1x128, QuantizeScaling::kBlock1x128,
     QuantizeScaling::kBlock1x128},
};

struct ShapeCase {
  const char* name;
  std::vector<int64_t> sizes;
  int64_t n, k;
};

inline const ShapeCase kShapeCases[] = {
    {"splits {37, 0, 128, 5, 211}, K 208, N 144", {37, 0, 128, 5, 211}, 144, 208},
    {"splits {128, 0, 256, 384}, K 256, N 384", {128, 0, 256, 384}, 384, 256},
};

inline int64_t total(const std::vector<int64_t>& sizes) {
  int64_t sum = 0;
  for (int64_t m : sizes) sum += m;
  return sum;
}

// [Σ sizes, cols] bf16 on the GPU: normal values times 2^[-3, 3] per row, per 32 columns and per
// split, so that neighbouring rows, 128-column blocks, 128-row blocks and splits get different
// scales and taking a neighbour's scale is far off.
inline torch::Tensor spread(const std::vector<int64_t>& sizes, int64_t cols, double base,
                            uint64_t seed) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t rows = total(sizes);
  torch::Tensor x = torch::randn({rows, cols}, gen) * base;
  x *= torch::pow(2.0, torch::randint(-3, 4, {rows, 1}, gen).to(torch::kFloat));
  x *= torch::pow(2.0, torch::randint(-3, 4, {1, ceil_div(cols, 32)}, gen).to(torch::kFloat))
           .repeat_interleave(32, 1)
           .narrow(1, 0, cols);
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    x.narrow(0, start, sizes[g]).mul_(std::pow(2.0, static_cast<double>(g % 4) - 1.5));
    start += sizes[g];
  }
  return x.to(torch::kBFloat16).to(torch::kCUDA);
}

// Delayed scales as an amax history would give them, off by 2^-2 .. 2^1 per split: some splits
// saturate, some use less of the range (the GEMM must dequantize with whatever scale was used).
inline torch::Tensor delayed_scale(const torch::Tensor& t, const std::vector<int64_t>& sizes,
                                   Fp8Format f) {
  std::vector<float> scale;
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const double amax =
        sizes[g] == 0 ? 0.0 : t.narrow(0, start, sizes[g]).abs().max().item<double>();
    scale.push_back(amax == 0.0
                        ? 1.0f
                        : static_cast<float>(format_max(f) / amax *
                                             std::pow(2.0, static_cast<double>(g % 4) - 2)));
    start += sizes[g];
  }
  return torch::tensor(scale, torch::kFloat).to(torch::kCUDA);
}

// The split-quantize options of one operand.
inline SplitQuantizeOptions quantize_options(QuantizeScaling s, Fp8Format f, bool rowwise,
                                             bool columnwise) {
  SplitQuantizeOptions o;
  o.format = f;
  o.scaling = s;
  o.rowwise = rowwise;
  o.columnwise = columnwise;
  return o;
}

inline SplitQuantized quantize(const torch::Tensor& t, const std::vector<int64_t>& sizes,
                               QuantizeScaling s, Fp8Format f, bool rowwise = true,
                               bool columnwise = true) {
  const SplitQuantizeOptions o = quantize_options(s, f, rowwise, columnwise);
  const torch::Tensor scale =
      s == QuantizeScaling::kDelayed ? delayed_scale(t, sizes, f) : torch::Tensor();
  return ops::split_quantize(t, sizes, o, scale);
}

// w: [G, n, k], quantized by quantize_weights (stacked).
inline SplitQuantized quantize_w(const torch::Tensor& w, QuantizeScaling s, Fp8Format f = kE4M3,
                                 bool rowwise = true, bool columnwise = true) {
  const int64_t groups = w.size(0), n = w.size(1), k = w.size(2);
  const SplitQuantizeOptions o = quantize_options(s, f, rowwise, columnwise);
  const torch::Tensor scale =
      s == QuantizeScaling::kDelayed
          ? delayed_scale(w.view({groups * n, k}), std::vector<int64_t>(groups, n), f)
          : torch::Tensor();
  return ops::quantize_weights(GroupedTensors::stacked(w), o, scale);
}

// The FP8 options of a plan for operands quantized with these scalings (input and weights e4m3,
// grad_output in grad_format); every product's accumulation as Fp8GemmOptions' defaults (TE's:
// fprop fast, dgrad and wgrad split), which a case may change.
inline ops::Fp8GemmOptions fp8_options(QuantizeScaling input, QuantizeScaling weight,
                                       QuantizeScaling grad, Fp8Format grad_format = kE5M2) {
  ops::Fp8GemmOptions o;
  o.input.scaling = input;
  o.weight.scaling = weight;
  o.grad_output.scaling = grad;
  o.grad_output.format = grad_format;
  return o;
}
inline ops::Fp8GemmOptions fp8_options(const ScalingCase& sc, Fp8Format grad_format = kE5M2) {
  return fp8_options(sc.input, sc.weight, sc.grad, grad_format);
}

// backend: kCublasLt (per-group matmuls), kCublasLtGrouped (one grouped matmul per product for
// per-tensor scales; block scales run per group) or kSm90 (our kernel, for per-tensor scales and
// for 1x128 activations and gradients with 128x128 weights in fprop and dgrad and 1x128 inputs in
// wgrad; the all-1x128 case runs fprop and dgrad per group), as the plan decides per product from
// `options` (by default current scaling, e5m2 gradients).
inline ops::GemmPlan fp8_plan(const torch::Tensor& x, int64_t n, int64_t k,
                              const std::vector<int64_t>& sizes,
                              GemmBackend backend = GemmBackend::kCublasLt,
                              const ops::Fp8GemmOptions& options =
                                  fp8_options(QuantizeScaling::kCurrent, QuantizeScaling::kCurrent,
                                              QuantizeScaling::kCurrent)) {
  return ops::plan_grouped_gemms("test", x, {ops::GemmShape{n, k, sizes.size()}}, SplitSizes(sizes),
                                 backend, torch::Tensor(), options)
      .front();
}

inline const char* backend_name(GemmBackend backend) {
  return backend == GemmBackend::kCublasLtGrouped ? "cuBLASLt grouped"
         : backend == GemmBackend::kSm90          ? "sm90"
                                                  : "per-group cuBLASLt";
}

struct Problem {
  std::vector<int64_t> sizes;
  int64_t n, k, groups;
  torch::Tensor x, w, dy;  // [M, k], [G, n, k], [M, n] bf16 on the GPU
};

inline Problem make_problem(const ShapeCase& shape, uint64_t seed) {
  Problem p{shape.sizes, shape.n, shape.k, static_cast<int64_t>(shape.sizes.size()), {}, {}, {}};
  p.x = spread(p.sizes, p.k, 1.0, seed);
  p.w = spread(std::vector<int64_t>(p.groups, p.n), p.k, 0.05, seed + 1).view({p.groups, p.n, p.k});
  p.dy = spread(p.sizes, p.n, 0.2, seed + 2);
  return p;
}

// ---- Reference products and the comparison -----------------------------------------------------

// Every engine accumulates as cuBLASLt does: fast accumulation where asked (fprop's default),
// split accumulation otherwise; block scales have no fast-accumulation kernel (the flag is
// ignored there).
inline double accumulation_tol(bool fast, const ScalingCase& sc) {
  return fast && !torchmoe::kernels::is_block_scaling(sc.input) ? kFastAccumulationTol
                                                                : kAccumulationTol;
}

inline void check_product(const torch::Tensor& actual, const Product& ref, torch::Dtype out_dtype,
                          double acc_tol, const std::string& what) {
  REQUIRE(actual.scalar_type() == out_dtype);
  check_within(actual, ref.value, output_rtol(out_dtype) * ref.value.abs() + acc_tol * ref.abs_sum,
               what);
}

inline std::string describe(const ScalingCase& s, const ShapeCase& shape) {
  return std::string(s.name) + "; " + shape.name;
}

}  // namespace torchmoe::test::fp8_gemm
