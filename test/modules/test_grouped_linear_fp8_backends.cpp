// GroupedLinear FP8's refusals (on CUDA, and on the CPU without a GPU) and its backends against
// each other: forced sm90 and cuBLASLt, and the cuBLASLt grouped matmul against per-group cuBLASLt.

#include "modules/fp8_modules_test_utils.h"

using namespace torchmoe::test;
using namespace torchmoe::test::fp8_modules;
using Catch::Matchers::Contains;

TEST_CASE("GroupedLinear FP8 on CUDA: refusals, and forced backends agree",
          "[modules][fp8][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const torch::Tensor x = make_input();
  SECTION("DelayedScaling needs the layer's FP8 state") {
    GroupedLinear m = make_layer(layer_options(0));
    const fp8::Autocast guard(fp8::DelayedScaling().amax_history_len(kHistory));
    REQUIRE_THROWS_AS(m(x, kSplits), c10::Error);
    REQUIRE_THROWS_WITH(m(x, kSplits), Contains("fp8_amax_history_len"));
  }
  SECTION("a forced backend gives the same layer output as per-group cuBLASLt") {
    const torchmoe::GemmBackend backend =
        GENERATE(torchmoe::GemmBackend::kSm90, torchmoe::GemmBackend::kCublasLtGrouped);
    TORCHMOE_REQUIRE_GEMM_BACKEND(backend);
    GroupedLinear m = make_layer(layer_options().gemm_backend(backend));
    GroupedLinear per_group =
        make_layer(layer_options().gemm_backend(torchmoe::GemmBackend::kCublasLt));
    const fp8::Autocast guard{fp8::CurrentScaling()};
    const torch::Tensor y = m(x, kSplits).to(torch::kFloat);
    const torch::Tensor expected = per_group(x, kSplits).to(torch::kFloat);
    // The same FP8 operands; the products differ by accumulation order and bf16 rounding only.
    CHECK(relative_error(y, expected) < 1e-2);
  }
}

TEST_CASE("GroupedLinear FP8 on the CPU is refused", "[modules][fp8][errors]") {
  GroupedLinear m(GroupedLinearOptions(2, 32, 16));
  const torch::Tensor x = torch::randn({16, 32});
  const std::vector<int64_t> splits = {10, 6};
  const fp8::Autocast guard{fp8::CurrentScaling()};
  REQUIRE_THROWS_AS(m(x, splits), c10::NotImplementedError);
  REQUIRE_THROWS_WITH(m(x, splits), Contains("FP8 runs on CUDA"));
}

TEST_CASE("GroupedLinear FP8 on the cuBLASLt grouped matmul matches per-group cuBLASLt",
          "[modules][fp8][cuda][cublaslt_grouped]") {
  TORCHMOE_REQUIRE_CUDA();
  TORCHMOE_REQUIRE_GEMM_BACKEND(torchmoe::GemmBackend::kCublasLtGrouped);
  // Per-tensor recipes run as one grouped matmul per product, the split sizes on the device only
  // (as MoELayer gives them: no host copy); the same FP8 operands as the per-group matmuls, so the
  // two differ only by the order of the fp32 accumulation.
  const bool delayed = GENERATE(false, true);
  INFO((delayed ? "DelayedScaling" : "CurrentScaling"));
  const fp8::Recipe recipe = delayed ? fp8::Recipe(fp8::DelayedScaling().amax_history_len(kHistory))
                                     : fp8::Recipe(fp8::CurrentScaling());
  // Without biases: a biased layer's forward runs per group (no bias epilogue in grouped mode).
  const auto options = layer_options(kHistory).bias(false);
  GroupedLinear per_group = make_layer(GroupedLinearOptions(options));
  GroupedLinear grouped = make_layer(
      GroupedLinearOptions(options).gemm_backend(torchmoe::GemmBackend::kCublasLtGrouped));
  const torch::Tensor x = make_input(), dy = make_grad();
  const torch::Tensor device_splits = torch::tensor(kSplits, torch::kLong).to(torch::kCUDA);
  auto run = [&](GroupedLinear& m, const torchmoe::SplitSizes& splits) {
    m->zero_grad();
    const torch::Tensor input = x.detach().requires_grad_(true);
    torch::Tensor y;
    {
      const fp8::Autocast guard(recipe);
      y = m(input, splits);
    }
    y.backward(dy);
    return std::make_tuple(y.detach(), input.grad(), grads_of(*m, "weight", kGroups));
  };
  const auto [y_ref, dx_ref, dw_ref] = run(per_group, kSplits);
  const auto [y, dx, dw] = run(grouped, device_splits);
  auto close = [](const torch::Tensor& a, const torch::Tensor& e, const std::string& what) {
    INFO(what);
    const torch::Tensor a64 = a.to(torch::kCPU, torch::kFloat64),
                        e64 = e.to(torch::kCPU, torch::kFloat64);
    REQUIRE_FALSE(a64.isnan().any().item<bool>());
    // bf16 outputs of the same fp32 sums in another order: a few bf16 ulps per element.
    CHECK(((a64 - e64).abs() - 2e-2 * e64.abs() - 1e-3 * e64.abs().max()).max().item<double>() <=
          0.0);
  };
  close(y, y_ref, "y");
  close(dx, dx_ref, "dx");
  for (int64_t g = 0; g < kGroups; ++g)
    close(dw[g], dw_ref[g], "dW of expert " + std::to_string(g));
}
