// The router's logits op (ops/router.h) against float64 ATen: fp32 logits from 16-bit operands on
// tensor cores (no cast), and the gradients through the hi + lo split of the fp32 grad_logits.
// Axes: dtype (bf16, fp16), shapes with a token count that is not a multiple of a tile and a
// hidden width that is not a power of two; mixed dtypes and the CPU take the cast path.

#include <torchmoe/ops/router.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

namespace {

struct Case {
  torch::Tensor x, weight, grad_logits;
};

Case make_case(torch::Dtype dtype, const torch::Device& device, int64_t tokens, int64_t hidden,
               int64_t experts) {
  torch::manual_seed(41);
  Case c;
  c.x = torch::randn({tokens, hidden}).to(device, dtype);
  c.weight = (torch::randn({experts, hidden}) * 0.05).to(device, dtype);
  // Softmax-like gradients: rows summing to ~0, spread over a few orders of magnitude.
  const torch::Tensor g = torch::randn({tokens, experts}) * torch::rand({tokens, 1}) * 1e-3;
  c.grad_logits = (g - g.mean(1, true)).to(device);
  return c;
}

double unit_roundoff(torch::Dtype dtype) { return dtype == torch::kBFloat16 ? 0x1p-8 : 0x1p-11; }

}  // namespace

TEST_CASE("router logits: 16-bit operands on CUDA give fp32 logits and gradients",
          "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const torch::Dtype dtype = GENERATE(torch::kBFloat16, torch::kHalf);
  const int64_t tokens = GENERATE(1, 333);  // one token; not a multiple of any tile
  INFO("dtype=" << dtype << " tokens=" << tokens);
  const Case c = make_case(dtype, torch::kCUDA, tokens, 200, 24);
  const torch::Tensor logits = torchmoe::ops::router_logits(c.x, c.weight);
  CHECK(logits.scalar_type() == torch::kFloat32);
  const torch::Tensor x64 = c.x.to(torch::kCPU, torch::kFloat64);
  const torch::Tensor w64 = c.weight.to(torch::kCPU, torch::kFloat64);
  // The operands are exact in fp32 and so are their products: only the fp32 sum differs.
  check_close(logits, x64.mm(w64.t()), {1e-5, 1e-5}, "logits");

  const auto grads = torchmoe::ops::router_logits_backward(c.grad_logits, c.x, c.weight,
                                                           torchmoe::ops::RouterGradX::kNow, true);
  REQUIRE(grads.grad_x.scalar_type() == dtype);
  REQUIRE(grads.grad_weight.scalar_type() == dtype);
  const torch::Tensor g64 = c.grad_logits.to(torch::kCPU, torch::kFloat64);
  // About one rounding to the 16-bit result (bf16's hi + lo split, ops/router.h; fp16's cast
  // path). A single bf16 rounding of grad_logits instead of hi + lo fails this on 8 071 of the
  // 66 600 grad_x elements of the 333-token case.
  const torch::Tensor dx = g64.mm(w64), dw = g64.t().mm(x64);
  const double ulp = unit_roundoff(dtype);
  // fp16 results this small are subnormal: their spacing is 2^-24 whatever the value.
  const double subnormal = dtype == torch::kHalf ? 0x1p-24 : 0.0;
  auto atol = [&](const torch::Tensor& t) {
    return std::max(1e-3 * ulp * t.abs().max().item<double>(), subnormal);
  };
  check_close(grads.grad_x, dx, {2 * ulp, atol(dx)}, "grad x");
  check_close(grads.grad_weight, dw, {2 * ulp, atol(dw)}, "grad weight");

  const auto only_x = torchmoe::ops::router_logits_backward(
      c.grad_logits, c.x, c.weight, torchmoe::ops::RouterGradX::kNow, false);
  CHECK(only_x.grad_x.defined());
  CHECK_FALSE(only_x.grad_weight.defined());

  // Deferred: the same operands (bf16: [hi | lo] and [W; W] from the split's one launch), so
  // router_grad_x later gives the same bits, added into an addend in place.
  const auto deferred = torchmoe::ops::router_logits_backward(
      c.grad_logits, c.x, c.weight, torchmoe::ops::RouterGradX::kDeferred, true);
  CHECK_FALSE(deferred.grad_x.defined());
  CHECK(torch::equal(deferred.grad_weight, grads.grad_weight));
  if (dtype == torch::kBFloat16) {
    CHECK(torch::equal(deferred.grad_x_product.rhs, torch::cat({c.weight, c.weight}, 0)));
  }
  CHECK(torch::equal(torchmoe::ops::router_grad_x(deferred.grad_x_product), grads.grad_x));
  const torch::Tensor addend = torch::randn_like(c.x);
  const torch::Tensor sum = addend.clone();
  const torch::Tensor added = torchmoe::ops::router_grad_x(deferred.grad_x_product, sum);
  // In place on bf16's tensor-core path; fp16's cast path adds into a new tensor.
  CHECK((added.data_ptr() == sum.data_ptr()) == (dtype == torch::kBFloat16));
  // One rounding of the sum (bf16), or of the product and then the sum (fp16's cast path).
  const double product_ulp = 2 * ulp * dx.abs().max().item<double>();
  check_close(added, addend.to(torch::kCPU, torch::kFloat64) + dx, {2 * ulp, product_ulp},
              "grad x added into an addend");

  // A weight that is not contiguous (a transposed copy) gives the same operands and product.
  const torch::Tensor strided = c.weight.t().contiguous().t();
  REQUIRE_FALSE(strided.is_contiguous());
  const auto from_strided = torchmoe::ops::router_logits_backward(
      c.grad_logits, c.x, strided, torchmoe::ops::RouterGradX::kDeferred, false);
  CHECK(torch::equal(from_strided.grad_x_product.rhs, deferred.grad_x_product.rhs));
  // bf16: the same bits ([W; W] is written contiguous); fp16's cast path multiplies the strided
  // fp32 copy, which cuBLAS may sum in another order.
  const torch::Tensor strided_dx = torchmoe::ops::router_grad_x(from_strided.grad_x_product);
  if (dtype == torch::kBFloat16) {
    CHECK(torch::equal(strided_dx, grads.grad_x));
  } else {
    check_close(strided_dx, dx, {2 * ulp, atol(dx)}, "grad x from a strided weight");
  }
}

TEST_CASE("router logits: the cast path (CPU, mixed dtypes) and errors", "[ops][router]") {
  const Case c = make_case(torch::kBFloat16, torch::kCPU, 17, 40, 6);
  const torch::Tensor w32 = c.weight.to(torch::kFloat32);
  const torch::Tensor logits = torchmoe::ops::router_logits(c.x, w32);
  CHECK(logits.scalar_type() == torch::kFloat32);
  check_close(logits, c.x.to(torch::kFloat64).mm(w32.to(torch::kFloat64).t()), {1e-5, 1e-5},
              "logits");
  const auto grads = torchmoe::ops::router_logits_backward(c.grad_logits, c.x, w32,
                                                           torchmoe::ops::RouterGradX::kNow, true);
  CHECK(grads.grad_x.scalar_type() == torch::kBFloat16);
  CHECK(grads.grad_weight.scalar_type() == torch::kFloat32);

  CHECK_THROWS_WITH(torchmoe::ops::router_logits(c.x, c.weight.narrow(1, 0, 39)),
                    Contains("weight must be [experts, hidden=40]"));
  CHECK_THROWS_WITH(torchmoe::ops::router_logits(c.x.to(torch::kLong), c.weight),
                    Contains("must have floating dtypes"));
  CHECK_THROWS_WITH(
      torchmoe::ops::router_logits_backward(c.grad_logits.narrow(1, 0, 5), c.x, c.weight,
                                            torchmoe::ops::RouterGradX::kNow, true),
      Contains("grad_logits must be [tokens=17, experts=6]"));
}

// The weight gradient's halves summed by 16-byte pieces where E·H allows (7 × 200), one element at
// a time otherwise (7 × 203, 7 × 1): within one bf16 rounding of ATen's add of the two halves (the
// op's product is its own cuBLASLt plan, whose fp32 sums may run in another order than at::mm's),
// and within bf16's rounding of float64.
TEST_CASE("router logits: the weight gradient for any experts × hidden (bf16)",
          "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int64_t hidden = GENERATE(200, 203, 1);
  INFO("hidden=" << hidden);
  const int64_t experts = 7;
  const Case c = make_case(torch::kBFloat16, torch::kCUDA, 97, hidden, experts);
  const auto grads = torchmoe::ops::router_logits_backward(
      c.grad_logits, c.x, c.weight, torchmoe::ops::RouterGradX::kDeferred, true);
  // The halves as the op multiplies them ([hi | lo]ᵀ · x in fp32), added by ATen.
  const torch::Tensor halves = torch::mm(grads.grad_x_product.lhs.t(), c.x, torch::kFloat32);
  const torch::Tensor aten_sum =
      (halves.narrow(0, 0, experts) + halves.narrow(0, experts, experts)).to(torch::kBFloat16);
  const double ulp = unit_roundoff(torch::kBFloat16);
  check_close(grads.grad_weight, aten_sum, {2 * ulp, 1e-6 * aten_sum.abs().max().item<double>()},
              "grad weight against ATen's sum of the halves");
  const torch::Tensor dw =
      c.grad_logits.to(torch::kCPU, torch::kFloat64).t().mm(c.x.to(torch::kCPU, torch::kFloat64));
  check_close(grads.grad_weight, dw, {2 * ulp, 1e-3 * ulp * dw.abs().max().item<double>()},
              "grad weight");
}

// The cuBLASLt product takes no empty dimension: empty operands give ATen's empty or zero logits.
TEST_CASE("router logits of empty operands (bf16)", "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto bf16 = torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA);
  using torchmoe::ops::router_logits;
  CHECK(router_logits(torch::randn({5, 8}, bf16), torch::randn({0, 8}, bf16)).sizes() ==
        torch::IntArrayRef({5, 0}));
  CHECK(router_logits(torch::randn({0, 8}, bf16), torch::randn({4, 8}, bf16)).sizes() ==
        torch::IntArrayRef({0, 4}));
  const torch::Tensor no_hidden =
      router_logits(torch::randn({5, 0}, bf16), torch::randn({4, 0}, bf16));
  CHECK(no_hidden.sizes() == torch::IntArrayRef({5, 4}));
  CHECK(no_hidden.scalar_type() == torch::kFloat32);
  CHECK(torch::equal(no_hidden.cpu(), torch::zeros({5, 4})));
}

TEST_CASE("router logits backward rejects operands it cannot multiply", "[ops][router][errors]") {
  using torchmoe::ops::router_logits_backward;
  const torch::Tensor x = torch::randn({5, 8}), weight = torch::randn({4, 8});
  const torch::Tensor grad = torch::randn({5, 4});
  CHECK_THROWS_WITH(router_logits_backward(grad, x, weight.narrow(1, 0, 7),
                                           torchmoe::ops::RouterGradX::kNow, true),
                    Contains("router_logits: weight must be [experts, hidden=8], got [4, 7]"));
  CHECK_THROWS_WITH(router_logits_backward(grad.to(torch::kLong), x, weight,
                                           torchmoe::ops::RouterGradX::kNow, true),
                    Contains("router_logits: grad_logits must have a floating dtype, got Long"));
  CHECK_THROWS_WITH(
      router_logits_backward(grad, x.to(torch::kMeta), weight.to(torch::kMeta),
                             torchmoe::ops::RouterGradX::kNow, true),
      Contains("router_logits: grad_logits must be on meta like x and weight, got cpu"));
  const auto deferred =
      router_logits_backward(grad, x, weight, torchmoe::ops::RouterGradX::kDeferred, false);
  CHECK_FALSE(deferred.grad_weight.defined());
  CHECK_THROWS_WITH(torchmoe::ops::router_grad_x(deferred.grad_x_product, torch::zeros({5, 7})),
                    Contains("router_grad_x: grad_x_addend must be a contiguous Float [5, 8] "
                             "tensor on cpu, got [5, 7]"));
  CHECK_THROWS_WITH(torchmoe::ops::router_grad_x({}),
                    Contains("router_grad_x: the product must be router_logits_backward's"));
  check_close(torchmoe::ops::router_grad_x(deferred.grad_x_product), grad.matmul(weight),
              {1e-6, 1e-6}, "deferred grad x");
  // The addend is added, in place (fp32: the product's operands have x's dtype): x's gradient is
  // it plus grad · W.
  const torch::Tensor addend = torch::randn({5, 8});
  const torch::Tensor sum = addend.clone();
  const torch::Tensor added = torchmoe::ops::router_grad_x(deferred.grad_x_product, sum);
  CHECK(added.data_ptr() == sum.data_ptr());
  check_close(added, addend + grad.matmul(weight), {1e-6, 1e-6}, "grad x with an addend");
  // fp64 grad_logits with fp32 x: the product in fp64, cast, then added into a new tensor.
  const auto mixed = router_logits_backward(grad.to(torch::kFloat64), x, weight.to(torch::kFloat64),
                                            torchmoe::ops::RouterGradX::kDeferred, false);
  const torch::Tensor kept = addend.clone();
  const torch::Tensor mixed_added = torchmoe::ops::router_grad_x(mixed.grad_x_product, kept);
  CHECK(mixed_added.data_ptr() != kept.data_ptr());
  CHECK(torch::equal(kept, addend));
  check_close(mixed_added, addend + grad.matmul(weight), {1e-6, 1e-6}, "grad x, fp64 product");
}

TEST_CASE("router logits with a bias, and its gradient", "[ops][router]") {
  torch::manual_seed(107);
  const torch::Tensor x = torch::randn({13, 24}, torch::kFloat64);
  const torch::Tensor weight = torch::randn({6, 24}, torch::kFloat64);
  const torch::Tensor bias = torch::randn({6}, torch::kFloat64);
  check_close(torchmoe::ops::router_logits(x, weight, bias), x.mm(weight.t()) + bias,
              {1e-12, 1e-12}, "logits");
  const torch::Tensor g = torch::randn({13, 6}, torch::kFloat64);
  const auto grads = torchmoe::ops::router_logits_backward(
      g, x, weight, torchmoe::ops::RouterGradX::kNone, false, {}, bias);
  check_close(grads.grad_bias, g.sum(0), {1e-12, 1e-12}, "grad bias");
  CHECK_FALSE(grads.grad_weight.defined());
  CHECK_THROWS_WITH(torchmoe::ops::router_logits(x, weight, torch::zeros({5}, torch::kFloat64)),
                    Contains("bias must be a floating [experts=6] tensor on cpu, got Double [5]"));
}
