// autograd::grouped_linear used directly: one gradient per input, only for inputs that require one.

#include <torchmoe/autograd/grouped_linear_function.h>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::autograd::grouped_linear;
using torchmoe::autograd::GroupedLinearConfig;

TEST_CASE("grouped_linear computes only the gradients that are needed", "[autograd]") {
  torch::manual_seed(9);
  const bool input_grad = GENERATE(false, true);
  const bool weight_grad = GENERATE(false, true);
  const bool bias_grad = GENERATE(false, true);
  if (!input_grad && !weight_grad && !bias_grad) return;  // nothing to differentiate
  INFO("input_grad=" << input_grad << " weight_grad=" << weight_grad << " bias_grad=" << bias_grad);
  const auto f64 = torch::kFloat64;
  const torch::Tensor x = torch::randn({7, 5}, f64).requires_grad_(input_grad);
  const std::vector<int64_t> splits = {3, 0, 4};
  auto config = c10::make_intrusive<GroupedLinearConfig>();
  config->plan = torchmoe::ops::plan_grouped_gemms("test", x, {torchmoe::ops::GemmShape{2, 5, 3}},
                                                   splits, torchmoe::GemmBackend::kAuto)
                     .front();
  std::vector<torch::Tensor> w, b;
  for (int g = 0; g < 3; ++g) {
    w.push_back(torch::randn({2, 5}, f64).requires_grad_(weight_grad));
    b.push_back(torch::randn({2}, f64).requires_grad_(bias_grad));
  }
  const torch::Tensor y =
      grouped_linear(x, std::nullopt, at::TensorList(w), at::TensorList(b), config);
  const torch::Tensor dy = torch::randn({7, 2}, f64);
  y.backward(dy);
  const Reference ref = reference_grouped_linear(x, splits, w, b, dy);
  check_close(y, ref.output, tolerance_for(f64), "output");
  CHECK(x.grad().defined() == input_grad);
  if (input_grad) check_close(x.grad(), ref.grad_input, tolerance_for(f64), "dx");
  for (int g = 0; g < 3; ++g) {
    CHECK(w[g].grad().defined() == weight_grad);
    CHECK(b[g].grad().defined() == bias_grad);
    if (weight_grad) check_close(w[g].grad(), ref.grad_weights[g], tolerance_for(f64), "dW");
    if (bias_grad) check_close(b[g].grad(), ref.grad_biases[g], tolerance_for(f64), "db");
  }
}

TEST_CASE("grouped_linear validates its layout arguments", "[autograd][errors]") {
  const torch::Tensor x = torch::randn({2, 3});
  auto config = c10::make_intrusive<GroupedLinearConfig>();
  config->plan =
      torchmoe::ops::plan_grouped_gemms("test", x, {torchmoe::ops::GemmShape{2, 3, 2}},
                                        std::vector<int64_t>{1, 1}, torchmoe::GemmBackend::kAuto)
          .front();
  config->grouped_weight = true;
  std::vector<torch::Tensor> w = {torch::randn({2, 3}), torch::randn({2, 3})};
  REQUIRE_THROWS_WITH(grouped_linear(x, std::nullopt, at::TensorList(w), at::TensorList(), config),
                      Contains("weights must be one 3-D tensor when grouped, got 2 tensor(s)"));
}

TEST_CASE("grouped_linear differentiates weights that have history", "[autograd]") {
  torch::manual_seed(10);
  const auto f64 = torch::kFloat64;
  const torch::Tensor x = torch::randn({5, 4}, f64);
  const std::vector<int64_t> splits = {2, 3};
  auto config = c10::make_intrusive<GroupedLinearConfig>();
  config->plan = torchmoe::ops::plan_grouped_gemms("test", x, {torchmoe::ops::GemmShape{3, 4, 2}},
                                                   splits, torchmoe::GemmBackend::kAuto)
                     .front();
  // Each weight is an expression of one leaf, as under a reparametrisation: its edge is its
  // history, made for this call.
  const torch::Tensor base = torch::randn({2, 3, 4}, f64).requires_grad_(true);
  const torch::Tensor scaled = base * 3;
  const std::vector<torch::Tensor> w = scaled.unbind(0);
  torchmoe::autograd::GroupedLinearEdges kept;
  const torch::Tensor dy = torch::randn({5, 3}, f64);
  grouped_linear(x, std::nullopt, at::TensorList(w), at::TensorList(), config, &kept).backward(dy);
  const Reference ref = reference_grouped_linear(x, splits, w, {}, dy);
  check_close(base.grad(), 3 * torch::stack(ref.grad_weights), tolerance_for(f64), "d base");
}
