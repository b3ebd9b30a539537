// FP8 grouped linear products (ops/grouped_gemm_fp8.h) against a float64 reference computed from
// the DEQUANTIZED operands: the FP8 bytes that split_quantize wrote, times their scale_inv, read
// back through the layouts of kernels/split_quantize.h by a dequantizer of this file (never by the
// op's own offset code). The only differences left are the GEMM's accumulation and the output's
// rounding, so the tolerance is tight and any scale or layout mistake (a missing scale_inv, a
// neighbouring block's scale, a split's offset) is many times over it.
//
// Axes (TE's tests/cpp/operator style):
//   scalings   per tensor current; per tensor delayed (given scales, some saturating); block:
//              1x128 input and grad with 128x128 weight (TE's Float8BlockScaling); block: all
//              1x128
//   shapes     splits {37, 0, 128, 5, 211} (an empty split, odd and prime sizes, sizes not
//              multiples of 16 or 128, a split of one full and one short 128-row block) with
//              K = 208, N = 144 (multiples of 16, not of 128: short last column blocks); and
//              splits {128, 0, 256, 384} with K = 256, N = 384 (everything multiple of 128)
//   outputs    bfloat16, float32
//   formats    forward e4m3 × e4m3; dgrad grad_output e4m3 or e5m2 × weight e4m3; wgrad
//              grad_output e4m3 or e5m2 × input e4m3
//   forward    fast accumulation on and off
// Plus: wgrad accumulation into fp32 buffers and its empty-split rule, biases, quantize_weights
// on separate vs stacked weights, and the refusals of the ops and of FP8 planning (the CPU one
// runs without a GPU).

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

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::GemmBackend;
using torchmoe::SplitSizes;
using torchmoe::kernels::round_up_columnwise;
using torchmoe::ops::Fp8Format;
using torchmoe::ops::GroupedTensors;
using torchmoe::ops::QuantizeScaling;
using torchmoe::ops::SplitQuantized;
using torchmoe::ops::SplitQuantizeOptions;
namespace ops = torchmoe::ops;

namespace {

constexpr int64_t kBlock = 128;
constexpr auto kE4M3 = Fp8Format::kE4M3;
constexpr auto kE5M2 = Fp8Format::kE5M2;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t r4(int64_t n) { return ceil_div(n, 4) * 4; }
double format_max(Fp8Format f) { return f == kE4M3 ? 448.0 : 57344.0; }
const char* format_name(Fp8Format f) { return f == kE4M3 ? "e4m3" : "e5m2"; }

// ---- Dequantizer: split_quantize's layouts (kernels/split_quantize.h), read back ---------------

// Which entries of a [m, kk] matrix (one split) each scale covers, expanded to one scale per
// element: `per_block` [rows_of_blocks, cols_of_blocks] with blocks of `br` rows and `bc` columns.
torch::Tensor expand_blocks(const torch::Tensor& per_block, int64_t br, int64_t bc, int64_t m,
                            int64_t kk) {
  const torch::Tensor rows = per_block.repeat_interleave(br, 0).narrow(0, 0, m);
  return rows.repeat_interleave(bc, 1).narrow(1, 0, kk);
}

// The [rows, k] float64 matrix that one copy of `q` encodes (rows = Σ sizes): the rowwise copy as
// it is, the columnwise copy (split g's transpose [k, r16(m_g)] at element k·Σ_{h<g} r16(m_h))
// transposed back, each element times its scale_inv (per split, per 1x128 block or per 128×128
// tile, at the offsets of the layout comment).
torch::Tensor dequantize(const SplitQuantized& q, bool rowwise, const std::vector<int64_t>& sizes,
                         int64_t k) {
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

const ScalingCase kScalingCases[] = {
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

const ShapeCase kShapeCases[] = {
    {"splits {37, 0, 128, 5, 211}, K 208, N 144", {37, 0, 128, 5, 211}, 144, 208},
    {"splits {128, 0, 256, 384}, K 256, N 384", {128, 0, 256, 384}, 384, 256},
};

int64_t total(const std::vector<int64_t>& sizes) {
  int64_t sum = 0;
  for (int64_t m : sizes) sum += m;
  return sum;
}

// [Σ sizes, cols] bf16 on the GPU: normal values times 2^[-3, 3] per row, per 32 columns and per
// split, so that neighbouring rows, 128-column blocks, 128-row blocks and splits get different
// scales and taking a neighbour's scale is far off.
torch::Tensor spread(const std::vector<int64_t>& sizes, int64_t cols, double base, uint64_t seed) {
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
torch::Tensor delayed_scale(const torch::Tensor& t, const std::vector<int64_t>& sizes,
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

SplitQuantized quantize(const torch::Tensor& t, const std::vector<int64_t>& sizes,
                        QuantizeScaling s, Fp8Format f, bool rowwise = true,
                        bool columnwise = true) {
  SplitQuantizeOptions o;
  o.format = f;
  o.scaling = s;
  o.rowwise = rowwise;
  o.columnwise = columnwise;
  const torch::Tensor scale =
      s == QuantizeScaling::kDelayed ? delayed_scale(t, sizes, f) : torch::Tensor();
  return ops::split_quantize(t, sizes, o, scale);
}

// w: [G, n, k], quantized by quantize_weights (stacked).
SplitQuantized quantize_w(const torch::Tensor& w, QuantizeScaling s, Fp8Format f = kE4M3,
                          bool rowwise = true, bool columnwise = true) {
  const int64_t groups = w.size(0), n = w.size(1), k = w.size(2);
  SplitQuantizeOptions o;
  o.format = f;
  o.scaling = s;
  o.rowwise = rowwise;
  o.columnwise = columnwise;
  const torch::Tensor scale =
      s == QuantizeScaling::kDelayed
          ? delayed_scale(w.view({groups * n, k}), std::vector<int64_t>(groups, n), f)
          : torch::Tensor();
  return ops::quantize_weights(GroupedTensors::stacked(w), o, scale);
}

// backend: kCublasLt (per-group matmuls), kCublasLtGrouped (one grouped matmul per product for
// per-tensor scales; block scales run per group) or kSm90 (our kernel, for per-tensor scales and
// for 1x128 activations and gradients with 128x128 weights in fprop and dgrad and 1x128 inputs in
// wgrad; the all-1x128 case runs fprop and dgrad per group).
ops::GemmPlan fp8_plan(const torch::Tensor& x, int64_t n, int64_t k,
                       const std::vector<int64_t>& sizes,
                       GemmBackend backend = GemmBackend::kCublasLt) {
  return ops::plan_grouped_gemms("test", x, {ops::GemmShape{n, k, sizes.size()}}, SplitSizes(sizes),
                                 backend, torch::Tensor(),
                                 /*fp8=*/true)
      .front();
}

const char* backend_name(GemmBackend backend) {
  return backend == GemmBackend::kCublasLtGrouped ? "cuBLASLt grouped"
         : backend == GemmBackend::kSm90          ? "sm90"
                                                  : "per-group cuBLASLt";
}

struct Problem {
  std::vector<int64_t> sizes;
  int64_t n, k, groups;
  torch::Tensor x, w, dy;  // [M, k], [G, n, k], [M, n] bf16 on the GPU
};

Problem make_problem(const ShapeCase& shape, uint64_t seed) {
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
double accumulation_tol(bool fast, const ScalingCase& sc) {
  return fast && !torchmoe::kernels::is_block_scaling(sc.input) ? kFastAccumulationTol
                                                                : kAccumulationTol;
}

void check_product(const torch::Tensor& actual, const Product& ref, torch::Dtype out_dtype,
                   double acc_tol, const std::string& what) {
  REQUIRE(actual.scalar_type() == out_dtype);
  check_within(actual, ref.value, output_rtol(out_dtype) * ref.value.abs() + acc_tol * ref.abs_sum,
               what);
}

std::string describe(const ScalingCase& s, const ShapeCase& shape) {
  return std::string(s.name) + "; " + shape.name;
}

}  // namespace

TEST_CASE("FP8 grouped forward matches the dequantized float64 reference", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const ScalingCase& sc = kScalingCases[GENERATE(range(0, 4))];
  const ShapeCase& shape = kShapeCases[GENERATE(0, 1)];
  const torch::Dtype out_dtype = GENERATE(torch::kBFloat16, torch::kFloat);
  const bool fast = GENERATE(true, false);
  const GemmBackend backend =
      GENERATE(GemmBackend::kCublasLt, GemmBackend::kCublasLtGrouped, GemmBackend::kSm90);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  INFO(describe(sc, shape) << "; output " << out_dtype << "; fast accumulation " << fast << "; "
                           << backend_name(backend));
  const Problem p = make_problem(shape, 11);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized wq = quantize_w(p.w, sc.weight);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend);
  const torch::Tensor y = ops::grouped_linear_forward_fp8(plan, xq, wq, {}, out_dtype, fast);
  const std::vector<int64_t> weight_sizes(p.groups, p.n);
  const Product ref = per_split_abt(dequantize(xq, true, p.sizes, p.k),
                                    dequantize(wq, true, weight_sizes, p.k), p.sizes, p.n);
  check_product(y, ref, out_dtype, accumulation_tol(fast, sc), "y");
}

TEST_CASE("FP8 grouped dgrad matches the dequantized float64 reference", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const ScalingCase& sc = kScalingCases[GENERATE(range(0, 4))];
  const ShapeCase& shape = kShapeCases[GENERATE(0, 1)];
  const torch::Dtype out_dtype = GENERATE(torch::kBFloat16, torch::kFloat);
  const Fp8Format grad_format = GENERATE(kE4M3, kE5M2);
  const bool fast = GENERATE(false, true);  // TE's choice for dgrad is split accumulation
  const GemmBackend backend =
      GENERATE(GemmBackend::kCublasLt, GemmBackend::kCublasLtGrouped, GemmBackend::kSm90);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  INFO(describe(sc, shape) << "; output " << out_dtype << "; grad_output "
                           << format_name(grad_format) << " x weight e4m3; fast accumulation "
                           << fast << "; " << backend_name(backend));
  const Problem p = make_problem(shape, 12);
  const SplitQuantized dyq = quantize(p.dy, p.sizes, sc.grad, grad_format);
  const SplitQuantized wq = quantize_w(p.w, sc.weight);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend);
  const torch::Tensor dx = ops::grouped_linear_dgrad_fp8(plan, dyq, wq, out_dtype, fast);
  REQUIRE(dx.sizes() == torch::IntArrayRef({total(p.sizes), p.k}));
  // dx_g = dy_g · W_g = dy_g · (W_gᵀ)ᵀ with W_gᵀ [k, n] the weights' columnwise copy.
  const torch::Tensor w_hat =
      dequantize(wq, false, std::vector<int64_t>(p.groups, p.n), p.k);  // [G·n, k]
  const Product ref =
      per_split_abt(dequantize(dyq, true, p.sizes, p.n),
                    w_hat.view({p.groups, p.n, p.k}).transpose(1, 2).reshape({p.groups * p.k, p.n}),
                    p.sizes, p.k);
  check_product(dx, ref, out_dtype, accumulation_tol(fast, sc), "dx");
}

TEST_CASE("FP8 grouped wgrad matches the dequantized float64 reference", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const ScalingCase& sc = kScalingCases[GENERATE(range(0, 4))];
  const ShapeCase& shape = kShapeCases[GENERATE(0, 1)];
  const torch::Dtype out_dtype = GENERATE(torch::kBFloat16, torch::kFloat);
  const Fp8Format grad_format = GENERATE(kE4M3, kE5M2);
  const bool stacked = GENERATE(false, true);
  const bool fast = GENERATE(false, true);  // TE's choice for wgrad is split accumulation
  const GemmBackend backend =
      GENERATE(GemmBackend::kCublasLt, GemmBackend::kCublasLtGrouped, GemmBackend::kSm90);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  INFO(describe(sc, shape) << "; output " << out_dtype << "; grad_output "
                           << format_name(grad_format) << " x input e4m3; stacked buffers "
                           << stacked << "; fast accumulation " << fast << "; "
                           << backend_name(backend));
  const Problem p = make_problem(shape, 13);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized dyq = quantize(p.dy, p.sizes, sc.grad, grad_format);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend);
  // NaN-filled: every group must be written (the empty split's with zeros).
  const torch::Tensor dw = torch::full(
      {p.groups, p.n, p.k}, NAN, torch::TensorOptions().dtype(out_dtype).device(torch::kCUDA));
  const std::vector<torch::Tensor> views = dw.unbind(0);
  ops::grouped_linear_wgrad_fp8(plan, xq, dyq,
                                stacked ? GroupedTensors::stacked(dw) : GroupedTensors(views),
                                /*accumulate=*/false, fast);
  const Product ref = per_split_atb(dequantize(dyq, false, p.sizes, p.n),
                                    dequantize(xq, false, p.sizes, p.k), p.sizes);
  check_product(dw, ref, out_dtype, accumulation_tol(fast, sc), "dW");
}

// Long reductions, where the tensor cores' accumulation error grows (K 4096 in fprop, 4096 rows
// per split in wgrad, out_features 4096 in dgrad): every product of the sm90 kernel and of
// per-group cuBLASLt (fast accumulation in fprop only, split accumulation in dgrad and wgrad)
// within its bound. Prints the largest error relative to Σ|a·b| per product ("-s" shows it).
TEST_CASE("FP8 products over long reductions stay within the accumulation bounds",
          "[ops][fp8][cuda][long]") {
  TORCHMOE_REQUIRE_CUDA();
  const GemmBackend backend = GENERATE(GemmBackend::kCublasLt, GemmBackend::kSm90);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  const bool tall = GENERATE(false, true);                // n 512, k 4096, or n 4096, k 512
  const ScalingCase& sc = kScalingCases[GENERATE(0, 2)];  // current; block
  const ShapeCase shape{"long", {4096, 0, 1000}, tall ? 4096 : 512, tall ? 512 : 4096};
  INFO(backend_name(backend) << "; " << sc.name << "; n " << shape.n << ", k " << shape.k);
  const Problem p = make_problem(shape, 16);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized wq = quantize_w(p.w, sc.weight);
  const SplitQuantized dyq = quantize(p.dy, p.sizes, sc.grad, kE5M2);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend);
  const std::vector<int64_t> weight_sizes(p.groups, p.n);
  const torch::Tensor x_hat = dequantize(xq, true, p.sizes, p.k);
  const torch::Tensor dy_hat = dequantize(dyq, true, p.sizes, p.n);
  const torch::Tensor w_hat = dequantize(wq, true, weight_sizes, p.k);  // [G·n, k]
  auto worst = [](const torch::Tensor& actual, const Product& ref) {
    const torch::Tensor a = actual.to(torch::kCPU, torch::kFloat64);
    return ((a - ref.value).abs() / ref.abs_sum.clamp_min(1e-30)).max().item<double>();
  };
  const torch::Tensor y = ops::grouped_linear_forward_fp8(plan, xq, wq, {}, torch::kFloat, true);
  const Product y_ref = per_split_abt(x_hat, w_hat, p.sizes, p.n);
  const torch::Tensor dx = ops::grouped_linear_dgrad_fp8(plan, dyq, wq, torch::kFloat);
  const Product dx_ref = per_split_abt(
      dy_hat, w_hat.view({p.groups, p.n, p.k}).transpose(1, 2).reshape({p.groups * p.k, p.n}),
      p.sizes, p.k);
  const torch::Tensor dw =
      torch::empty({p.groups, p.n, p.k}, x_hat.options().dtype(torch::kFloat).device(torch::kCUDA));
  ops::grouped_linear_wgrad_fp8(plan, xq, dyq, GroupedTensors::stacked(dw), false);
  const Product dw_ref = per_split_atb(dequantize(dyq, false, p.sizes, p.n),
                                       dequantize(xq, false, p.sizes, p.k), p.sizes);
  WARN(backend_name(backend) << ", " << sc.name << ", n " << p.n << ", k " << p.k
                             << ": largest error / sum|a*b|: fprop " << worst(y, y_ref)
                             << ", dgrad " << worst(dx, dx_ref) << ", wgrad " << worst(dw, dw_ref));
  check_product(y, y_ref, torch::kFloat, kFastAccumulationTol, "y");
  check_product(dx, dx_ref, torch::kFloat, accumulation_tol(false, sc), "dx");
  check_product(dw, dw_ref, torch::kFloat, accumulation_tol(false, sc), "dW");
  // Split accumulation keeps the long reductions' error down: measured on the H100, 1.1-4.8e-4
  // for per-group cuBLASLt, against 1.2-1.6e-3 with the tensor cores' own accumulation.
  CHECK(worst(dx, dx_ref) < 8e-4);
  CHECK(worst(dw, dw_ref) < 8e-4);
}

TEST_CASE("FP8 grouped wgrad accumulates into fp32 buffers; empty splits", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const ScalingCase& sc = kScalingCases[GENERATE(0, 2)];
  const bool stacked = GENERATE(false, true);
  const GemmBackend backend =
      GENERATE(GemmBackend::kCublasLt, GemmBackend::kCublasLtGrouped, GemmBackend::kSm90);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  const ShapeCase& shape = kShapeCases[0];  // split 1 is empty
  INFO(describe(sc, shape) << "; stacked buffers " << stacked << "; " << backend_name(backend));
  const Problem p = make_problem(shape, 14);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized dyq = quantize(p.dy, p.sizes, sc.grad, kE5M2);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend);
  const Product ref = per_split_atb(dequantize(dyq, false, p.sizes, p.n),
                                    dequantize(xq, false, p.sizes, p.k), p.sizes);
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
  auto as_grouped = [&](const torch::Tensor& all, std::vector<torch::Tensor>& views) {
    views = all.unbind(0);
    return stacked ? GroupedTensors::stacked(all) : GroupedTensors(views);
  };
  std::vector<torch::Tensor> views;

  SECTION("accumulate adds to what is there; an empty split's buffer is left as it is") {
    const torch::Tensor old = torch::randn({p.groups, p.n, p.k}, fp32) * 10;
    const torch::Tensor dw = old.clone();
    ops::grouped_linear_wgrad_fp8(plan, xq, dyq, as_grouped(dw, views), /*accumulate=*/true);
    const torch::Tensor old64 = old.cpu().to(torch::kFloat64);
    const torch::Tensor expected = old64 + ref.value;
    // fp32 sum of the old value and the product: a few ulps of both.
    check_within(dw, expected,
                 1e-6 * (old64.abs() + ref.value.abs()) + accumulation_tol(false, sc) * ref.abs_sum,
                 "dW += dyᵀ·x");
    CHECK(torch::equal(dw[1], old[1]));
  }
  SECTION("overwrite zeroes an empty split's buffer") {
    const torch::Tensor dw = torch::full({p.groups, p.n, p.k}, NAN, fp32);
    ops::grouped_linear_wgrad_fp8(plan, xq, dyq, as_grouped(dw, views), /*accumulate=*/false);
    CHECK(torch::equal(dw[1].cpu(), torch::zeros({p.n, p.k})));
    check_product(dw, ref, torch::kFloat, accumulation_tol(false, sc), "dW = dyᵀ·x");
  }
  SECTION("accumulating into bf16 buffers is refused") {
    const torch::Tensor dw = torch::zeros({p.groups, p.n, p.k}, fp32.dtype(torch::kBFloat16));
    REQUIRE_THROWS_WITH(
        ops::grouped_linear_wgrad_fp8(plan, xq, dyq, as_grouped(dw, views), /*accumulate=*/true),
        Contains("accumulating needs float32"));
  }
}

TEST_CASE("FP8 grouped forward adds the biases", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const ScalingCase& sc = kScalingCases[GENERATE(0, 2)];
  const torch::Dtype out_dtype = GENERATE(torch::kBFloat16, torch::kFloat);
  // The grouped matmul adds them to its fp32 product in a second kernel (per-tensor scales; block
  // scales run per group there).
  const GemmBackend backend =
      GENERATE(GemmBackend::kCublasLt, GemmBackend::kCublasLtGrouped, GemmBackend::kSm90);
  TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
  const ShapeCase& shape = kShapeCases[0];
  INFO(describe(sc, shape) << "; output and biases " << out_dtype << "; " << backend_name(backend));
  const Problem p = make_problem(shape, 15);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized wq = quantize_w(p.w, sc.weight);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend);
  std::vector<torch::Tensor> biases;
  for (int64_t g = 0; g < p.groups; ++g) {
    biases.push_back(
        (torch::rand({p.n}, torch::kCUDA) * 4 - 2).to(out_dtype));  // as large as the products
  }
  const torch::Tensor y = ops::grouped_linear_forward_fp8(plan, xq, wq, biases, out_dtype);
  Product ref =
      per_split_abt(dequantize(xq, true, p.sizes, p.k),
                    dequantize(wq, true, std::vector<int64_t>(p.groups, p.n), p.k), p.sizes, p.n);
  torch::Tensor bias_rows = torch::zeros_like(ref.value);
  int64_t start = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    bias_rows.narrow(0, start, p.sizes[g]).add_(biases[g].cpu().to(torch::kFloat64));
    start += p.sizes[g];
  }
  // The bias may be added in the GEMM's epilogue (one rounding) or to the rounded product (two):
  // allow the output's rounding of the product, of the bias and of the sum.
  const double u = output_rtol(out_dtype);
  const torch::Tensor expected = ref.value + bias_rows;
  check_within(
      y, expected,
      u * (expected.abs() + ref.abs_sum + bias_rows.abs()) + kFastAccumulationTol * ref.abs_sum,
      "y + b");
}

// Operands that no device-split engine takes (all-1x128 block scales in fprop and dgrad: the sm90
// kernel takes 128x128 weights there, the grouped matmul per-tensor scales; wgrad's 1x128 pair
// runs on the sm90 kernel) run one matmul per group, which needs the sizes on the host: a
// device-size plan's are copied and checked as planning checks host sizes, since per-group
// matmuls can neither clamp a size nor leave capacity-padding rows.
TEST_CASE("FP8 per-group products check the device sizes they copy", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  TORCHMOE_REQUIRE_GEMM_BACKEND(GemmBackend::kSm90);
  const ScalingCase& sc = kScalingCases[3];
  const ShapeCase& shape = kShapeCases[0];
  const Problem p = make_problem(shape, 16);
  const int64_t rows = total(p.sizes);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized wq = quantize_w(p.w, sc.weight);
  const SplitQuantized dyq = quantize(p.dy, p.sizes, sc.grad, kE5M2);
  auto plan_with = [&](std::vector<int64_t> device_sizes) {
    return ops::plan_grouped_gemms(
               "test", p.x, {ops::GemmShape{p.n, p.k, p.sizes.size()}},
               SplitSizes(torch::tensor(device_sizes, torch::kLong).to(torch::kCUDA)),
               GemmBackend::kSm90, torch::Tensor(), /*fp8=*/true)
        .front();
  };
  SECTION("sizes summing to the rows: the per-group results") {
    const ops::GemmPlan plan = plan_with(p.sizes);
    const ops::GemmPlan host = fp8_plan(p.x, p.n, p.k, p.sizes, GemmBackend::kSm90);
    CHECK(torch::equal(ops::grouped_linear_forward_fp8(plan, xq, wq, {}, torch::kBFloat16),
                       ops::grouped_linear_forward_fp8(host, xq, wq, {}, torch::kBFloat16)));
  }
  SECTION("capacity padding (a smaller sum) is refused") {
    std::vector<int64_t> short_sizes = p.sizes;
    short_sizes.back() -= 3;
    const ops::GemmPlan plan = plan_with(short_sizes);
    const std::string message = "must sum to the number of rows (" + std::to_string(rows) + ")";
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wq, {}, torch::kBFloat16),
                        Contains("grouped_linear_forward_fp8") && Contains(message));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plan, dyq, wq, torch::kBFloat16),
                        Contains("grouped_linear_dgrad_fp8") && Contains(message));
  }
  SECTION("a negative size is refused") {
    std::vector<int64_t> negative = p.sizes;
    negative[0] = -1;
    negative[1] += 1 + p.sizes[0];
    const ops::GemmPlan plan = plan_with(negative);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wq, {}, torch::kBFloat16),
                        Contains("m_splits[0] must be non-negative, got -1"));
  }
}

TEST_CASE("quantize_weights: separate and stacked weights give the same bytes",
          "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const int64_t groups = 3, n = 144, k = 208;
  const torch::Tensor w = spread(std::vector<int64_t>(groups, n), k, 0.05, 16).view({groups, n, k});
  const std::vector<torch::Tensor> separate = w.clone().unbind(0);  // G separate allocations
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor scale =
      scaling == QuantizeScaling::kDelayed
          ? delayed_scale(w.view({groups * n, k}), std::vector<int64_t>(groups, n), kE4M3)
          : torch::Tensor();
  const SplitQuantized a = ops::quantize_weights(GroupedTensors::stacked(w), o, scale);
  const SplitQuantized b = ops::quantize_weights(separate, o, scale);
  auto bytes = [](const torch::Tensor& t) { return t.cpu().contiguous().view(torch::kByte); };
  CHECK(torch::equal(bytes(a.data), bytes(b.data)));
  CHECK(torch::equal(bytes(a.columnwise_data), bytes(b.columnwise_data)));
  CHECK(torch::equal(a.scale_inv.cpu(), b.scale_inv.cpu()));
  CHECK(a.columnwise_scale_inv.defined() == b.columnwise_scale_inv.defined());
  if (a.columnwise_scale_inv.defined()) {
    CHECK(torch::equal(a.columnwise_scale_inv.cpu(), b.columnwise_scale_inv.cpu()));
  }
  CHECK(torch::equal(a.amax.cpu(), b.amax.cpu()));
  CHECK(a.data.sizes() == torch::IntArrayRef({groups * n, k}));
  // W_gᵀ [k, n] at element k·n·g (n is a multiple of 16: no padding), where both copies share
  // their scales (per tensor, 128×128): the transpose of the rowwise bytes.
  if (scaling != QuantizeScaling::kBlock1x128) {
    for (int64_t g = 0; g < groups; ++g) {
      INFO("weight " << g);
      CHECK(torch::equal(bytes(a.columnwise_data).narrow(0, k * n * g, k * n).view({k, n}),
                         bytes(a.data).view({groups, n, k})[g].t()));
    }
  }
}

TEST_CASE("FP8 grouped GEMM ops refuse bad operands", "[ops][fp8][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const ShapeCase shape{"small", {40, 24}, 32, 64};
  const Problem p = make_problem(shape, 17);
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes);
  const auto cur = QuantizeScaling::kCurrent;
  const SplitQuantized xq = quantize(p.x, p.sizes, cur, kE4M3);
  const SplitQuantized wq = quantize_w(p.w, cur);
  const SplitQuantized dyq = quantize(p.dy, p.sizes, cur, kE5M2);
  const auto fp32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
  const torch::Tensor dw = torch::zeros({p.groups, p.n, p.k}, fp32);
  const GroupedTensors dw_out = GroupedTensors::stacked(dw);
  const auto bf16 = torch::kBFloat16;

  SECTION("a 1x128 operand without split_quantize's three rows of slack") {
    // Splits not multiples of 4 rows: each per-group product reads up to 3 rows past its split.
    const ShapeCase odd{"odd", {37, 27}, 32, 128};
    const Problem q = make_problem(odd, 18);
    const ops::GemmPlan per_group = fp8_plan(q.x, q.n, q.k, q.sizes, GemmBackend::kCublasLt);
    SplitQuantized xb = quantize(q.x, q.sizes, QuantizeScaling::kBlock1x128, kE4M3);
    const SplitQuantized wb = quantize_w(q.w, QuantizeScaling::kBlock128x128);
    CHECK_NOTHROW(ops::grouped_linear_forward_fp8(per_group, xb, wb, {}, bf16));
    xb.data = xb.data.clone();
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(per_group, xb, wb, {}, bf16),
                        Contains("must keep split_quantize's three rows of slack past its end"));
  }
  SECTION("a 16-bit plan") {
    const ops::GemmPlan plain =
        ops::plan_grouped_gemms("test", p.x, {ops::GemmShape{p.n, p.k, p.sizes.size()}},
                                SplitSizes(p.sizes), GemmBackend::kCublasLt)
            .front();
    REQUIRE_FALSE(plain.fp8);
    REQUIRE_THROWS_AS(ops::grouped_linear_forward_fp8(plain, xq, wq, {}, bf16), c10::Error);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plain, xq, wq, {}, bf16),
                        Contains("needs an FP8 plan"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plain, dyq, wq, bf16),
                        Contains("needs an FP8 plan"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plain, xq, dyq, dw_out, false),
                        Contains("needs an FP8 plan"));
  }
  SECTION("an FP8 plan given to the 16-bit products") {
    // Planned for FP8 operands (on sm90 without the 16-bit dtype check): a float32 input would
    // reach the 16-bit kernels' internal asserts.
    const torch::Tensor x32 = p.x.to(torch::kFloat);
    const ops::GemmPlan fp8 = fp8_plan(x32, p.n, p.k, p.sizes, GemmBackend::kAuto);
    const torch::Tensor w32 = p.w.to(torch::kFloat);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward(fp8, x32, GroupedTensors::stacked(w32), {}),
                        Contains("got an FP8 plan"));
    REQUIRE_THROWS_WITH(
        ops::grouped_linear_dgrad(fp8, p.dy.to(torch::kFloat), GroupedTensors::stacked(w32)),
        Contains("got an FP8 plan"));
    REQUIRE_THROWS_WITH(
        ops::grouped_linear_wgrad(fp8, x32, p.dy.to(torch::kFloat), dw_out, false, {}),
        Contains("got an FP8 plan"));
  }
  SECTION("operands that do not start on a 16-byte boundary") {
    SplitQuantized shifted = xq;
    shifted.data = torch::empty({xq.data.numel() + 1}, xq.data.options())
                       .narrow(0, 1, xq.data.numel())
                       .view(xq.data.sizes());
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, shifted, wq, {}, bf16),
                        Contains("input's rowwise data must start on a 16-byte boundary, got an "
                                 "address 1 mod 16"));
  }
  SECTION("e5m2 x e5m2") {
    const SplitQuantized x5 = quantize(p.x, p.sizes, cur, kE5M2);
    const SplitQuantized w5 = quantize_w(p.w, cur, kE5M2);
    REQUIRE_THROWS_AS(ops::grouped_linear_forward_fp8(plan, x5, w5, {}, bf16),
                      c10::NotImplementedError);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, x5, w5, {}, bf16),
                        Contains("both e5m2"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plan, dyq, w5, bf16), Contains("both e5m2"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, x5, dyq, dw_out, false),
                        Contains("both e5m2"));
  }
  SECTION("128x128 x 128x128") {
    const auto tile = QuantizeScaling::kBlock128x128;
    const SplitQuantized xt = quantize(p.x, p.sizes, tile, kE4M3);
    const SplitQuantized wt = quantize_w(p.w, tile);
    const SplitQuantized dyt = quantize(p.dy, p.sizes, tile, kE4M3);
    REQUIRE_THROWS_AS(ops::grouped_linear_forward_fp8(plan, xt, wt, {}, bf16),
                      c10::NotImplementedError);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xt, wt, {}, bf16),
                        Contains("both have 128x128 block scales"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plan, dyt, wt, bf16),
                        Contains("both have 128x128 block scales"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xt, dyt, dw_out, false),
                        Contains("both have 128x128 block scales"));
  }
  SECTION("per-tensor x block scales") {
    const SplitQuantized wb = quantize_w(p.w, QuantizeScaling::kBlock1x128);
    const SplitQuantized xb = quantize(p.x, p.sizes, QuantizeScaling::kBlock1x128, kE4M3);
    const char* message = "both have per-tensor scales or both block scales";
    REQUIRE_THROWS_AS(ops::grouped_linear_forward_fp8(plan, xq, wb, {}, bf16),
                      c10::NotImplementedError);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wb, {}, bf16), Contains(message));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plan, dyq, wb, bf16), Contains(message));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xb, dyq, dw_out, false),
                        Contains(message));
  }
  SECTION("bad biases") {
    const auto opts = torch::TensorOptions().dtype(bf16).device(torch::kCUDA);
    std::vector<torch::Tensor> biases;
    for (int64_t g = 0; g < p.groups; ++g) biases.push_back(torch::zeros({p.n}, opts));
    CHECK_NOTHROW(ops::grouped_linear_forward_fp8(plan, xq, wq, biases, bf16));
    std::vector<torch::Tensor> too_few(biases.begin(), biases.end() - 1);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wq, too_few, bf16),
                        Contains("biases must hold one tensor per group"));
    std::vector<torch::Tensor> bad = biases;
    bad[1] = torch::zeros({p.n + 1}, opts);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wq, bad, bf16),
                        Contains("biases[1] must have shape"));
    bad[1] = torch::zeros({p.n}, opts.dtype(torch::kFloat));
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wq, bad, bf16),
                        Contains("must have the output dtype"));
    bad[1] = torch::zeros({p.n}, torch::TensorOptions().dtype(bf16));
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, wq, bad, bf16),
                        Contains("biases[1] must be on"));
  }
  SECTION("a missing copy") {
    const SplitQuantized x_cols = quantize(p.x, p.sizes, cur, kE4M3, false, true);
    const SplitQuantized x_rows = quantize(p.x, p.sizes, cur, kE4M3, true, false);
    const SplitQuantized w_rows = quantize_w(p.w, cur, kE4M3, true, false);
    const SplitQuantized w_cols = quantize_w(p.w, cur, kE4M3, false, true);
    const SplitQuantized dy_rows = quantize(p.dy, p.sizes, cur, kE5M2, true, false);
    const SplitQuantized dy_cols = quantize(p.dy, p.sizes, cur, kE5M2, false, true);
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, x_cols, wq, {}, bf16),
                        Contains("input must have its rowwise copy"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_forward_fp8(plan, xq, w_cols, {}, bf16),
                        Contains("weights must have its rowwise copy"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plan, dyq, w_rows, bf16),
                        Contains("weights must have its columnwise copy"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad_fp8(plan, dy_cols, wq, bf16),
                        Contains("grad_output must have its rowwise copy"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, x_rows, dyq, dw_out, false),
                        Contains("input must have its columnwise copy"));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xq, dy_rows, dw_out, false),
                        Contains("grad_output must have its columnwise copy"));
    // The copies each product reads are enough.
    CHECK_NOTHROW(ops::grouped_linear_forward_fp8(plan, x_rows, w_rows, {}, bf16));
    CHECK_NOTHROW(ops::grouped_linear_dgrad_fp8(plan, dy_rows, w_cols, bf16));
    CHECK_NOTHROW(ops::grouped_linear_wgrad_fp8(plan, x_cols, dy_cols, dw_out, false));
  }
  SECTION("bad weight-gradient buffers") {
    const std::vector<torch::Tensor> good = dw.unbind(0);
    std::vector<torch::Tensor> bad = good;
    bad[1] = torch::zeros({p.n, p.k + 16}, fp32);
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xq, dyq, GroupedTensors(bad), false),
                        Contains("weight_grads_out[1] must have shape"));
    bad[1] = torch::zeros({p.n, p.k}, fp32.dtype(bf16));
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xq, dyq, GroupedTensors(bad), false),
                        Contains("weight_grads_out[1] must have weight_grads_out[0]'s dtype"));
    bad[1] = torch::zeros({p.n, p.k}, torch::kFloat);
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xq, dyq, GroupedTensors(bad), false),
                        Contains("weight_grads_out[1] must be on cuda"));
    const std::vector<torch::Tensor> one(good.begin(), good.begin() + 1);
    REQUIRE_THROWS_WITH(ops::grouped_linear_wgrad_fp8(plan, xq, dyq, GroupedTensors(one), false),
                        Contains("weight_grads_out must hold one tensor per group (2), got 1"));
  }
}

TEST_CASE("plan_grouped_gemms: FP8 plans and their refusals", "[ops][fp8][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes = {40, 0, 24};
  const auto groups = sizes.size();
  const torch::Tensor x =
      torch::randn({64, 64}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA));
  auto plan = [&](int64_t n, int64_t k, GemmBackend backend) {
    return ops::plan_grouped_gemms("test", x.narrow(1, 0, k).contiguous(),
                                   {ops::GemmShape{n, k, groups}}, SplitSizes(sizes), backend,
                                   torch::Tensor(), /*fp8=*/true)
        .front();
  };
  SECTION("kCublasLt plans per-group cuBLASLt FP8 products; kAuto sm90 where it runs") {
    const GemmBackend backend = GENERATE(GemmBackend::kAuto, GemmBackend::kCublasLt);
    const ops::GemmPlan p = plan(32, 64, backend);
    CHECK(p.fp8);
    const bool automatic = backend == GemmBackend::kAuto;
    const ops::Backend expected =
        automatic && torchmoe::test::sm90_available()      ? ops::Backend::kSm90
        : automatic && torchmoe::loaded_cublaslt().grouped ? ops::Backend::kCublasLtGrouped
                                                           : ops::Backend::kCublasLt;
    CHECK(p.backend == expected);
    CHECK(p.dgrad_backend == expected);
    CHECK(p.wgrad_backend == expected);
    REQUIRE(p.m_splits.has_host());
    CHECK(p.m_splits.host().vec() == sizes);
  }
  SECTION("kAuto runs large experts per group when the sizes are on the host") {
    const char* forced = std::getenv("TORCHMOE_GROUPED_GEMM_BACKEND");
    if (forced != nullptr && std::string(forced) != "auto") {
      WARN("SKIPPED: TORCHMOE_GROUPED_GEMM_BACKEND=" << forced << " overrides kAuto");
      return;
    }
    // n·k = 2^24 weight elements: kAuto's threshold (its measurement: docs/performance.md).
    const ops::GemmPlan p = plan(int64_t{1} << 18, 64, GemmBackend::kAuto);
    CHECK(p.backend == ops::Backend::kCublasLt);
    CHECK(p.wgrad_backend == ops::Backend::kCublasLt);
  }
  SECTION("forced sm90: planned on sm_90 with device sizes, else refused with the reason") {
    if (torchmoe::test::sm90_available()) {
      const ops::GemmPlan p = plan(32, 64, GemmBackend::kSm90);
      CHECK(p.backend == ops::Backend::kSm90);
      CHECK(p.wgrad_backend == ops::Backend::kSm90);
      CHECK(p.m_splits.has_device());
    } else {
      REQUIRE_THROWS_AS(plan(32, 64, GemmBackend::kSm90), c10::NotImplementedError);
      REQUIRE_THROWS_WITH(plan(32, 64, GemmBackend::kSm90),
                          Contains("the sm90 grouped GEMM backend cannot run this FP8 call"));
    }
  }
  SECTION("forced cuBLASLt grouped: planned where loaded, else refused with the reason") {
    if (torchmoe::loaded_cublaslt().grouped) {
      const ops::GemmPlan p = plan(32, 64, GemmBackend::kCublasLtGrouped);
      CHECK(p.backend == ops::Backend::kCublasLtGrouped);
      CHECK(p.wgrad_backend == ops::Backend::kCublasLtGrouped);
      CHECK(p.m_splits.has_device());
    } else {
      REQUIRE_THROWS_AS(plan(32, 64, GemmBackend::kCublasLtGrouped), c10::NotImplementedError);
      REQUIRE_THROWS_WITH(plan(32, 64, GemmBackend::kCublasLtGrouped),
                          Contains("cannot run this FP8 call: it needs cuBLASLt >= 13.8"));
    }
  }
  SECTION("n or k not a multiple of 16 (a multiple of 8: fine for 16-bit layers)") {
    REQUIRE_THROWS_AS(plan(40, 64, GemmBackend::kAuto), c10::NotImplementedError);
    REQUIRE_THROWS_WITH(plan(40, 64, GemmBackend::kAuto), Contains("multiples of 16"));
    REQUIRE_THROWS_WITH(plan(32, 40, GemmBackend::kAuto), Contains("multiples of 16"));
  }
}

TEST_CASE("plan_grouped_gemms refuses FP8 on the CPU", "[ops][fp8][errors]") {
  const torch::Tensor x = torch::randn({16, 32}).to(torch::kBFloat16);
  const std::vector<int64_t> sizes = {10, 6};
  auto plan = [&] {
    return ops::plan_grouped_gemms("test", x, {ops::GemmShape{16, 32, sizes.size()}},
                                   SplitSizes(sizes), GemmBackend::kAuto, torch::Tensor(),
                                   /*fp8=*/true);
  };
  REQUIRE_THROWS_AS(plan(), c10::NotImplementedError);
  REQUIRE_THROWS_WITH(plan(), Contains("FP8 runs on CUDA"));
  // Without fp8 the same call plans the CPU reference.
  CHECK_NOTHROW(ops::plan_grouped_gemms("test", x, {ops::GemmShape{16, 32, sizes.size()}},
                                        SplitSizes(sizes), GemmBackend::kAuto));
}
