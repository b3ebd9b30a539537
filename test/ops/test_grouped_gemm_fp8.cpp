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
//   accumulation  split on and off (the plan's options), per product
// Plus: wgrad accumulation into fp32 buffers and its empty-split rule, biases, and quantize_weights
// on separate vs stacked weights. The refusals: test_grouped_gemm_fp8_errors.cpp.

#include "ops/fp8_gemm_test_utils.h"

using namespace torchmoe::test;
using namespace torchmoe::test::fp8_gemm;
using Catch::Matchers::Contains;

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
  ops::Fp8GemmOptions options = fp8_options(sc);
  options.fprop_split_accumulator = !fast;
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend, options);
  const torch::Tensor y = ops::grouped_linear_forward_fp8(plan, xq, wq, {}, out_dtype);
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
  ops::Fp8GemmOptions options = fp8_options(sc, grad_format);
  options.dgrad_split_accumulator = !fast;
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend, options);
  const torch::Tensor dx = ops::grouped_linear_dgrad_fp8(plan, dyq, wq, out_dtype);
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
  ops::Fp8GemmOptions options = fp8_options(sc, grad_format);
  options.wgrad_split_accumulator = !fast;
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend, options);
  // NaN-filled: every group must be written (the empty split's with zeros).
  const torch::Tensor dw = torch::full(
      {p.groups, p.n, p.k}, NAN, torch::TensorOptions().dtype(out_dtype).device(torch::kCUDA));
  const std::vector<torch::Tensor> views = dw.unbind(0);
  ops::grouped_linear_wgrad_fp8(plan, xq, dyq,
                                stacked ? GroupedTensors::stacked(dw) : GroupedTensors(views),
                                /*accumulate=*/false);
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
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend, fp8_options(sc));
  const std::vector<int64_t> weight_sizes(p.groups, p.n);
  const torch::Tensor x_hat = dequantize(xq, true, p.sizes, p.k);
  const torch::Tensor dy_hat = dequantize(dyq, true, p.sizes, p.n);
  const torch::Tensor w_hat = dequantize(wq, true, weight_sizes, p.k);  // [G·n, k]
  auto worst = [](const torch::Tensor& actual, const Product& ref) {
    const torch::Tensor a = actual.to(torch::kCPU, torch::kFloat64);
    return ((a - ref.value).abs() / ref.abs_sum.clamp_min(1e-30)).max().item<double>();
  };
  const torch::Tensor y = ops::grouped_linear_forward_fp8(plan, xq, wq, {}, torch::kFloat);
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
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend, fp8_options(sc));
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
  const ops::GemmPlan plan = fp8_plan(p.x, p.n, p.k, p.sizes, backend, fp8_options(sc));
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

// Operands that no device-split backend takes (all-1x128 block scales in fprop and dgrad: the sm90
// kernel takes 128x128 weights there, the grouped matmul per-tensor scales; wgrad's 1x128 pair
// runs on the sm90 kernel) run one matmul per group, which needs the sizes on the host: planning
// says so per product, and copies a device-size plan's sizes once and checks them as it checks
// host sizes, since per-group matmuls can neither clamp a size nor leave capacity-padding rows.
TEST_CASE("FP8 plans run per group what the device kernels do not take", "[ops][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  TORCHMOE_REQUIRE_GEMM_BACKEND(GemmBackend::kSm90);
  const ScalingCase& sc = kScalingCases[3];
  const ShapeCase& shape = kShapeCases[0];
  const Problem p = make_problem(shape, 16);
  const int64_t rows = total(p.sizes);
  const SplitQuantized xq = quantize(p.x, p.sizes, sc.input, kE4M3);
  const SplitQuantized wq = quantize_w(p.w, sc.weight);
  auto plan_with = [&](std::vector<int64_t> device_sizes) {
    return ops::plan_grouped_gemms(
               "test", p.x, {ops::GemmShape{p.n, p.k, p.sizes.size()}},
               SplitSizes(torch::tensor(device_sizes, torch::kLong).to(torch::kCUDA)),
               GemmBackend::kSm90, torch::Tensor(), fp8_options(sc))
        .front();
  };
  SECTION("sizes summing to the rows: per-group fprop and dgrad, sm90 wgrad") {
    const ops::GemmPlan plan = plan_with(p.sizes);
    CHECK(plan.backend == GemmBackend::kCublasLt);
    CHECK(plan.dgrad_backend == GemmBackend::kCublasLt);
    CHECK(plan.wgrad_backend == GemmBackend::kSm90);
    REQUIRE(plan.m_splits.has_host());
    CHECK(plan.m_splits.host().vec() == p.sizes);
    CHECK(plan.m_splits.has_device());
    const ops::GemmPlan host =
        fp8_plan(p.x, p.n, p.k, p.sizes, GemmBackend::kSm90, fp8_options(sc));
    CHECK(torch::equal(ops::grouped_linear_forward_fp8(plan, xq, wq, {}, torch::kBFloat16),
                       ops::grouped_linear_forward_fp8(host, xq, wq, {}, torch::kBFloat16)));
  }
  SECTION("capacity padding (a smaller sum) is refused when planning") {
    std::vector<int64_t> short_sizes = p.sizes;
    short_sizes.back() -= 3;
    REQUIRE_THROWS_WITH(
        plan_with(short_sizes),
        Contains("test: m_splits must sum to the number of rows (" + std::to_string(rows) + ")"));
  }
  SECTION("a negative size is refused when planning") {
    std::vector<int64_t> negative = p.sizes;
    negative[0] = -1;
    negative[1] += 1 + p.sizes[0];
    REQUIRE_THROWS_WITH(plan_with(negative), Contains("m_splits[0] must be non-negative, got -1"));
  }
  SECTION("operands quantized otherwise than the plan says are refused") {
    const ops::GemmPlan plan = plan_with(p.sizes);
    const SplitQuantized x_current = quantize(p.x, p.sizes, QuantizeScaling::kCurrent, kE4M3);
    const SplitQuantized w_current = quantize_w(p.w, QuantizeScaling::kCurrent);
    REQUIRE_THROWS_WITH(
        ops::grouped_linear_forward_fp8(plan, x_current, w_current, {}, torch::kBFloat16),
        Contains("input must be quantized as the plan's FP8 options say (e4m3, "
                 "1x128 block scaling), got e4m3, current scaling"));
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
