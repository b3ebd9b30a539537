// Every torchmoe autograd Function's backward runs untraced kernels and ops: under create_graph its
// gradients are the ordinary ones, and differentiating them again is an error naming the Function
// rather than a silently missing second-order term. (AllToAllFunction: the [ep] tests.)

#include <torchmoe/autograd/router_function.h>
#include <torchmoe/torchmoe.h>

#include <string>
#include <vector>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

namespace {

// The gradients of `loss` with create_graph equal the plain ones, and a backward through them is
// refused with `function`'s name.
void check_once_differentiable(const std::function<torch::Tensor()>& loss,
                               const std::vector<torch::Tensor>& inputs, const char* function) {
  const std::vector<torch::Tensor> plain = torch::autograd::grad({loss()}, inputs);
  const std::vector<torch::Tensor> graphed =
      torch::autograd::grad({loss()}, inputs, {}, /*retain_graph=*/true, /*create_graph=*/true);
  torch::Tensor second = torch::zeros({}, torch::kFloat64);
  for (size_t i = 0; i < inputs.size(); ++i) {
    INFO(function << " input " << i);
    REQUIRE(graphed[i].defined());
    CHECK(torch::equal(graphed[i], plain[i]));
    second = second + graphed[i].to(torch::kFloat64).square().sum();
  }
  REQUIRE_THROWS_WITH(second.backward(),
                      Contains(std::string("torchmoe::autograd::") + function +
                               ": a second derivative through this function is not supported"));
}

}  // namespace

TEST_CASE("torchmoe Functions refuse a second derivative instead of dropping it",
          "[autograd][errors]") {
  torch::manual_seed(31);
  const auto f64 = torch::TensorOptions(torch::kFloat64);

  torchmoe::GroupedLinear linear(
      torchmoe::GroupedLinearOptions(3, 5, 4).params_dtype(torch::kFloat64));
  const torch::Tensor x = torch::randn({7, 5}, f64).requires_grad_(true);
  const std::vector<int64_t> splits = {3, 0, 4};
  check_once_differentiable([&] { return linear(x, splits).square().sum(); },
                            {x, linear->weight_parameters()[0]}, "GroupedLinearFunction");

  const torch::Tensor gate_input = torch::randn({6, 8}, f64).requires_grad_(true);
  const torch::Tensor scales = torch::rand({6}, f64).requires_grad_(true);
  check_once_differentiable(
      [&] { return torchmoe::functional::scaled_swiglu(gate_input, scales).square().sum(); },
      {gate_input, scales}, "GluFunction");

  torchmoe::TopKRouter router(
      torchmoe::TopKRouterOptions(5, 4, 2).params_dtype(torch::kFloat64).aux_loss_coeff(0));
  const torch::Tensor tokens = torch::randn({9, 5}, f64).requires_grad_(true);
  check_once_differentiable([&] { return router(tokens).probs.square().sum(); }, {tokens},
                            "RouterLogitsFunction");

  check_once_differentiable(
      [&] {
        const auto forked = torchmoe::autograd::ForkFunction::apply(tokens, nullptr);
        return (forked[0] * 2 + forked[1]).square().sum();
      },
      {tokens}, "ForkFunction");

  const torch::Tensor indices = torch::tensor({{0, 2}, {1, 2}, {3, 0}}, torch::kLong);
  const torch::Tensor rows = torch::randn({3, 4}, f64).requires_grad_(true);
  check_once_differentiable(
      [&] {
        const torchmoe::PermutedTokens routed =
            torchmoe::functional::permute_tokens(rows, indices, 4);
        return routed.tokens.square().sum();
      },
      {rows}, "PermuteFunction");
  const torch::Tensor permuted = torch::randn({6, 4}, f64).requires_grad_(true);
  const torchmoe::PermutedTokens routed =
      torchmoe::functional::permute_tokens(rows.detach(), indices, 4);
  check_once_differentiable(
      [&] { return torchmoe::functional::unpermute_tokens(permuted, routed).square().sum(); },
      {permuted}, "UnpermuteFunction");
}
