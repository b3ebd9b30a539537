// ForkFunction and RouterLogitsFunction with a RouterGradLink (how MoELayer gives x to its router
// and its permutation): x's gradient equals autograd's sum of the two branches' without the link,
// with either branch unused too; the router's product is added by its GEMM, in place (fp32 and
// fp64, and bf16 on CUDA's tensor cores) where the layer vouches for the other branch. The same
// link carries the probabilities' gradient from route_tokens' permutation to RouterTopKFunction.

#include <torchmoe/autograd/router_function.h>
#include <torchmoe/autograd/token_permutation_function.h>

#include <memory>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::autograd::ForkFunction;
using torchmoe::autograd::RouterGradLink;
using torchmoe::autograd::RouterLogitsFunction;

namespace {

enum class Branches { kBoth, kRouterOnly, kOtherOnly };

// Softmax top-2, normalised, without losses.
torchmoe::ops::RouterScoring top2_normalized() {
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 2;
  scoring.normalize = true;
  return scoring;
}

// x's gradient of router(x) · a + x · b (each branch left out as asked), with or without the link.
torch::Tensor grad_x(const torch::Tensor& x0, const torch::Tensor& weight, const torch::Tensor& a,
                     const torch::Tensor& b, Branches branches, bool linked) {
  const torch::Tensor x = x0.detach().requires_grad_(true);
  const auto link = linked ? std::make_shared<RouterGradLink>() : nullptr;
  // The other branch's gradient comes from one product, which returns a tensor of its own.
  if (link) link->other_branch_exclusive = true;
  const torch::autograd::variable_list forked = ForkFunction::apply(x, link);
  const torch::Tensor logits = RouterLogitsFunction::apply(forked[0], weight, std::nullopt, link);
  torch::Tensor loss = torch::zeros({}, a.options());
  if (branches != Branches::kOtherOnly) loss = loss + (logits * a).sum();
  if (branches != Branches::kRouterOnly) loss = loss + (forked[1] * b).to(a.scalar_type()).sum();
  loss.backward();
  return x.grad();
}

}  // namespace

TEST_CASE("the router's input gradient through a linked fork equals autograd's sum",
          "[autograd][router]") {
  torch::manual_seed(59);
  const auto f64 = torch::TensorOptions(torch::kFloat64);
  const torch::Tensor x = torch::randn({9, 5}, f64);
  const torch::Tensor weight = torch::randn({4, 5}, f64);
  const torch::Tensor a = torch::randn({9, 4}, f64);
  const torch::Tensor b = torch::randn({9, 5}, f64);
  for (const Branches branches : {Branches::kBoth, Branches::kRouterOnly, Branches::kOtherOnly}) {
    INFO("branches " << static_cast<int>(branches));
    check_close(grad_x(x, weight, a, b, branches, true), grad_x(x, weight, a, b, branches, false),
                {1e-12, 1e-12}, "grad x");
  }
}

// bf16 on CUDA: the router's product (its gradient in bf16 halves) is added into the other
// branch's gradient by one GEMM, rounded once; autograd's sum rounds both and their sum.
TEST_CASE("the router's input gradient through a linked fork on CUDA (bf16)",
          "[autograd][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  torch::manual_seed(61);
  const auto bf16 = torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor x = torch::randn({300, 256}, bf16);
  const torch::Tensor weight = torch::randn({16, 256}, bf16) * 0.1;
  const torch::Tensor a = torch::randn({300, 16}, bf16.dtype(torch::kFloat32));
  const torch::Tensor b = torch::randn({300, 256}, bf16);
  // float64 reference: a · W + b.
  const torch::Tensor expected =
      (a.to(torch::kFloat64).matmul(weight.to(torch::kFloat64)) + b.to(torch::kFloat64)).cpu();
  for (const Branches branches : {Branches::kBoth, Branches::kRouterOnly, Branches::kOtherOnly}) {
    INFO("branches " << static_cast<int>(branches));
    const torch::Tensor linked = grad_x(x, weight, a, b, branches, true);
    const torch::Tensor plain = grad_x(x, weight, a, b, branches, false);
    CHECK(linked.scalar_type() == torch::kBFloat16);
    check_close(linked, plain, {2e-2, 2e-2}, "grad x against autograd's sum");
    if (branches == Branches::kBoth) check_close(linked, expected, {1e-2, 1e-2}, "grad x");
  }
}

namespace {

// Without other_branch_exclusive the fork adds into a copy: here the other branch's gradient is
// the very tensor an add hands to y too, which must keep its value.
void check_shared_gradient_untouched(const torch::TensorOptions& options) {
  torch::manual_seed(67);
  const torch::Tensor x = torch::randn({64, 128}, options).requires_grad_(true);
  const torch::Tensor y = torch::randn({64, 128}, options).requires_grad_(true);
  const torch::Tensor weight = torch::randn({8, 128}, options) * 0.1;
  const auto link = std::make_shared<RouterGradLink>();
  const torch::autograd::variable_list forked = ForkFunction::apply(x, link);
  const torch::Tensor logits = RouterLogitsFunction::apply(forked[0], weight, std::nullopt, link);
  torch::autograd::backward({logits.sum(), forked[1] + y},
                            {torch::ones({}, logits.options()), torch::ones_like(y)});
  CHECK(torch::equal(y.grad(), torch::ones_like(y)));
  const torch::Tensor expected =
      weight.to(torch::kFloat64).sum(0, true).expand({64, 128}) + 1;  // Σ_e W[e] + 1
  check_close(x.grad(), expected.to(options.dtype()), {1e-2, 1e-2}, "grad x");
}

}  // namespace

// fp32 and fp64: the product is added in place where it may be.
TEST_CASE("a linked fork leaves a gradient tensor it shares untouched", "[autograd][router]") {
  const torch::Dtype dtype = GENERATE(torch::kFloat32, torch::kFloat64);
  INFO("dtype=" << dtype);
  check_shared_gradient_untouched(torch::TensorOptions(dtype));
}

TEST_CASE("a linked fork leaves a gradient tensor it shares untouched on CUDA (bf16)",
          "[autograd][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  check_shared_gradient_untouched(torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA));
}

// The probabilities' gradient goes to the top-k holding the link only when route_tokens is given
// that top-k's own probabilities: anything else (here a product of them) is refused, as its
// gradient would reach the top-k without the product's.
TEST_CASE("route_tokens takes a probs link only with the linked top-k's probabilities",
          "[autograd][router][errors]") {
  using torchmoe::autograd::RouterTopKFunction;
  torch::manual_seed(79);
  const torch::Tensor logits = torch::randn({6, 4}).requires_grad_(true);
  const torch::Tensor tokens = torch::randn({6, 8});
  const auto link = std::make_shared<RouterGradLink>();
  const torch::autograd::variable_list scored =
      RouterTopKFunction::apply(logits, std::nullopt, top2_normalized(), link);
  const torch::Tensor& indices = scored[0];
  const torch::Tensor& probs = scored[1];
  CHECK_NOTHROW(torchmoe::autograd::route_tokens(tokens, indices, 4, probs,
                                                 torchmoe::ops::IndexTrust::kDropless, link));
  CHECK_THROWS_WITH(
      torchmoe::autograd::route_tokens(tokens, indices, 4, probs * 2,
                                       torchmoe::ops::IndexTrust::kDropless, link),
      Contains("route_tokens: with a probs_link, probs must be the probabilities of the "
               "RouterTopKFunction given that link, unchanged; got a tensor from MulBackward"));
  const auto other = std::make_shared<RouterGradLink>();
  CHECK_THROWS_WITH(torchmoe::autograd::route_tokens(tokens, indices, 4, probs,
                                                     torchmoe::ops::IndexTrust::kDropless, other),
                    Contains("with a probs_link, probs must be the probabilities of the "
                             "RouterTopKFunction given that link"));
}

// Through the link the top-k gets the rows' gradient of the probabilities, read back through the
// row map: the logits' gradient equals the unlinked route's (which permutes and unpermutes the
// probabilities as ordinary tensors).
TEST_CASE("the probabilities' gradient through a probs link equals autograd's",
          "[autograd][router]") {
  using torchmoe::autograd::RouterTopKFunction;
  torch::manual_seed(83);
  const torch::Tensor logits0 = torch::randn({9, 5}, torch::kFloat64);
  const torch::Tensor tokens = torch::randn({9, 3}, torch::kFloat64);
  auto grad_logits = [&](bool linked) {
    const torch::Tensor logits = logits0.clone().requires_grad_(true);
    const auto link = linked ? std::make_shared<RouterGradLink>() : nullptr;
    const torch::autograd::variable_list scored =
        RouterTopKFunction::apply(logits, std::nullopt, top2_normalized(), link);
    const torchmoe::PermutedTokens routed = torchmoe::autograd::route_tokens(
        tokens, scored[0], 5, scored[1], torchmoe::ops::IndexTrust::kDropless, link);
    // A loss of the rows' probabilities with a different weight per row.
    const torch::Tensor weights =
        torch::arange(1, routed.probs.size(0) + 1, routed.probs.options());
    (routed.probs * weights).sum().backward();
    return logits.grad();
  };
  check_close(grad_logits(true), grad_logits(false), {1e-12, 1e-12}, "grad logits");
}
