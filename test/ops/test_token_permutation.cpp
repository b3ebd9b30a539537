// Token permutation: the routing map on a hand-worked case, round trips, an independent
// loop-over-experts reference, finite-difference gradients (float64, CPU), CPU vs CUDA
// (k in {1, 2, 8} x E in {4, 16, 128}, empty experts, all tokens to one expert, dropped slots,
// unaligned H), and the errors.

#include <torchmoe/ops/token_permutation.h>
#include <torchmoe/torchmoe.h>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
namespace F = torchmoe::functional;

namespace {

// Random top-k indices drawn from the first `allowed` experts (all E by default). A token may
// pick the same expert twice (permutation does not need distinct choices), so k may exceed E.
torch::Tensor random_indices(int64_t tokens, int64_t topk, int64_t experts, uint64_t seed,
                             int64_t allowed = -1) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return torch::randint(allowed > 0 ? allowed : experts, {tokens, topk}, gen, torch::kLong);
}

// Independent reference: expert by expert, the tokens choosing it in token order.
struct ExpectedPermutation {
  torch::Tensor permuted;  // [N, H]
  std::vector<int64_t> splits;
};

ExpectedPermutation loop_reference(const torch::Tensor& x, const torch::Tensor& indices,
                                   int64_t experts) {
  ExpectedPermutation e;
  std::vector<torch::Tensor> rows;
  const auto idx = indices.accessor<int64_t, 2>();
  for (int64_t expert = 0; expert < experts; ++expert) {
    int64_t count = 0;
    for (int64_t t = 0; t < indices.size(0); ++t) {
      for (int64_t j = 0; j < indices.size(1); ++j) {
        if (idx[t][j] == expert) {
          rows.push_back(x[t]);
          ++count;
        }
      }
    }
    e.splits.push_back(count);
  }
  e.permuted = rows.empty() ? x.new_empty({0, x.size(1)}) : torch::stack(rows);
  return e;
}

}  // namespace

TEST_CASE("make_routing_map on a worked example", "[ops][permutation]") {
  // slots: (0,0)->1 (0,1)->0 (1,0)->1 (1,1)->2 (2,0) dropped (2,1)->1
  const torch::Tensor indices = torch::tensor({1, 0, 1, 2, -1, 1}, torch::kLong).view({3, 2});
  const auto map = torchmoe::ops::make_routing_map(indices, 4);
  CHECK(map.host_splits == std::vector<int64_t>{1, 3, 1, 0});
  CHECK(map.num_rows == 5);
  CHECK(torch::equal(map.row_map, torch::tensor({1, 0, 2, 4, -1, 3}, torch::kLong).view({3, 2})));
  CHECK(torch::equal(map.sorted_slots, torch::tensor({1, 0, 2, 5, 3}, torch::kLong)));
  CHECK(torch::equal(map.row_tokens, torch::tensor({0, 0, 1, 2, 1}, torch::kLong)));
  CHECK(torch::equal(map.m_splits, torch::tensor({1, 3, 1, 0}, torch::kLong)));
  CHECK(torch::equal(torchmoe::ops::slots_of_rows(map.row_map, map.num_rows), map.sorted_slots));
}

TEST_CASE("permute_tokens matches a loop over experts and round-trips", "[ops][permutation]") {
  const int64_t topk = GENERATE(1, 2, 8);
  const int64_t experts = GENERATE(4, 16, 128);
  INFO("topk=" << topk << " experts=" << experts);
  const int64_t tokens = 37, hidden = 24;
  const torch::Tensor x = torch::randn({tokens, hidden}, torch::kFloat64);
  const torch::Tensor indices = random_indices(tokens, topk, experts, 7 + topk + experts);
  const torch::Tensor probs = torch::softmax(torch::randn({tokens, topk}, torch::kFloat64), 1);

  const auto routed = F::permute_tokens(x, indices, experts, probs);
  CHECK(torch::equal(routed.row_tokens, routed.sorted_slots.div(topk, "floor")));
  const ExpectedPermutation expected = loop_reference(x, indices, experts);
  CHECK(routed.m_splits.host().vec() == expected.splits);
  CHECK(torch::equal(routed.tokens, expected.permuted));
  // Each row's probability is its slot's.
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t j = 0; j < topk; ++j) {
      const int64_t row = routed.row_map[t][j].item<int64_t>();
      CHECK(routed.probs[row].item<double>() == probs[t][j].item<double>());
    }
  }
  // Probabilities summing to one give the tokens back; without them, k copies.
  check_close(F::unpermute_tokens(routed.tokens, routed.row_map, probs), x, {1e-12, 1e-12},
              "weighted round trip");
  check_close(F::unpermute_tokens(routed.tokens, routed.row_map), x * topk, {1e-12, 1e-12},
              "plain round trip");
}

TEST_CASE("permutation edge cases: empty experts, one expert, dropped slots, no tokens",
          "[ops][permutation]") {
  const torch::Tensor x = torch::randn({6, 5}, torch::kFloat64);
  SECTION("all tokens to one expert (the others empty)") {
    const auto routed = F::permute_tokens(x, torch::full({6, 1}, 2, torch::kLong), 4);
    CHECK(routed.m_splits.host().vec() == std::vector<int64_t>{0, 0, 6, 0});
    CHECK(torch::equal(routed.tokens, x));
  }
  SECTION("dropped slots (-1) get no row and contribute nothing") {
    const torch::Tensor indices =
        torch::tensor({0, -1, -1, -1, 1, 0, -1, 1, 0, 1, -1, -1}, torch::kLong).view({6, 2});
    const auto routed = F::permute_tokens(x, indices, 2);
    CHECK(routed.m_splits.host().vec() == std::vector<int64_t>{3, 3});
    const torch::Tensor back = F::unpermute_tokens(routed.tokens, routed.row_map);
    const torch::Tensor kept = (indices >= 0).sum(1, true).to(torch::kFloat64);
    check_close(back, x * kept, {1e-12, 1e-12}, "dropped tokens come back as zero");
  }
  SECTION("no tokens") {
    const auto routed = F::permute_tokens(x.narrow(0, 0, 0), torch::empty({0, 2}, torch::kLong), 3);
    CHECK(routed.m_splits.host().vec() == std::vector<int64_t>{0, 0, 0});
    CHECK(routed.tokens.sizes() == torch::IntArrayRef({0, 5}));
    CHECK(F::unpermute_tokens(routed.tokens, routed.row_map).sizes() == torch::IntArrayRef({0, 5}));
  }
}

TEST_CASE("permute/unpermute finite-difference gradients (float64)", "[ops][permutation]") {
  const bool weighted = GENERATE(false, true);
  INFO("weighted=" << weighted);
  torch::manual_seed(5);
  const torch::Tensor x = torch::randn({5, 3}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor probs = torch::rand({5, 2}, torch::kFloat64).requires_grad_(true);
  const torch::Tensor indices = torch::tensor({0, 2, 1, 2, 2, -1, 0, 1, 1, 0}).view({5, 2});
  const torch::Tensor w_perm = torch::randn({9, 3}, torch::kFloat64);
  const torch::Tensor w_out = torch::randn({5, 3}, torch::kFloat64);
  auto loss = [&] {
    const auto routed = F::permute_tokens(x, indices, 3, probs);
    // A nonlinearity between the two, so both functions' gradients matter; the permuted
    // probabilities feed in too.
    const torch::Tensor h = (routed.tokens * w_perm).tanh() * routed.probs.unsqueeze(1);
    const torch::Tensor y =
        F::unpermute_tokens(h, routed.row_map, weighted ? probs : torch::Tensor());
    return (y * w_out).sum();
  };
  loss().backward();
  check_finite_differences(loss, {{"tokens", x}, {"probs", probs}});
}

// float32 probabilities are put in row order by the routing map's own pass (row_probs), and
// permute_tokens hands them out with the gradient of a permutation: each row's back to its slot,
// none to a dropped slot. With int32 and int64 indices.
namespace {

void check_row_probs(const torch::Device& device) {
  torch::manual_seed(23);
  const int64_t tokens = 300, topk = 2, experts = 6;
  torch::Tensor indices = random_indices(tokens, topk, experts, 29);
  indices.index_put_({torch::rand({tokens, topk}) < 0.1}, -1);
  const torch::Tensor probs = torch::rand({tokens, topk});
  const torch::Tensor weights = torch::randn({tokens * topk});
  for (const bool int32 : {false, true}) {
    INFO("device " << device << ", int32 indices " << int32);
    const torch::Tensor idx = (int32 ? indices.to(torch::kInt) : indices).to(device);
    const auto map = torchmoe::ops::make_routing_map(
        idx, experts, torchmoe::ops::IndexTrust::kChecked, probs.to(device));
    CHECK(torch::equal(map.row_probs.cpu(),
                       probs.reshape(-1).index_select(0, map.sorted_slots.cpu())));
    CHECK_FALSE(torchmoe::ops::make_routing_map(idx, experts, torchmoe::ops::IndexTrust::kChecked,
                                                probs.to(device).detach().requires_grad_(true))
                    .row_probs.requires_grad());
    const torch::Tensor p = probs.to(device).detach().requires_grad_(true);
    const auto routed = F::permute_tokens(torch::randn({tokens, 4}, device), idx, experts, p);
    CHECK(torch::equal(routed.probs.cpu(), map.row_probs.cpu()));
    (routed.probs * weights.narrow(0, 0, map.num_rows).to(device)).sum().backward();
    torch::Tensor expected = torch::zeros({tokens * topk});
    expected.index_put_({map.sorted_slots.cpu()}, weights.narrow(0, 0, map.num_rows));
    CHECK(torch::equal(p.grad().cpu().reshape(-1), expected));
  }
}

}  // namespace

TEST_CASE("the routing map puts float32 probabilities in row order", "[ops][permutation]") {
  check_row_probs(torch::kCPU);
  const torch::Tensor indices = torch::zeros({3, 2}, torch::kLong);
  CHECK_THROWS_WITH(
      torchmoe::ops::make_routing_map(indices, 4, torchmoe::ops::IndexTrust::kChecked,
                                      torch::rand({3, 2}, torch::kFloat64)),
      Contains("make_routing_map: probs must be a float32 tensor of the indices' shape [3, 2] on "
               "cpu, got [3, 2] Double on cpu"));
  CHECK_THROWS_WITH(torchmoe::ops::make_routing_map(indices, 4, torchmoe::ops::IndexTrust::kChecked,
                                                    torch::rand({2, 3})),
                    Contains("make_routing_map: probs must be a float32 tensor of the indices' "
                             "shape [3, 2] on cpu, got [2, 3] Float on cpu"));
}

TEST_CASE("the CUDA routing map puts float32 probabilities in row order",
          "[ops][permutation][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  check_row_probs(torch::kCUDA);
}

TEST_CASE("permutation errors", "[ops][permutation]") {
  const torch::Tensor x = torch::randn({4, 8});
  const torch::Tensor indices = torch::zeros({4, 2}, torch::kLong);
  CHECK_THROWS_WITH(F::permute_tokens(x, torch::full({4, 2}, 5, torch::kLong), 4),
                    Contains("indices must be in [0, 4) or -1 (dropped), got 8 out of range"));
  CHECK_THROWS_WITH(F::permute_tokens(x, indices.to(torch::kFloat), 4),
                    Contains("indices must be int64 or int32"));
  CHECK_THROWS_WITH(F::permute_tokens(x, torch::zeros({3, 2}, torch::kLong), 4),
                    Contains("indices must be [T=4, topk]"));
  CHECK_THROWS_WITH(F::permute_tokens(x, indices, 0), Contains("num_experts must be positive"));
  CHECK_THROWS_WITH(F::permute_tokens(x.view({2, 2, 8}), indices, 4),
                    Contains("tokens must be 2-D"));
  CHECK_THROWS_WITH(F::permute_tokens(x, indices, 4, torch::rand({4, 3})),
                    Contains("probs must have shape [4, 2]"));
  CHECK_THROWS_WITH(F::permute_tokens(x, indices, 4, torch::ones({4, 2}, torch::kLong)),
                    Contains("probs must have a floating dtype, got Long"));
  const auto routed = F::permute_tokens(x, indices, 4);
  // A strided row map is read as the other entry points read theirs, not refused.
  const torch::Tensor strided_map = routed.row_map.t().contiguous().t();
  REQUIRE_FALSE(strided_map.is_contiguous());
  CHECK(torch::equal(F::unpermute_tokens(routed.tokens, strided_map),
                     F::unpermute_tokens(routed.tokens, routed.row_map)));
  CHECK_THROWS_WITH(F::unpermute_tokens(routed.tokens, routed.row_map.to(torch::kInt)),
                    Contains("row_map must be a 2-D int64 tensor"));
  CHECK_THROWS_WITH(F::unpermute_tokens(routed.tokens, routed.row_map, torch::rand({4})),
                    Contains("probs must have shape [4, 2]"));
  CHECK_THROWS_WITH(torchmoe::ops::permute_rows(x, routed.row_map, routed.row_map, torch::Tensor()),
                    Contains("sorted_slots must be a 1-D int64 tensor"));
  CHECK_THROWS_WITH(
      torchmoe::ops::permute_rows(x, routed.sorted_slots, routed.sorted_slots, torch::Tensor()),
      Contains("row_map must be a 2-D int64 tensor [tokens, topk]"));
  CHECK_THROWS_WITH(torchmoe::ops::permute_rows(x, routed.row_map.narrow(0, 0, 3),
                                                routed.sorted_slots, torch::Tensor()),
                    Contains("row_map must be [tokens=4, topk >= 1], got [3, 2]"));
  CHECK_THROWS_WITH(F::unpermute_tokens(routed.tokens.narrow(0, 0, 7), routed),
                    Contains("unpermute_tokens: permuted must be [rows=8, hidden] like the "
                             "permuted tokens"));
}

// The contract of a caller's row_map: entries -1 or rows of permuted, no row twice, padding rows
// allowed (zero gradient). Checked on both devices; the CUDA kernels read no uninitialised index.
void check_row_map_contract(const torch::Device& device, bool weighted) {
  INFO("device=" << device << " weighted=" << weighted);
  const auto f64 = torch::TensorOptions().device(device).dtype(device.is_cuda() ? torch::kFloat32
                                                                                : torch::kFloat64);
  const auto i64 = torch::TensorOptions().device(device).dtype(torch::kLong);
  const torch::Tensor two_rows = torch::randn({2, 8}, f64);
  CHECK_THROWS_WITH(F::unpermute_tokens(two_rows, torch::tensor({0, 5}, i64).view({2, 1})),
                    Contains("unpermute_tokens: row_map entries must be -1 (dropped) or rows of "
                             "permuted in [0, 2), got 1 out of range"));
  CHECK_THROWS_WITH(F::unpermute_tokens(two_rows, torch::tensor({0, -3}, i64).view({2, 1})),
                    Contains("got 1 out of range"));
  CHECK_THROWS_WITH(
      F::unpermute_tokens(two_rows.narrow(0, 0, 1), torch::tensor({0, 0}, i64).view({2, 1})),
      Contains("unpermute_tokens: row_map must name each row of permuted at most once, got row "
               "0 2 times"));

  // 12 slots, 2 dropped, into a buffer of 15 rows: 5 rows no slot names (capacity padding).
  const torch::Tensor row_map =
      torch::tensor({3, 14, -1, 0, 7, 2, 9, -1, 11, 5, 1, 8}, i64).view({6, 2});
  const torch::Tensor permuted = torch::randn({15, 8}, f64).requires_grad_(true);
  const torch::Tensor probs = torch::rand({6, 2}, f64).requires_grad_(true);
  const torch::Tensor out =
      F::unpermute_tokens(permuted, row_map, weighted ? probs : torch::Tensor());
  const torch::Tensor dy = torch::randn({6, 8}, f64);
  out.backward(dy);
  // Reference on the host, slot by slot.
  const torch::Tensor p_cpu = permuted.detach().cpu().to(torch::kFloat64);
  const torch::Tensor w_cpu = probs.detach().cpu().to(torch::kFloat64);
  const torch::Tensor dy_cpu = dy.cpu().to(torch::kFloat64);
  torch::Tensor expected = torch::zeros({6, 8}, torch::kFloat64);
  torch::Tensor expected_grad = torch::zeros({15, 8}, torch::kFloat64);
  torch::Tensor expected_dprobs = torch::zeros({6, 2}, torch::kFloat64);
  const torch::Tensor map_cpu = row_map.cpu();
  for (int64_t t = 0; t < 6; ++t) {
    for (int64_t j = 0; j < 2; ++j) {
      const int64_t r = map_cpu[t][j].item<int64_t>();
      if (r < 0) continue;
      const double w = weighted ? w_cpu[t][j].item<double>() : 1.0;
      expected[t] += w * p_cpu[r];
      expected_grad[r] += w * dy_cpu[t];
      expected_dprobs[t][j] = (dy_cpu[t] * p_cpu[r]).sum().item<double>();
    }
  }
  const Tolerance tol = device.is_cuda() ? Tolerance{1e-5, 1e-5} : Tolerance{1e-12, 1e-12};
  check_close(out, expected, tol, "output");
  check_close(permuted.grad(), expected_grad, tol, "grad permuted (zero on padding rows)");
  if (weighted) check_close(probs.grad(), expected_dprobs, tol, "grad probs");
}

TEST_CASE("unpermute_tokens checks a caller's row_map and supports padding rows",
          "[ops][permutation][errors]") {
  check_row_map_contract(torch::kCPU, GENERATE(false, true));
}

TEST_CASE("unpermute_tokens checks a caller's row_map and supports padding rows on CUDA",
          "[ops][permutation][errors][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  check_row_map_contract(torch::kCUDA, GENERATE(false, true));
}

TEST_CASE("permutation on CUDA matches the CPU reference", "[ops][permutation][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const torch::Dtype dtype = GENERATE(torch::kFloat32, torch::kBFloat16);
  const int64_t topk = GENERATE(1, 2, 8);
  const int64_t experts = GENERATE(4, 16, 128);
  // 128 and 1320 take 16-byte vectors (1320: more chunks per row than permute loads at once, the
  // last one partial); 100 the scalar path; 1 a thread per row (the rows' probabilities).
  const int64_t hidden = GENERATE(128, 1320, 100, 1);
  // all: every expert eligible; few: only 3 (the rest empty); one: everything to expert 0.
  const int64_t allowed = GENERATE(-1, 3, 1);
  INFO("dtype=" << dtype << " topk=" << topk << " experts=" << experts << " hidden=" << hidden
                << " allowed=" << allowed);
  const int64_t tokens = 515;
  torch::Tensor indices = random_indices(tokens, topk, experts, 31 + topk, allowed);
  // Drop a few slots, as capacity does.
  indices.index_put_({torch::rand({tokens, topk}) < 0.05}, -1);
  const torch::Tensor x = torch::randn({tokens, hidden}).to(dtype);
  const torch::Tensor probs = torch::rand({tokens, topk});
  const torch::Tensor dy = torch::randn({tokens, hidden}).to(dtype);

  auto run = [&](const torch::Device& device, const torch::Tensor& idx) {
    // detach(): on the CPU, to() returns x itself, which must stay a plain tensor.
    const torch::Tensor xd = x.to(device).detach().requires_grad_(true);
    const torch::Tensor pd = probs.to(device).detach().requires_grad_(true);
    const auto routed = F::permute_tokens(xd, idx.to(device), experts);
    const torch::Tensor y = F::unpermute_tokens(routed.tokens * 2, routed.row_map, pd);
    y.backward(dy.to(device));
    return std::make_tuple(routed, y, xd.grad(), pd.grad());
  };
  const auto [cpu_routed, cpu_y, cpu_dx, cpu_dp] = run(torch::kCPU, indices);
  for (const bool int32 : {false, true}) {
    INFO("int32 indices=" << int32);
    const auto [routed, y, dx, dp] = run(torch::kCUDA, int32 ? indices.to(torch::kInt) : indices);
    CHECK(routed.m_splits.host().vec() == cpu_routed.m_splits.host().vec());
    CHECK(torch::equal(routed.m_splits.device().cpu(), torch::tensor(cpu_routed.m_splits.host())));
    CHECK(torch::equal(routed.row_map.cpu(), cpu_routed.row_map));
    CHECK(torch::equal(routed.tokens.cpu(), cpu_routed.tokens));
    const Tolerance tol = dtype == torch::kFloat32 ? Tolerance{1e-5, 1e-5} : Tolerance{1e-2, 1e-2};
    check_close(y, cpu_y, tol, "unpermute");
    check_close(dx, cpu_dx, tol, "grad tokens");
    check_close(dp, cpu_dp, {tol.rtol, tol.atol * hidden}, "grad probs");
    // The op with probabilities (scaled in fp32, one rounding on both devices).
    const torch::Tensor scaled = torchmoe::ops::permute_rows(
        x.cuda(), routed.row_map, routed.sorted_slots, probs.cuda().to(dtype));
    const torch::Tensor cpu_scaled = torchmoe::ops::permute_rows(
        x, cpu_routed.row_map, cpu_routed.sorted_slots, probs.to(dtype));
    CHECK(torch::equal(scaled.cpu(), cpu_scaled));
  }
}

// A caller's row_map into a buffer with padding rows spread over many warps' 32-row groups: the
// CUDA permutation writes each token's rows and zeroes every padding row, as the CPU reference.
TEST_CASE("permute_rows on CUDA zeroes padding rows and matches the CPU",
          "[ops][permutation][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int64_t tokens = 150, topk = 2, rows = 1000, hidden = 264;
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(53);
  torch::Tensor row_map =
      torch::randperm(rows, gen, torch::kLong).narrow(0, 0, tokens * topk).view({tokens, topk});
  row_map.index_put_({torch::rand({tokens, topk}, gen) < 0.1}, -1);  // dropped slots
  const torch::Tensor sorted_slots = torchmoe::ops::slots_of_rows(row_map, rows);
  const torch::Tensor x = torch::randn({tokens, hidden}, gen).to(torch::kBFloat16);
  const torch::Tensor probs = torch::rand({tokens, topk}, gen);
  for (const bool weighted : {false, true}) {
    INFO("weighted=" << weighted);
    const torch::Tensor p = weighted ? probs : torch::Tensor();
    const torch::Tensor expected = torchmoe::ops::permute_rows(x, row_map, sorted_slots, p);
    const torch::Tensor actual = torchmoe::ops::permute_rows(
        x.cuda(), row_map.cuda(), sorted_slots.cuda(), weighted ? p.cuda() : p);
    CHECK(torch::equal(actual.cpu(), expected));
    CHECK(expected.index_select(0, torch::nonzero(sorted_slots < 0).view(-1))
              .abs()
              .sum()
              .item<float>() == 0.0f);
  }
}

// Edge shape: no tokens and fewer padding rows than a warp checks at once (the grid is then sized
// by the rows alone), on the CPU and CUDA.
TEST_CASE("permute_rows with no tokens zeroes its padding rows", "[ops][permutation]") {
  for (const bool cuda : {false, true}) {
    TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
    const auto device = cuda ? torch::kCUDA : torch::kCPU;
    const torch::Tensor x =
        torch::empty({0, 264}, torch::TensorOptions(torch::kBFloat16).device(device));
    const torch::Tensor row_map =
        torch::empty({0, 2}, torch::TensorOptions(torch::kLong).device(device));
    const torch::Tensor sorted_slots = torch::full({5}, -1, row_map.options());
    // Garbage in the caching allocator's next block, so that an unwritten output shows.
    torch::full({5, 264}, 7, x.options());
    const torch::Tensor out =
        torchmoe::ops::permute_rows(x, row_map, sorted_slots, torch::Tensor());
    CHECK(out.sizes() == torch::IntArrayRef({5, 264}));
    CHECK(out.abs().sum().item<float>() == 0.0f);
  }
}

TEST_CASE(
    "the dropless routing map keeps the split sizes on the device and matches the checked one",
    "[ops][permutation][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int64_t topk = GENERATE(1, 2, 8);
  const int64_t experts = GENERATE(4, 128);
  // all: every expert eligible; one: everything to expert 0 (the others empty).
  const int64_t allowed = GENERATE(-1, 1);
  INFO("topk=" << topk << " experts=" << experts << " allowed=" << allowed);
  const int64_t tokens = 515;
  const torch::Tensor indices =
      random_indices(tokens, topk, experts, 7 + topk, allowed).to(torch::kCUDA);
  using torchmoe::ops::IndexTrust;
  const auto checked = torchmoe::ops::make_routing_map(indices, experts, IndexTrust::kChecked);
  const auto dropless = torchmoe::ops::make_routing_map(indices, experts, IndexTrust::kDropless);
  CHECK(dropless.host_splits.empty());  // nothing was copied to the host
  CHECK(dropless.num_rows == tokens * topk);
  CHECK(dropless.m_splits.is_cuda());
  CHECK(torch::equal(dropless.m_splits, checked.m_splits));
  CHECK(torch::equal(dropless.row_map, checked.row_map));
  CHECK(torch::equal(dropless.sorted_slots, checked.sorted_slots));
  CHECK(torch::equal(dropless.row_tokens, checked.row_tokens));
  CHECK(torch::equal(checked.row_tokens.cpu(), checked.sorted_slots.cpu().div(topk, "floor")));
}

// The counting sort at sizes the small cases do not reach: hundreds of blocks (each summing the
// earlier blocks' counts), spans of many rounds per warp (more slots than the chunk count's
// bound times 32 per warp), a ragged last span, and the most experts it takes (one warp per
// block); past them, an error.
TEST_CASE("the CUDA routing map matches the CPU at large sizes and refuses too many experts",
          "[ops][permutation][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  using torchmoe::ops::IndexTrust;
  using torchmoe::ops::make_routing_map;
  struct Case {
    int64_t tokens, topk, experts;
  };
  // 1.2M slots (spans of 1,216 for 66 bins), 8,193 slots over 32 experts (the last span 1 slot),
  // and 4,094 experts, each with dropped entries.
  for (const Case c : {Case{300001, 4, 64}, Case{8193, 1, 32}, Case{5000, 3, 4094}}) {
    INFO("tokens=" << c.tokens << " topk=" << c.topk << " experts=" << c.experts);
    torch::Tensor indices = random_indices(c.tokens, c.topk, c.experts, 61 + c.topk);
    const auto gen = at::make_generator<at::CPUGeneratorImpl>(67);
    indices.index_put_({torch::rand({c.tokens, c.topk}, gen) < 0.03}, -1);
    const auto expected = make_routing_map(indices, c.experts, IndexTrust::kChecked);
    const auto actual = make_routing_map(indices.cuda(), c.experts, IndexTrust::kChecked);
    CHECK(actual.host_splits == expected.host_splits);
    CHECK(torch::equal(actual.m_splits.cpu(), expected.m_splits));
    CHECK(torch::equal(actual.row_map.cpu(), expected.row_map));
    CHECK(torch::equal(actual.sorted_slots.cpu(), expected.sorted_slots));
    CHECK(torch::equal(actual.row_tokens.cpu(), expected.row_tokens));
  }
  const torch::Tensor wild = torch::tensor({{0, 9000}, {-1, 4093}}, torch::kLong).cuda();
  CHECK_THROWS_WITH(make_routing_map(wild, 4094, IndexTrust::kChecked),
                    Contains("indices must be in [0, 4094) or -1 (dropped), got 1 out of range"));
  CHECK_THROWS_AS(make_routing_map(wild, 4095, IndexTrust::kChecked), c10::NotImplementedError);
  CHECK_THROWS_WITH(make_routing_map(wild, 4095, IndexTrust::kChecked),
                    Contains("at most 4094 experts on CUDA"));
}

// float64 probabilities on CUDA (no row kernel takes them): the rows' probabilities and their
// gradient as on the CPU.
TEST_CASE("permute_tokens on CUDA takes float64 probabilities", "[ops][permutation][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const torch::Tensor indices = random_indices(37, 2, 5, 71);
  const torch::Tensor x = torch::randn({37, 16});
  const torch::Tensor probs = torch::rand({37, 2}, torch::kFloat64);
  auto run = [&](const torch::Device& device) {
    const torch::Tensor p = probs.to(device).detach().requires_grad_(true);
    const auto routed = F::permute_tokens(x.to(device), indices.to(device), 5, p);
    routed.probs.backward(torch::arange(routed.probs.size(0), torch::kFloat64).to(device));
    return std::make_pair(routed.probs.cpu(), p.grad().cpu());
  };
  const auto [cpu_probs, cpu_grad] = run(torch::kCPU);
  const auto [cuda_probs, cuda_grad] = run(torch::kCUDA);
  CHECK(cuda_probs.scalar_type() == torch::kFloat64);
  CHECK(torch::equal(cuda_probs, cpu_probs));
  CHECK(torch::equal(cuda_grad, cpu_grad));
}

TEST_CASE("unpermute on CUDA passes over map entries outside the contract",
          "[ops][permutation][cuda]") {
  // Entries the CPU path would refuse or fault on (rows past N, slots past T·k, negatives other
  // than -1) are read as dropped by the kernels, never as addresses: the results equal the CPU's
  // with those entries set to -1 (compute-sanitizer runs this case).
  TORCHMOE_REQUIRE_CUDA();
  torch::manual_seed(11);
  const int64_t tokens = 6, topk = 2, rows = 8, hidden = 40;
  const torch::Tensor permuted = torch::randn({rows, hidden});
  const torch::Tensor probs = torch::rand({tokens, topk});
  const torch::Tensor row_map =
      torch::tensor({0, 1, 2, 9, 3, 4, 100, 5, 6, -1, 7, -3}, torch::kLong).view({tokens, topk});
  const torch::Tensor in_contract = torch::where((row_map >= 0) & (row_map < rows), row_map, -1);
  check_close(torchmoe::ops::unpermute_rows(permuted.cuda(), row_map.cuda(), probs.cuda()),
              torchmoe::ops::unpermute_rows(permuted, in_contract, probs), {1e-6, 1e-6},
              "unpermute");

  const torch::Tensor sorted_slots = torch::tensor({0, 1, 2, 12, 4, 5, 50, -1}, torch::kLong);
  const torch::Tensor slots_in_contract =
      torch::where(sorted_slots < tokens * topk, sorted_slots, -1);
  const torch::Tensor grad_out = torch::randn({tokens, hidden});
  const auto cuda = torchmoe::ops::unpermute_rows_backward(grad_out.cuda(), permuted.cuda(),
                                                           sorted_slots.cuda(), probs.cuda());
  const auto cpu =
      torchmoe::ops::unpermute_rows_backward(grad_out, permuted, slots_in_contract, probs);
  check_close(cuda.grad_permuted, cpu.grad_permuted, {1e-6, 1e-6}, "grad permuted");
  check_close(cuda.grad_probs, cpu.grad_probs, {1e-5, 1e-5}, "grad probs");
}
