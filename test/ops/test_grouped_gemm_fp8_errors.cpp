// The refusals of the FP8 grouped GEMM ops and of FP8 planning (the CPU one runs without a GPU).

#include "ops/fp8_gemm_test_utils.h"

using namespace torchmoe::test;
using namespace torchmoe::test::fp8_gemm;
using Catch::Matchers::Contains;

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
    const ops::GemmPlan per_group =
        fp8_plan(q.x, q.n, q.k, q.sizes, GemmBackend::kCublasLt,
                 fp8_options(QuantizeScaling::kBlock1x128, QuantizeScaling::kBlock128x128,
                             QuantizeScaling::kBlock1x128));
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
                                   torch::Tensor(), ops::Fp8GemmOptions())
        .front();
  };
  SECTION("kCublasLt plans per-group cuBLASLt FP8 products; kAuto sm90 where it runs") {
    const GemmBackend backend = GENERATE(GemmBackend::kAuto, GemmBackend::kCublasLt);
    const ops::GemmPlan p = plan(32, 64, backend);
    CHECK(p.fp8);
    const bool automatic = backend == GemmBackend::kAuto;
    const torchmoe::GemmBackend expected =
        automatic && torchmoe::test::sm90_available()      ? torchmoe::GemmBackend::kSm90
        : automatic && torchmoe::loaded_cublaslt().grouped ? torchmoe::GemmBackend::kCublasLtGrouped
                                                           : torchmoe::GemmBackend::kCublasLt;
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
    CHECK(p.backend == torchmoe::GemmBackend::kCublasLt);
    CHECK(p.wgrad_backend == torchmoe::GemmBackend::kCublasLt);
  }
  SECTION("forced sm90: planned on sm_90 with device sizes, else refused with the reason") {
    if (torchmoe::test::sm90_available()) {
      const ops::GemmPlan p = plan(32, 64, GemmBackend::kSm90);
      CHECK(p.backend == torchmoe::GemmBackend::kSm90);
      CHECK(p.wgrad_backend == torchmoe::GemmBackend::kSm90);
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
      CHECK(p.backend == torchmoe::GemmBackend::kCublasLtGrouped);
      CHECK(p.wgrad_backend == torchmoe::GemmBackend::kCublasLtGrouped);
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
                                   ops::Fp8GemmOptions());
  };
  REQUIRE_THROWS_AS(plan(), c10::NotImplementedError);
  REQUIRE_THROWS_WITH(plan(), Contains("FP8 runs on CUDA"));
  // Without FP8 options the same call plans the CPU reference.
  CHECK_NOTHROW(ops::plan_grouped_gemms("test", x, {ops::GemmShape{16, 32, sizes.size()}},
                                        SplitSizes(sizes), GemmBackend::kAuto));
}
