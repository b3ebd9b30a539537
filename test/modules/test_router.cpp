// TopKRouter: choices and probabilities vs a reference, aux and z losses vs their formulas
// written out as loops, finite-difference gradients (float64), expert bias, capacity, errors.

#include <torchmoe/torchmoe.h>

#include <limits>
#include <sstream>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::RouterScore;
using torchmoe::TopKRouter;
using torchmoe::TopKRouterOptions;

namespace {

TopKRouter make_router(TopKRouterOptions options) {
  torch::manual_seed(3);
  return TopKRouter(options.params_dtype(torch::kFloat64));
}

}  // namespace

TEST_CASE("TopKRouter picks the top-k scores and (re)normalises", "[modules][router]") {
  const auto score = GENERATE(RouterScore::kSoftmax, RouterScore::kSigmoid);
  const bool normalize = GENERATE(false, true);
  const int64_t topk = GENERATE(1, 2, 3);
  INFO("sigmoid=" << (score == RouterScore::kSigmoid) << " normalize=" << normalize
                  << " topk=" << topk);
  TopKRouter router =
      make_router(TopKRouterOptions(16, 6, topk).score_function(score).normalize_topk(normalize));
  const torch::Tensor x = torch::randn({2, 9, 16}, torch::kFloat64);
  const auto out = router(x);
  REQUIRE(out.indices.sizes() == torch::IntArrayRef({18, topk}));
  const torch::Tensor logits = x.reshape({18, 16}).matmul(router->weight.t()).detach();
  const torch::Tensor scores =
      score == RouterScore::kSoftmax ? torch::softmax(logits, 1) : torch::sigmoid(logits);
  for (int64_t t = 0; t < 18; ++t) {
    // The chosen experts are those whose score is not beaten by any unchosen expert.
    std::vector<double> row(scores.size(1));
    for (int64_t e = 0; e < scores.size(1); ++e) row[e] = scores[t][e].item<double>();
    std::vector<double> sorted = row;
    std::sort(sorted.rbegin(), sorted.rend());
    double chosen_sum = 0;
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t e = out.indices[t][j].item<int64_t>();
      CHECK(row[e] >= sorted[topk - 1]);
      chosen_sum += row[e];
    }
    for (int64_t j = 0; j < topk; ++j) {
      const double s = row[out.indices[t][j].item<int64_t>()];
      // Stated, the choice holds at every k: at top-1, normalised weights are 1 (HF's Mixtral).
      const double expected = normalize ? s / chosen_sum : s;
      CHECK(out.probs[t][j].item<double>() == Approx(expected).epsilon(1e-12));
    }
  }
  CHECK(out.tokens_per_expert.sum().item<int64_t>() == 18 * topk);
}

TEST_CASE("TopKRouter aux loss and z-loss follow their formulas", "[modules][router]") {
  const auto score = GENERATE(RouterScore::kSoftmax, RouterScore::kSigmoid);
  const int64_t topk = 2, experts = 5, tokens = 11;
  TopKRouter router = make_router(TopKRouterOptions(8, experts, topk)
                                      .score_function(score)
                                      .aux_loss_coeff(0.01)
                                      .z_loss_coeff(0.001));
  const torch::Tensor x = torch::randn({tokens, 8}, torch::kFloat64);
  const auto out = router(x);
  const torch::Tensor logits = x.matmul(router->weight.t()).detach();
  const torch::Tensor scores =
      score == RouterScore::kSoftmax ? torch::softmax(logits, 1) : torch::sigmoid(logits);

  // Switch: coeff · E · Σ_e f_e · P_e, f_e = share of the T·k slots on e, P_e = mean score
  // (sigmoid scores normalised per token first).
  double aux = 0;
  for (int64_t e = 0; e < experts; ++e) {
    double count = 0, score_sum = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t j = 0; j < topk; ++j) count += out.indices[t][j].item<int64_t>() == e;
      double s = scores[t][e].item<double>();
      if (score == RouterScore::kSigmoid) s /= scores[t].sum().item<double>();
      score_sum += s;
    }
    CHECK(out.tokens_per_expert[e].item<int64_t>() == static_cast<int64_t>(count));
    aux += (count / (tokens * topk)) * (score_sum / tokens);
  }
  CHECK(out.aux_loss.item<double>() == Approx(0.01 * experts * aux).epsilon(1e-12));

  double z = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    double sum_exp = 0;
    for (int64_t e = 0; e < experts; ++e) sum_exp += std::exp(logits[t][e].item<double>());
    z += std::pow(std::log(sum_exp), 2);
  }
  CHECK(out.z_loss.item<double>() == Approx(0.001 * z / tokens).epsilon(1e-12));
}

// The default aux_loss_coeff 0: a zero that takes no gradient (on CUDA the top-k kernel writes it),
// which a training loop may still add to its loss.
TEST_CASE("TopKRouter without an aux loss returns a zero without gradient", "[modules][router]") {
  const bool cuda = GENERATE(false, true);
  TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  TopKRouter router(TopKRouterOptions(8, 6, 2).device(device));
  const torch::Tensor x = torch::randn({13, 8}, torch::TensorOptions(device)).requires_grad_(true);
  const auto out = router(x);
  CHECK(out.aux_loss.dim() == 0);
  CHECK(out.aux_loss.item<double>() == 0.0);
  CHECK_FALSE(out.aux_loss.requires_grad());
  (out.probs.sum() + out.aux_loss).backward();
  CHECK(x.grad().defined());
  CHECK(router->weight.grad().defined());
}

TEST_CASE("TopKRouter finite-difference gradients (float64)", "[modules][router]") {
  const auto score = GENERATE(RouterScore::kSoftmax, RouterScore::kSigmoid);
  TopKRouter router = make_router(
      TopKRouterOptions(4, 5, 2).score_function(score).aux_loss_coeff(0.1).z_loss_coeff(0.1));
  const torch::Tensor x = torch::randn({7, 4}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor w = torch::randn({7, 2}, torch::kFloat64);
  // The choice is piecewise constant; small steps do not change it for random inputs.
  auto loss = [&] {
    const auto out = router(x);
    return (out.probs * w).sum() + out.aux_loss + out.z_loss;
  };
  loss().backward();
  check_finite_differences(loss, {{"x", x}, {"weight", router->weight}});
}

TEST_CASE("TopKRouter expert bias steers the choice and follows the load", "[modules][router]") {
  TopKRouter router =
      make_router(TopKRouterOptions(8, 4, 1).expert_bias(true).expert_bias_update_rate(0.5));
  const torch::Tensor x = torch::randn({64, 8}, torch::kFloat64);
  {
    torch::NoGradGuard no_grad;
    router->expert_bias.copy_(torch::tensor({0.0, 0.0, 10.0, 0.0}));
    router->expert_load.zero_();
  }
  const auto biased = router(x);
  CHECK((biased.indices == 2).all().item<bool>());
  // The bias only steers the choice: the probability is still expert 2's softmax score.
  const torch::Tensor scores = torch::softmax(x.matmul(router->weight.t()), 1).detach();
  check_close(biased.probs, scores.select(1, 2).unsqueeze(1), {1e-12, 0}, "probs without bias");
  // Expert 2 took every token: its bias goes down by the rate, the idle experts' up.
  router->update_expert_bias();
  check_close(router->expert_bias, torch::tensor({0.5, 0.5, 9.5, 0.5}), {0, 1e-6}, "updated bias");
  CHECK(router->expert_load.sum().item<double>() == 0);
  // Evaluation does not count load.
  router->eval();
  router(x);
  CHECK(router->expert_load.sum().item<double>() == 0);
}

TEST_CASE("TopKRouter capacity keeps each expert's most probable tokens", "[modules][router]") {
  const int64_t tokens = 40, experts = 4, topk = 2;
  TopKRouter router = make_router(TopKRouterOptions(8, experts, topk).capacity_factor(0.5));
  TopKRouter dropless = make_router(TopKRouterOptions(8, experts, topk));
  const torch::Tensor x = torch::randn({tokens, 8}, torch::kFloat64);
  const auto out = router(x);
  const auto all = dropless(x);
  const int64_t capacity = 10;  // ceil(40·2/4 · 0.5)
  for (int64_t e = 0; e < experts; ++e) {
    INFO("expert " << e);
    const torch::Tensor chosen = all.indices == e;
    const torch::Tensor kept = out.indices == e;
    const int64_t routed = chosen.sum().item<int64_t>();
    CHECK(kept.sum().item<int64_t>() == std::min(routed, capacity));
    CHECK((kept <= chosen).all().item<bool>());
    if (routed > capacity) {
      // Every kept probability is at least every dropped one.
      const double min_kept = all.probs.masked_select(kept).min().item<double>();
      const double max_dropped = all.probs.masked_select(chosen & ~kept).max().item<double>();
      CHECK(min_kept >= max_dropped);
    }
  }
  CHECK(torch::equal(out.probs.masked_select(out.indices < 0),
                     torch::zeros({(out.indices < 0).sum().item<int64_t>()}, torch::kFloat64)));
}

TEST_CASE("TopKRouter errors", "[modules][router]") {
  CHECK_THROWS_WITH(TopKRouter(4, 3, 4), Contains("topk must be in [1, num_experts=3], got 4"));
  CHECK_THROWS_WITH(TopKRouter(4, 0, 1), Contains("num_experts must be positive"));
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(4, 3, 1).capacity_factor(0.0)),
                    Contains("capacity_factor must be finite and positive"));
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(4, 3, 1).capacity_factor(inf)),
                    Contains("capacity_factor must be finite and positive, got inf"));
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(4, 3, 1).expert_bias_update_rate(-inf)),
                    Contains("expert_bias_update_rate must be finite and >= 0, got -inf"));
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(4, 3, 1).aux_loss_coeff(inf)),
                    Contains("loss coefficients must be finite and >= 0"));
  // Changed after construction: checked where used.
  TopKRouter capped(TopKRouterOptions(4, 3, 1).capacity_factor(1.0));
  capped->options.capacity_factor(std::numeric_limits<double>::quiet_NaN());
  CHECK_THROWS_WITH(capped(torch::randn({2, 4})),
                    Contains("expert_capacity: capacity_factor must be finite and positive"));
  // A capacity of k·T/E·factor with k < 1 would be negative.
  CHECK_THROWS_WITH(torchmoe::expert_capacity(4, TopKRouterOptions(6, 4, -3).capacity_factor(1.0)),
                    Contains("expert_capacity: topk must be >= 1, got -3"));
  TopKRouter router(4, 3, 1);
  CHECK_THROWS_WITH(router(torch::randn({2, 5})),
                    Contains("x must be [..., hidden=4], got [2, 5]"));
  CHECK_THROWS_WITH(router(torch::ones({2, 4}, torch::kLong)),
                    Contains("x must have a floating dtype"));
}

TEST_CASE("TopKRouter normalises by default for k > 1 only", "[modules][router]") {
  const torch::Tensor x = torch::randn({7, 16}, torch::kFloat64);
  const auto top1 = make_router(TopKRouterOptions(16, 6, 1))(x);
  CHECK((top1.probs < 1).all().item<bool>());  // the score itself (Switch Transformer)
  const auto top2 = make_router(TopKRouterOptions(16, 6, 2))(x);
  CHECK(torch::allclose(top2.probs.sum(1), torch::ones({7}, torch::kFloat64)));
}

TEST_CASE("TopKRouter with groups, a routed scale and a logit bias", "[modules][router]") {
  // DeepSeek-V3's rule (the choice against ops/router's reference in test/ops/test_router.cpp):
  // here, that the module passes its options through, and the bias parameter's gradient.
  TopKRouter router = make_router(TopKRouterOptions(16, 8, 2)
                                      .score_function(RouterScore::kSigmoid)
                                      .num_groups(4)
                                      .topk_groups(1)
                                      .routed_scaling_factor(2.5)
                                      .bias(true));
  REQUIRE(router->bias.sizes() == torch::IntArrayRef({8}));
  REQUIRE(router->named_parameters().contains("bias"));
  const torch::Tensor x = torch::randn({11, 16}, torch::kFloat64);
  const auto out = router(x);
  const torch::Tensor groups = out.indices.div(2, "floor");       // groups of 2 experts
  CHECK(torch::equal(groups.select(1, 0), groups.select(1, 1)));  // one group kept: both in it
  CHECK(torch::allclose(out.probs.sum(1), torch::full({11}, 2.5, torch::kFloat64)));
  // d(Σ probs · w)/d bias against finite differences of the same loss.
  const torch::Tensor w = torch::randn({11, 2}, torch::kFloat64);
  (out.probs * w).sum().backward();
  const torch::Tensor analytic = router->bias.grad().clone();
  const double h = 1e-6;
  for (int64_t e = 0; e < 8; ++e) {
    auto loss_at = [&](double delta) {
      const torch::NoGradGuard no_grad;
      router->bias[e] += delta;
      const auto o = router(x);
      router->bias[e] -= delta;
      REQUIRE(torch::equal(o.indices, out.indices));  // the same choices either side
      return (o.probs * w).sum().item<double>();
    };
    CHECK(analytic[e].item<double>() == Approx((loss_at(h) - loss_at(-h)) / (2 * h)).margin(1e-7));
  }
  std::ostringstream printed;
  printed << *router;
  CHECK(printed.str() ==
        "torchmoe::TopKRouter(hidden=16, num_experts=8, topk=2, score_function=sigmoid, "
        "normalize_topk=true, num_groups=4, topk_groups=1, routed_scaling_factor=2.5, bias=true)");
}

TEST_CASE("TopKRouter refuses group settings it cannot apply", "[modules][router][errors]") {
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(16, 8, 2).num_groups(3)),
                    Contains("TopKRouter: num_groups must divide num_experts=8 into groups of at "
                             "least 2 experts, got 3"));
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(16, 8, 2).num_groups(4).topk_groups(0)),
                    Contains("topk_groups must be in [1, num_groups=4], got 0"));
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(16, 8, 3).num_groups(4).topk_groups(1)),
                    Contains("topk=3 must be at most the 2 experts of topk_groups=1 groups"));
  CHECK_THROWS_WITH(TopKRouter(TopKRouterOptions(16, 8, 2).routed_scaling_factor(-1)),
                    Contains("routed_scaling_factor must be finite and positive, got -1"));
  TopKRouter router(TopKRouterOptions(16, 8, 2));
  router->options.bias(true);
  CHECK_THROWS_WITH(router(torch::randn({3, 16})),
                    Contains("TopKRouter: bias was off when the router was built"));
}
