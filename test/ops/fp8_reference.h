#pragma once
// The float64 references of FP8 grouped products and their tolerance, shared by the op tests
// (test/ops/test_grouped_gemm_fp8.cpp) and the layer tests (test/modules/
// test_grouped_linear_fp8_cuda.cpp): each product with Σ|a·b| per element, the bound the tensor
// cores' accumulation keeps to relative to it, and the elementwise check.

#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace torchmoe::test {

// A product and Σ|a·b| per element (what the accumulation error scales with).
struct Product {
  torch::Tensor value, abs_sum;
};

// y rows of g = A_g · B_gᵀ: A [M, kk] in row blocks of `sizes`, B [G·nn, kk] in groups of nn rows.
inline Product per_split_abt(const torch::Tensor& a, const torch::Tensor& b,
                             const std::vector<int64_t>& sizes, int64_t nn) {
  Product p{torch::zeros({a.size(0), nn}, torch::kFloat64),
            torch::zeros({a.size(0), nn}, torch::kFloat64)};
  int64_t start = 0;
  for (size_t g = 0; g < sizes.size(); ++g) {
    const torch::Tensor ag = a.narrow(0, start, sizes[g]);
    const torch::Tensor bg = b.narrow(0, static_cast<int64_t>(g) * nn, nn);
    p.value.narrow(0, start, sizes[g]).copy_(ag.mm(bg.t()));
    p.abs_sum.narrow(0, start, sizes[g]).copy_(ag.abs().mm(bg.abs().t()));
    start += sizes[g];
  }
  return p;
}

// dW_g = A_gᵀ · X_g over the rows of split g: [G, nn, kk].
inline Product per_split_atb(const torch::Tensor& a, const torch::Tensor& x,
                             const std::vector<int64_t>& sizes) {
  const auto groups = static_cast<int64_t>(sizes.size());
  Product p{torch::zeros({groups, a.size(1), x.size(1)}, torch::kFloat64),
            torch::zeros({groups, a.size(1), x.size(1)}, torch::kFloat64)};
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const torch::Tensor ag = a.narrow(0, start, sizes[g]), xg = x.narrow(0, start, sizes[g]);
    p.value[g].copy_(ag.t().mm(xg));
    p.abs_sum[g].copy_(ag.abs().t().mm(xg.abs()));
    start += sizes[g];
  }
  return p;
}

// The output's rounding: bf16 keeps 8 significant bits (relative error <= 2^-8 under
// round-to-nearest), fp32 24 (with the scale multiplications, a few ulps).
inline double output_rtol(torch::Dtype dtype) { return dtype == torch::kBFloat16 ? 4e-3 : 1e-6; }

// The accumulation, per element relative to Σ|a·b|: Hopper's FP8 tensor cores keep their partial
// sums with about 14 significant bits, truncating; without fast accumulation the partial sums
// are promoted to fp32 every few instructions (and every 128-element block with block scales),
// with fast accumulation (fprop's default) they stay in the tensor core across the whole K.
// Measured on the H100: up to 6e-4 without fast accumulation for K <= 384. Wrong scales or
// offsets give errors of the order of Σ|a·b| itself, hundreds of times over either bound.
constexpr double kAccumulationTol = 2e-3;
constexpr double kFastAccumulationTol = 4e-3;

// |actual - expected| <= allowance elementwise, no NaN; reports the worst element.
inline void check_within(const torch::Tensor& actual, const torch::Tensor& expected,
                         const torch::Tensor& allowance, const std::string& what) {
  INFO(what);
  REQUIRE(actual.defined());
  REQUIRE(actual.sizes() == expected.sizes());
  const torch::Tensor a = actual.detach().to(torch::kCPU, torch::kFloat64);
  REQUIRE_FALSE(a.isnan().any().item<bool>());
  if (a.numel() == 0) return;
  const torch::Tensor excess = ((a - expected).abs() - allowance).flatten();
  const int64_t worst = excess.argmax().item<int64_t>();
  INFO("worst element " << worst << ": actual " << a.flatten()[worst].item<double>()
                        << ", expected " << expected.flatten()[worst].item<double>()
                        << ", allowed difference " << allowance.flatten()[worst].item<double>());
  CHECK(excess[worst].item<double>() <= 0.0);
}

}  // namespace torchmoe::test
