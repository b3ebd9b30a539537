// The router's scoring and top-k op (ops/router.h: router_topk and its backward): the CUDA kernel
// against the ATen path and float64 formulas, the aux sums' fixed point, the kernel's limits, the
// links that hand gradients between the router's Functions, and bad arguments. The logits op is in
// test_router_logits.cpp, group-limited choice and the routed scale in test_router_groups.cpp.

#include <torchmoe/ops/router.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

TEST_CASE("router top-k: the CUDA kernel matches the ATen path", "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool sigmoid = GENERATE(false, true);
  const bool normalize = GENERATE(false, true);
  const bool bias = GENERATE(false, true);
  const int64_t topk = GENERATE(1, 2, 8);
  // Experts per lane (kernels/router.cu: 1, 2, 4, 8, 16, 32): 8, 100 and 600 rows shorter than
  // their lanes' registers, 32, 64 and 256 that fill them; 1024 the kernel's limit; 2000 takes the
  // ATen path on CUDA too.
  const int64_t experts = GENERATE(8, 32, 64, 100, 256, 600, 1024, 2000);
  INFO("sigmoid=" << sigmoid << " normalize=" << normalize << " bias=" << bias << " topk=" << topk
                  << " experts=" << experts);
  torch::manual_seed(43);
  const int64_t tokens = 333;
  const torch::Tensor logits = torch::randn({tokens, experts}) * 2;
  const torch::Tensor expert_bias = bias ? torch::randn({experts}) * 0.1 : torch::Tensor();
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = topk;
  scoring.sigmoid = sigmoid;
  scoring.normalize = normalize;
  scoring.aux = true;
  scoring.aux_loss_scale = 0.37;
  scoring.z_loss = true;
  scoring.z_loss_scale = 0.013;
  const auto cpu = torchmoe::ops::router_topk(logits, expert_bias, scoring);
  const auto cuda = torchmoe::ops::router_topk(
      logits.cuda(), bias ? expert_bias.cuda() : torch::Tensor(), scoring);
  // The choices are checked as a valid top-k of the reference keys rather than equal to the
  // reference's: scores that round to one fp32 value (sigmoid near 1) may be taken in either
  // order.
  const torch::Tensor indices = cuda.indices.cpu();
  const torch::Tensor scores = sigmoid ? torch::sigmoid(logits) : torch::softmax(logits, 1);
  const torch::Tensor keys = bias ? scores + expert_bias : scores;
  const torch::Tensor chosen = keys.gather(1, indices);
  const torch::Tensor unchosen_max =
      std::get<0>(keys.scatter(1, indices, -INFINITY).max(1, /*keepdim=*/true));
  CHECK((chosen >= unchosen_max - 1e-6).all().item<bool>());
  if (topk > 1) {  // descending
    CHECK(
        (chosen.narrow(1, 0, topk - 1) >= chosen.narrow(1, 1, topk - 1) - 1e-6).all().item<bool>());
  }
  CHECK(torch::equal(cuda.counts.cpu(), torch::bincount(indices.reshape(-1), {}, experts)));
  torch::Tensor probs = scores.gather(1, indices);
  if (normalize) probs = probs / (probs.sum(1, true) + 1e-20);
  check_close(cuda.probs, probs, {1e-5, 1e-7}, "probs");
  check_close(cuda.aux_sums, cpu.aux_sums, {1e-5, 1e-6}, "aux sums");
  check_close(cuda.lse, cpu.lse, {1e-6, 1e-6}, "lse");
  // The aux loss from the kernel's own sums and counts against float64 from them.
  const double loss = 0.37 * torch::dot(cuda.aux_sums.cpu().to(torch::kFloat64),
                                        cuda.counts.cpu().to(torch::kFloat64))
                                 .item<double>();
  CHECK(cuda.aux_loss.dim() == 0);
  CHECK(cuda.aux_loss.item<double>() == Approx(loss).epsilon(1e-6));
  const double cpu_loss =
      0.37 *
      torch::dot(cpu.aux_sums.to(torch::kFloat64), cpu.counts.to(torch::kFloat64)).item<double>();
  CHECK(cpu.aux_loss.item<double>() == Approx(cpu_loss).epsilon(1e-6));
  CHECK(cuda.z_loss.dim() == 0);
  CHECK(cuda.z_loss.item<double>() == Approx(cpu.z_loss.item<double>()).epsilon(1e-6));

  const torch::Tensor grad_probs = torch::randn({tokens, topk});
  const torch::Tensor grad_aux = torch::randn({experts}) * 1e-2;
  const torch::Tensor grad_lse = torch::randn({tokens});
  const torch::Tensor grad_loss = torch::tensor(1e-3);
  const torch::Tensor grad_z = torch::tensor(0.7);
  auto on_cuda = [](const torch::Tensor& t) { return t.defined() ? t.cuda() : t; };
  for (int absent = 0; absent < 6; ++absent) {  // all gradients, then each one left out
    INFO("absent gradient " << absent);
    auto pick = [&](int which, const torch::Tensor& g) {
      return absent == which ? torch::Tensor() : g;
    };
    // Both through the kernel's choices and counts.
    const torch::Tensor expected =
        torchmoe::ops::router_topk_backward(logits, indices, cuda.probs.cpu(), pick(1, grad_probs),
                                            pick(2, grad_aux), pick(3, grad_lse), scoring,
                                            cuda.counts.cpu(), pick(4, grad_loss), pick(5, grad_z))
            .grad_logits;
    const torch::Tensor actual =
        torchmoe::ops::router_topk_backward(
            logits.cuda(), cuda.indices, cuda.probs, on_cuda(pick(1, grad_probs)),
            on_cuda(pick(2, grad_aux)), on_cuda(pick(3, grad_lse)), scoring, cuda.counts,
            on_cuda(pick(4, grad_loss)), on_cuda(pick(5, grad_z)))
            .grad_logits;
    check_close(actual, expected, {1e-4, 1e-6}, "grad logits");
  }
  // Indices that router_topk cannot have written (past the experts in token 0, negative in the
  // last token) are never used as addresses by the kernel: the other tokens' rows (token 1 shares
  // token 0's block, where a write past its row of scores would land) are those of the valid
  // indices' run, and no row is NaN (compute-sanitizer runs this case too). The ATen path (2000
  // experts) would index with them: not run there.
  if (experts > 1024) return;
  const torch::Tensor wild = cuda.indices.clone();
  wild[0][0].fill_(experts + 1000);
  wild[tokens - 1][topk - 1].fill_(-7);
  const auto all_gradients = [&](const torch::Tensor& indices) {
    return torchmoe::ops::router_topk_backward(logits.cuda(), indices, cuda.probs,
                                               grad_probs.cuda(), grad_aux.cuda(), grad_lse.cuda(),
                                               scoring)
        .grad_logits;
  };
  const torch::Tensor passed_over = all_gradients(wild);
  const torch::Tensor valid = all_gradients(cuda.indices);
  check_close(passed_over.narrow(0, 1, tokens - 2), valid.narrow(0, 1, tokens - 2), {1e-6, 1e-7},
              "grad logits of the tokens with valid indices");
  CHECK_FALSE(passed_over.isnan().any().item<bool>());
}

// Without the aux loss (aux_loss_scale 0) its output is a zero written by the op: the kernel's
// last block writes it (no fill left to the caller) and a NaN among the sums does not reach it.
// Axes: the ATen path (CPU) and the kernel; aux sums asked for or not; a NaN row or none.
TEST_CASE("router top-k: without the aux loss its output is 0", "[ops][router]") {
  const bool cuda = GENERATE(false, true);
  const bool aux = GENERATE(false, true);
  const bool nan_row = GENERATE(false, true);
  TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
  INFO("cuda=" << cuda << " aux=" << aux << " nan_row=" << nan_row);
  torch::manual_seed(5);
  torch::Tensor logits = torch::randn({70, 16});
  if (nan_row) logits[3].fill_(NAN);
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 2;
  scoring.aux = aux;
  const auto out =
      torchmoe::ops::router_topk(cuda ? logits.cuda() : logits, torch::Tensor(), scoring);
  REQUIRE(out.aux_loss.defined());
  CHECK(out.aux_loss.dim() == 0);
  CHECK(out.aux_loss.scalar_type() == torch::kFloat32);
  CHECK(out.aux_loss.item<double>() == 0.0);
  if (aux && nan_row) CHECK(out.aux_sums.isnan().any().item<bool>());
}

// The aux sums' fixed point (kernels/router.h) against float64: each term is exact to 2^-33, so
// the sums are within one fp32 rounding plus T·2^-33 whatever the order of the blocks, and equal
// bit for bit from run to run. Axes: more tokens than one wave of warps (each warp takes several),
// no tokens, a NaN row.
TEST_CASE("router top-k: the aux sums are exact to fp32 and deterministic", "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool sigmoid = GENERATE(false, true);
  const int64_t experts = GENERATE(8, 160);
  INFO("sigmoid=" << sigmoid << " experts=" << experts);
  torch::manual_seed(47);
  const int64_t tokens = 100003;
  const torch::Tensor logits = torch::randn({tokens, experts}) * 3;
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 2;
  scoring.sigmoid = sigmoid;
  scoring.aux = true;
  scoring.z_loss = true;
  scoring.z_loss_scale = 1.0 / tokens;
  const auto first = torchmoe::ops::router_topk(logits.cuda(), {}, scoring);
  const auto second = torchmoe::ops::router_topk(logits.cuda(), {}, scoring);
  CHECK(torch::equal(first.aux_sums, second.aux_sums));
  CHECK(torch::equal(first.z_loss, second.z_loss));
  // The counts, with the aux sums and without (each block's counts added to the launch's once).
  const torch::Tensor bincount = torch::bincount(first.indices.cpu().reshape(-1), {}, experts);
  CHECK(torch::equal(first.counts.cpu(), bincount));
  scoring.aux = false;
  const auto no_aux = torchmoe::ops::router_topk(logits.cuda(), {}, scoring);
  CHECK(torch::equal(no_aux.indices, first.indices));
  CHECK(torch::equal(no_aux.counts, first.counts));
  scoring.aux = true;
  const torch::Tensor l64 = logits.to(torch::kFloat64);
  torch::Tensor scores = sigmoid ? torch::sigmoid(l64) : torch::softmax(l64, 1);
  if (sigmoid) scores = scores / (scores.sum(1, true) + 1e-20);
  // The kernel's fp32 scores are a few units of fp32 from the float64 ones, all of one sign, so the
  // sums' relative error is theirs plus one rounding; an fp32 sum of 10^5 terms in any order
  // would be off by ~10^-5.
  check_close(first.aux_sums, scores.sum(0), {2e-6, tokens * 0x1p-33}, "aux sums");
  // The z-loss's sum is in double: within a few fp32 roundings of the logsumexps' own.
  const double z = torch::logsumexp(l64, 1).square().mean().item<double>();
  CHECK(first.z_loss.item<double>() == Approx(z).epsilon(1e-6));

  const auto empty = torchmoe::ops::router_topk(logits.narrow(0, 0, 0).cuda(), {}, scoring);
  CHECK(torch::equal(empty.aux_sums.cpu(), torch::zeros({experts})));
  CHECK(torch::equal(empty.counts.cpu(), torch::zeros({experts}, torch::kLong)));
  torch::Tensor with_nan = logits.narrow(0, 0, 1000).clone();
  with_nan[500][3] = NAN;
  const auto nan = torchmoe::ops::router_topk(with_nan.cuda(), {}, scoring);
  CHECK(nan.aux_sums.isnan().all().item<bool>());
  // A zero scale's z-loss is 0 whatever the logsumexps (an infinite one here), on both paths, and
  // gives no gradient.
  torch::Tensor with_inf = logits.narrow(0, 0, 1000).clone();
  with_inf[7][1] = INFINITY;
  scoring.z_loss_scale = 0;
  for (const torch::Tensor& l : {with_inf, with_inf.cuda()}) {
    const auto out = torchmoe::ops::router_topk(l, {}, scoring);
    CHECK(out.z_loss.item<double>() == 0);
  }
  const torch::Tensor finite = logits.narrow(0, 0, 1000).cuda();
  const auto out = torchmoe::ops::router_topk(finite, {}, scoring);
  const torch::Tensor grad_lse = torch::randn({1000}).cuda();
  const auto grad_with = [&](const torch::Tensor& grad_z) {
    return torchmoe::ops::router_topk_backward(finite, out.indices, out.probs, {}, {}, grad_lse,
                                               scoring, {}, {}, grad_z)
        .grad_logits;
  };
  CHECK(torch::equal(grad_with(torch::tensor(1.0f).cuda()), grad_with({})));
}

// Launch edges of the forward: 236 experts with the aux sums, whose 16 warps' rows and the block's
// sums take 49,088 bytes, within the 48 KB a launch gets but not with the kernel's static flags
// (the launch takes 15 warps); k = 33, past the kernel's 32, on the ATen path; and a sigmoid row
// whose only finite score is expert 1 makes the top-2's fallback repeat it (its count must then
// be 2).
TEST_CASE("router top-k at its shared-memory budget and with a repeated expert",
          "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  torch::manual_seed(53);
  torchmoe::ops::RouterScoring scoring;
  scoring.aux = true;
  for (const auto [experts, topk] : {std::pair<int64_t, int64_t>{236, 12}, {100, 33}}) {
    INFO("experts=" << experts << " topk=" << topk);
    scoring.topk = topk;
    const torch::Tensor logits = torch::randn({1000, experts});
    const auto cpu = torchmoe::ops::router_topk(logits, {}, scoring);
    const auto cuda = torchmoe::ops::router_topk(logits.cuda(), {}, scoring);
    CHECK(torch::equal(cuda.counts.cpu(),
                       torch::bincount(cuda.indices.cpu().reshape(-1), {}, experts)));
    check_close(cuda.aux_sums, cpu.aux_sums, {1e-5, 1e-6}, "aux sums");
  }
  scoring.topk = 2;
  scoring.sigmoid = true;
  torch::Tensor logits = torch::randn({4, 8});
  logits[2].fill_(NAN);
  logits[2][1] = 0.5;
  const auto out = torchmoe::ops::router_topk(logits.cuda(), {}, scoring);
  const torch::Tensor indices = out.indices.cpu();
  CHECK(indices[2][0].item<int64_t>() == 1);
  CHECK(indices[2][1].item<int64_t>() == 1);
  CHECK(torch::equal(out.counts.cpu(), torch::bincount(indices.reshape(-1), {}, 8)));
}

// Ties go to the lower expert, also among the experts one lane holds (0, 32, 64 and 96 on lane 0);
// k = 32, the kernel's limit (lane 31 keeps the last choice), against ATen on distinct scores.
TEST_CASE("router top-k: ties to the lower expert and k = 32", "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 8;
  torch::Tensor logits = torch::zeros({2, 100});
  for (const int64_t e : {96, 64, 32, 0}) logits[1][e] = 5.0;
  const torch::Tensor indices =
      torchmoe::ops::router_topk(logits.cuda(), {}, scoring).indices.cpu();
  CHECK(torch::equal(indices[0], torch::arange(8)));
  CHECK(torch::equal(indices[1], torch::tensor({0, 32, 64, 96, 1, 2, 3, 4}, torch::kLong)));

  scoring.topk = 32;
  scoring.sigmoid = true;
  scoring.aux = true;
  const int64_t tokens = 50, experts = 64;
  // Each row a permutation of distinct values: one top-k, in one order.
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < tokens; ++t) rows.push_back(torch::randperm(experts).to(torch::kFloat));
  const torch::Tensor scores = torch::stack(rows) * 0.05 - 1.5;
  const auto cpu = torchmoe::ops::router_topk(scores, {}, scoring);
  const auto cuda = torchmoe::ops::router_topk(scores.cuda(), {}, scoring);
  CHECK(torch::equal(cuda.indices.cpu(), cpu.indices));
  CHECK(torch::equal(cuda.counts.cpu(), cpu.counts));
  check_close(cuda.probs, cpu.probs, {1e-6, 1e-7}, "probs");
  const torch::Tensor grad_probs = torch::randn({tokens, 32});
  const torch::Tensor expected = torchmoe::ops::router_topk_backward(scores, cpu.indices, cpu.probs,
                                                                     grad_probs, {}, {}, scoring)
                                     .grad_logits;
  const torch::Tensor actual =
      torchmoe::ops::router_topk_backward(scores.cuda(), cuda.indices, cuda.probs,
                                          grad_probs.cuda(), {}, {}, scoring)
          .grad_logits;
  check_close(actual, expected, {1e-4, 1e-6}, "grad logits");
}

TEST_CASE("router top-k rejects bad arguments", "[ops][router][errors]") {
  using torchmoe::ops::router_topk;
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 2;
  const torch::Tensor logits = torch::randn({5, 4});
  CHECK_THROWS_WITH(router_topk(logits.view({20}), {}, scoring),
                    Contains("logits must be 2-D [tokens, experts > 0]"));
  CHECK_THROWS_WITH(router_topk(logits.to(torch::kBFloat16), {}, scoring),
                    Contains("logits must be float32 or float64"));
  CHECK_THROWS_WITH(router_topk(logits.t(), {}, scoring), Contains("logits must be contiguous"));
  scoring.topk = 5;
  CHECK_THROWS_WITH(router_topk(logits, {}, scoring), Contains("topk must be in [1, 4], got 5"));
  scoring.topk = 2;
  CHECK_THROWS_WITH(router_topk(logits, torch::zeros({3}), scoring),
                    Contains("expert_bias must be a contiguous float32 [4] tensor"));
  CHECK_THROWS_WITH(router_topk(logits, torch::zeros({4}, torch::kFloat64), scoring),
                    Contains("expert_bias must be a contiguous float32 [4] tensor"));
  const auto out = router_topk(logits, {}, scoring);
  CHECK_THROWS_WITH(torchmoe::ops::router_topk_backward(logits, out.indices, out.probs,
                                                        torch::zeros({5, 3}), {}, {}, scoring),
                    Contains("grad_probs must be a contiguous Float [5, 2] tensor"));
  CHECK_THROWS_WITH(torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {},
                                                        torch::zeros({5, 4}), {}, scoring),
                    Contains("grad_aux must be a contiguous Float [4] tensor"));
  torchmoe::ops::RouterScoring no_aux = scoring;
  no_aux.aux = false;
  no_aux.aux_loss_scale = 1.0;
  CHECK_THROWS_WITH(router_topk(logits, {}, no_aux),
                    Contains("aux_loss_scale must be finite, >= 0, and 0 without aux, got 1"));
  torchmoe::ops::RouterScoring with_loss = scoring;
  with_loss.aux = true;
  with_loss.aux_loss_scale = 0.5;
  CHECK_THROWS_WITH(torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {}, {}, {},
                                                        with_loss, {}, torch::tensor(1.0f)),
                    Contains("grad_aux_loss needs the forward's counts"));
  CHECK_THROWS_WITH(
      torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {}, {}, {}, with_loss,
                                          torch::zeros({4}, torch::kInt), torch::tensor(1.0f)),
      Contains("grad_aux_loss needs the forward's counts, a contiguous int64 [4] tensor on cpu"));
  CHECK_THROWS_WITH(
      torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {}, {}, {}, scoring,
                                          torch::zeros({4}, torch::kLong), torch::tensor(1.0f)),
      Contains("grad_aux_loss needs aux and aux_loss_scale > 0"));
  CHECK_THROWS_WITH(
      torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {}, {}, {}, with_loss,
                                          torch::zeros({4}, torch::kLong), torch::ones({2})),
      Contains("grad_aux_loss must be a contiguous Float [] tensor"));
  torchmoe::ops::RouterScoring bad_z = scoring;
  bad_z.z_loss_scale = 0.5;
  CHECK_THROWS_WITH(router_topk(logits, {}, bad_z),
                    Contains("z_loss_scale must be finite, >= 0, and 0 without z_loss, got 0.5"));
  bad_z.z_loss = true;
  bad_z.z_loss_scale = -1;
  CHECK_THROWS_WITH(router_topk(logits, {}, bad_z),
                    Contains("z_loss_scale must be finite, >= 0, and 0 without z_loss, got -1"));
  CHECK_THROWS_WITH(torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {}, {}, {},
                                                        scoring, {}, {}, torch::tensor(1.0f)),
                    Contains("grad_z_loss needs z_loss"));
  const auto backward = [&](const torch::Tensor& l, const torch::Tensor& indices,
                            const torch::Tensor& probs, int64_t topk) {
    torchmoe::ops::RouterScoring s = scoring;
    s.topk = topk;
    return torchmoe::ops::router_topk_backward(l, indices, probs, torch::ones({5, topk}), {}, {}, s)
        .grad_logits;
  };
  CHECK_THROWS_WITH(backward(logits.view({20}), out.indices, out.probs, 2),
                    Contains("router_topk: logits must be 2-D [tokens, experts > 0], got [20]"));
  CHECK_THROWS_WITH(backward(logits, out.indices, out.probs, 5),
                    Contains("topk must be in [1, 4], got 5"));
  CHECK_THROWS_WITH(
      backward(logits, out.indices.to(torch::kInt32), out.probs, 2),
      Contains("indices must be a contiguous Long [5, 2] tensor on cpu (router_topk's), got a "
               "contiguous Int [5, 2] tensor on cpu"));
  CHECK_THROWS_WITH(backward(logits, out.indices.narrow(1, 0, 1), out.probs, 2),
                    Contains("indices must be a contiguous Long [5, 2] tensor"));
  CHECK_THROWS_WITH(backward(logits, out.indices, torch::Tensor(), 2),
                    Contains("probs must be a contiguous Float [5, 2] tensor on cpu "
                             "(router_topk's), got an undefined tensor"));
}

namespace {

// A permutation's row map [T, k] for the links: every slot a distinct row of N, and the slots
// `dropped` lists as -1 (no row: no gradient). Rows in a shuffled order, as a routing map's.
torch::Tensor shuffled_row_map(int64_t tokens, int64_t topk, int64_t rows,
                               std::initializer_list<int64_t> dropped) {
  torch::Tensor map = torch::randperm(rows).narrow(0, 0, tokens * topk).clone();
  for (const int64_t slot : dropped) map[slot] = -1;
  return map.view({tokens, topk});
}

// probs' gradient read through the map: its slots' rows, 0 where no row.
torch::Tensor gathered(const torch::Tensor& rows, const torch::Tensor& map) {
  return torch::where(map >= 0, rows.index_select(0, map.clamp_min(0).reshape(-1)).view_as(map),
                      torch::zeros({}, rows.options()));
}

}  // namespace

// RouterTopKLinks' probabilities' gradient in row order (a permutation's, through its map): the
// same as that gradient gathered into slot order and added to grad_probs, on the ATen path (CPU)
// and the kernel's (CUDA).
TEST_CASE("router top-k backward reads probs' gradient through a row map", "[ops][router]") {
  const bool cuda = GENERATE(false, true);
  TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
  const bool with_grad_probs = GENERATE(false, true);
  INFO("cuda=" << cuda << " with grad_probs=" << with_grad_probs);
  torch::manual_seed(83);
  const torch::Device device = cuda ? torch::kCUDA : torch::kCPU;
  const int64_t tokens = 77, experts = 12, topk = 2, rows = 170;  // rows past T·k: padding
  const torch::Tensor logits = (torch::randn({tokens, experts}) * 2).to(device);
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = topk;
  scoring.normalize = true;
  const auto out = torchmoe::ops::router_topk(logits, {}, scoring);
  torchmoe::ops::RouterTopKLinks links;
  links.grad_probs_rows = torch::randn({rows}).to(device);
  links.probs_row_map = shuffled_row_map(tokens, topk, rows, {0, 2 * tokens - 1}).to(device);
  const torch::Tensor grad_probs =
      with_grad_probs ? torch::randn({tokens, topk}).to(device) : torch::Tensor();
  const torch::Tensor from_rows = gathered(links.grad_probs_rows, links.probs_row_map);
  const torch::Tensor expected =
      torchmoe::ops::router_topk_backward(logits, out.indices, out.probs,
                                          with_grad_probs ? grad_probs + from_rows : from_rows, {},
                                          {}, scoring)
          .grad_logits;
  const torchmoe::ops::RouterTopKGrads linked = torchmoe::ops::router_topk_backward(
      logits, out.indices, out.probs, grad_probs, {}, {}, scoring, {}, {}, {}, links);
  CHECK_FALSE(linked.split.lhs.defined());
  check_close(linked.grad_logits, expected, {1e-6, 1e-7}, "grad logits");
}

// RouterTopKLinks' split_weight: the kernel also writes [hi | lo] of the gradient it returns and
// [W; W], the very operands router_logits_backward's own split launch makes, so that its products
// are the same bits with the split handed over.
TEST_CASE("router top-k backward splits its gradient for the logits' backward",
          "[ops][router][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int64_t tokens = GENERATE(0, 1, 333);  // none (only [W; W] written); one; not a tile
  INFO("tokens=" << tokens);
  torch::manual_seed(89);
  const int64_t experts = 24, hidden = 200;
  const auto bf16 = torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA);
  const torch::Tensor x = torch::randn({tokens, hidden}, bf16);
  const torch::Tensor weight = torch::randn({experts, hidden}, bf16) * 0.05;
  const torch::Tensor logits = torchmoe::ops::router_logits(x, weight);
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 2;
  scoring.normalize = true;
  const auto out = torchmoe::ops::router_topk(logits, {}, scoring);
  const torch::Tensor grad_probs = torch::randn({tokens, 2}, bf16.dtype(torch::kFloat32));
  const torch::Tensor grad_lse = torch::randn({tokens}, bf16.dtype(torch::kFloat32));
  torchmoe::ops::RouterTopKLinks links;
  links.split_weight = weight;
  const auto plain = torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, grad_probs,
                                                         {}, grad_lse, scoring);
  const auto split = torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, grad_probs,
                                                         {}, grad_lse, scoring, {}, {}, {}, links);
  REQUIRE(split.split.lhs.defined());
  CHECK(torch::equal(split.grad_logits, plain.grad_logits));
  using torchmoe::ops::RouterGradX;
  const auto own = torchmoe::ops::router_logits_backward(plain.grad_logits, x, weight,
                                                         RouterGradX::kDeferred, true);
  CHECK(torch::equal(split.split.lhs, own.grad_x_product.lhs));
  CHECK(torch::equal(split.split.rhs, torch::cat({weight, weight}, 0)));
  const auto handed = torchmoe::ops::router_logits_backward(
      split.grad_logits, x, weight, RouterGradX::kDeferred, true, split.split);
  CHECK(handed.grad_x_product.lhs.data_ptr() == split.split.lhs.data_ptr());
  CHECK(torch::equal(handed.grad_weight, own.grad_weight));
  CHECK(torch::equal(torchmoe::ops::router_grad_x(handed.grad_x_product),
                     torchmoe::ops::router_grad_x(own.grad_x_product)));
}

TEST_CASE("router top-k backward rejects links it cannot use", "[ops][router][errors]") {
  const torch::Tensor logits = torch::randn({5, 4});
  torchmoe::ops::RouterScoring scoring;
  scoring.topk = 2;
  const auto out = torchmoe::ops::router_topk(logits, {}, scoring);
  const auto backward = [&](const torchmoe::ops::RouterTopKLinks& links) {
    return torchmoe::ops::router_topk_backward(logits, out.indices, out.probs, {}, {}, {}, scoring,
                                               {}, {}, {}, links);
  };
  torchmoe::ops::RouterTopKLinks links;
  links.grad_probs_rows = torch::zeros({12});
  CHECK_THROWS_WITH(backward(links), Contains("grad_probs_rows and probs_row_map go together, "
                                              "got only grad_probs_rows"));
  links.probs_row_map = torch::zeros({5, 3}, torch::kLong);
  CHECK_THROWS_WITH(backward(links),
                    Contains("probs_row_map must be a contiguous int64 [5, 2] tensor on cpu, got "
                             "[5, 3] Long on cpu"));
  links.probs_row_map = torch::zeros({5, 2}, torch::kLong);
  links.grad_probs_rows = torch::zeros({12}, torch::kFloat64);
  CHECK_THROWS_WITH(backward(links),
                    Contains("grad_probs_rows must be a contiguous 1-D Float tensor on cpu, got "
                             "[12] Double on cpu"));
  torchmoe::ops::RouterTopKLinks weight_only;
  weight_only.split_weight = torch::zeros({4, 8});
  CHECK_THROWS_WITH(backward(weight_only),
                    Contains("split_weight must be the router's contiguous bf16 [4, hidden] "
                             "weight on cpu, got [4, 8]"));
  // A split is only taken where the backward makes bf16 halves (bf16 x and weight on CUDA).
  torchmoe::ops::RouterGradXProduct split;
  split.lhs = torch::zeros({5, 8}, torch::kBFloat16);
  CHECK_THROWS_WITH(
      torchmoe::ops::router_logits_backward(logits, torch::randn({5, 8}), torch::randn({4, 8}),
                                            torchmoe::ops::RouterGradX::kNone, true, split),
      Contains("split must be router_topk_backward's split for bf16 x and weight "
               "on CUDA"));
}
