// Group-limited choice (DeepSeek-V3's n_group / topk_group) and the routed scale of the router's
// top-k op: the ATen path against a plain C++ reference of the rule, the CUDA kernel against the
// ATen path, and the settings it refuses.

#include <torchmoe/ops/router.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

namespace {

// Group-limited top-k as DeepSeek-V3 defines it, one token at a time in plain C++ (float64): the
// groups ranked by the sum of their two highest choice scores, the experts of the topk_groups best
// ones ranked by their choice score. Returns each token's experts in ascending order.
std::vector<std::vector<int64_t>> group_limited_reference(const torch::Tensor& keys, int64_t groups,
                                                          int64_t topk_groups, int64_t topk) {
  const torch::Tensor k64 = keys.to(torch::kFloat64).contiguous();
  const int64_t tokens = k64.size(0), experts = k64.size(1), size = experts / groups;
  std::vector<std::vector<int64_t>> chosen(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    const double* row = k64.data_ptr<double>() + t * experts;
    std::vector<std::pair<double, int64_t>> group_scores;
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<double> v(row + g * size, row + (g + 1) * size);
      std::sort(v.rbegin(), v.rend());
      group_scores.emplace_back(v[0] + v[1], g);
    }
    std::sort(group_scores.begin(), group_scores.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    std::vector<std::pair<double, int64_t>> candidates;
    for (int64_t r = 0; r < topk_groups; ++r) {
      const int64_t g = group_scores[r].second;
      for (int64_t e = g * size; e < (g + 1) * size; ++e) candidates.emplace_back(row[e], e);
    }
    std::sort(candidates.begin(), candidates.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int64_t j = 0; j < topk; ++j) chosen[t].push_back(candidates[j].second);
    std::sort(chosen[t].begin(), chosen[t].end());
  }
  return chosen;
}

std::vector<std::vector<int64_t>> sorted_rows(const torch::Tensor& indices) {
  const torch::Tensor sorted = std::get<0>(indices.cpu().sort(1)).contiguous();
  std::vector<std::vector<int64_t>> rows(sorted.size(0));
  for (int64_t t = 0; t < sorted.size(0); ++t) {
    rows[t].assign(sorted[t].data_ptr<int64_t>(), sorted[t].data_ptr<int64_t>() + sorted.size(1));
  }
  return rows;
}

torchmoe::ops::RouterScoring group_scoring(int64_t topk, int64_t groups, int64_t topk_groups,
                                           bool sigmoid, bool normalize, double scale) {
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = topk;
  scoring.sigmoid = sigmoid;
  scoring.normalize = normalize;
  scoring.num_groups = groups;
  scoring.topk_groups = topk_groups;
  scoring.scale = scale;
  scoring.aux = true;
  return scoring;
}

}  // namespace

// Axes: softmax and sigmoid scores, with and without an expert bias and renormalisation; groups
// of 2 (the smallest a top-2 group score allows) to 16 experts; every group kept or one.
TEST_CASE("router top-k: group-limited choice and a routed scale against a reference (CPU)",
          "[ops][router]") {
  const bool sigmoid = GENERATE(false, true);
  const bool normalize = GENERATE(false, true);
  const bool bias = GENERATE(false, true);
  // {experts, groups, topk_groups, topk}
  const auto shape = GENERATE(std::vector<int64_t>{16, 4, 2, 4}, std::vector<int64_t>{64, 8, 4, 8},
                              std::vector<int64_t>{12, 6, 1, 2}, std::vector<int64_t>{40, 5, 5, 6});
  const int64_t experts = shape[0], groups = shape[1], topk_groups = shape[2], topk = shape[3];
  INFO("sigmoid=" << sigmoid << " normalize=" << normalize << " bias=" << bias << " experts="
                  << experts << " groups=" << groups << " topk_groups=" << topk_groups);
  torch::manual_seed(101);
  const int64_t tokens = 57;
  const torch::Tensor logits = torch::randn({tokens, experts}, torch::kFloat64) * 2;
  const torch::Tensor expert_bias = bias ? torch::randn({experts}) * 0.1 : torch::Tensor();
  const double scale = 2.5;
  const auto scoring = group_scoring(topk, groups, topk_groups, sigmoid, normalize, scale);
  const auto out = torchmoe::ops::router_topk(logits, expert_bias, scoring);
  const torch::Tensor scores = sigmoid ? torch::sigmoid(logits) : torch::softmax(logits, 1);
  const torch::Tensor keys = bias ? scores + expert_bias.to(torch::kFloat64) : scores;
  CHECK(sorted_rows(out.indices) == group_limited_reference(keys, groups, topk_groups, topk));
  // probs = scale · s (/ Σ s), their gradient through autograd on the same formula.
  const torch::Tensor s = scores.detach().requires_grad_(true);
  torch::Tensor probs = s.gather(1, out.indices);
  if (normalize) probs = probs / (probs.sum(1, true) + 1e-20);
  probs = probs * scale;
  check_close(out.probs, probs, {1e-12, 1e-14}, "probs");
  const torch::Tensor grad_probs = torch::randn({tokens, topk}, torch::kFloat64);
  probs.backward(grad_probs);
  const torch::Tensor ds = s.grad();
  const torch::Tensor expected_grad =
      sigmoid ? ds * scores * (1 - scores) : scores * (ds - (scores * ds).sum(1, true));
  const torch::Tensor grad_logits = torchmoe::ops::router_topk_backward(
                                        logits, out.indices, out.probs, grad_probs, {}, {}, scoring)
                                        .grad_logits;
  check_close(grad_logits, expected_grad, {1e-10, 1e-12}, "grad logits");
  // No tokens: empty choices, no error.
  const auto none =
      torchmoe::ops::router_topk(torch::zeros({0, experts}, torch::kFloat64), expert_bias, scoring);
  CHECK(none.indices.sizes() == torch::IntArrayRef({0, topk}));
}

TEST_CASE("router top-k: the CUDA kernel's group-limited choice and scale match the ATen path",
          "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool sigmoid = GENERATE(false, true);
  const bool normalize = GENERATE(false, true);
  // {experts, groups, topk_groups, topk}: DeepSeek-V3's 256 in 8 choosing 4 (top-8); 32 groups
  // of 32 (the kernel's limits); 40 in 5 (groups that straddle the lanes' experts).
  const auto shape =
      GENERATE(std::vector<int64_t>{256, 8, 4, 8}, std::vector<int64_t>{16, 4, 2, 4},
               std::vector<int64_t>{1024, 32, 3, 8}, std::vector<int64_t>{40, 5, 2, 3},
               std::vector<int64_t>{64, 32, 32, 1});
  const int64_t experts = shape[0], groups = shape[1], topk_groups = shape[2], topk = shape[3];
  INFO("sigmoid=" << sigmoid << " normalize=" << normalize << " experts=" << experts
                  << " groups=" << groups << " topk_groups=" << topk_groups << " topk=" << topk);
  torch::manual_seed(103);
  const int64_t tokens = 333;
  const torch::Tensor logits = torch::randn({tokens, experts}) * 2;
  const torch::Tensor expert_bias = torch::randn({experts}) * 0.1;
  const auto scoring = group_scoring(topk, groups, topk_groups, sigmoid, normalize, 2.5);
  const auto cpu = torchmoe::ops::router_topk(logits, expert_bias, scoring);
  const auto cuda = torchmoe::ops::router_topk(logits.cuda(), expert_bias.cuda(), scoring);
  CHECK(sorted_rows(cuda.indices) == sorted_rows(cpu.indices));
  const auto [cuda_sorted, cuda_order] = cuda.indices.cpu().sort(1);
  const auto [cpu_sorted, cpu_order] = cpu.indices.sort(1);
  check_close(cuda.probs.cpu().gather(1, cuda_order), cpu.probs.gather(1, cpu_order), {1e-5, 1e-7},
              "probs");
  CHECK(torch::equal(cuda.counts.cpu(), cpu.counts));
  const torch::Tensor grad_probs = torch::randn({tokens, topk});
  const torch::Tensor expected =
      torchmoe::ops::router_topk_backward(logits, cuda.indices.cpu(), cuda.probs.cpu(), grad_probs,
                                          {}, {}, scoring)
          .grad_logits;
  const torch::Tensor actual =
      torchmoe::ops::router_topk_backward(logits.cuda(), cuda.indices, cuda.probs,
                                          grad_probs.cuda(), {}, {}, scoring)
          .grad_logits;
  check_close(actual, expected, {1e-4, 1e-6}, "grad logits");
}

TEST_CASE("router top-k rejects group and scale settings it cannot apply",
          "[ops][router][errors]") {
  const torch::Tensor logits = torch::randn({4, 12});
  const auto refused = [&](int64_t topk, int64_t groups, int64_t topk_groups, double scale,
                           const std::string& message) {
    CHECK_THROWS_WITH(torchmoe::ops::router_topk(
                          logits, {}, group_scoring(topk, groups, topk_groups, false, true, scale)),
                      Contains(message));
  };
  refused(2, 5, 1, 1.0, "num_groups must divide the 12 experts into groups of at least 2");
  refused(2, 12, 1, 1.0, "num_groups must divide the 12 experts into groups of at least 2");
  refused(2, 4, 5, 1.0, "topk_groups must be in [1, num_groups=4], got 5");
  refused(4, 4, 1, 1.0, "topk must be at most the 3 experts of the topk_groups kept groups, got 4");
  refused(2, 1, 1, 0.0, "scale must be finite and positive, got 0");
}
