// Expert parallelism's plans and its differentiable exchange, run as 2 and 4 processes over Gloo:
// the split-size exchange, the variable-split all-to-all and its backward (the reverse exchange),
// the receive-side grouping, capacity mode's padding, and argument errors. The collectives' own
// cases (the max all-reduce, a peer that exits or never joins): test_collectives.cpp.

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>

#include "distributed/ep_test_utils.h"
#include "test_utils.h"
#include "torchmoe/autograd/expert_parallel_function.h"
#include "torchmoe/distributed/collectives.h"
#include "torchmoe/modules/token_permutation.h"
#include "torchmoe/ops/expert_parallel.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

namespace {

// Rows rank `from` sends to rank `to`: (from + 2·to) % 3, so some pairs send none.
int64_t rows_between(int64_t from, int64_t to) { return (from + 2 * to) % 3; }

}  // namespace

TEST_CASE("exchange_split_sizes: every rank learns what it receives per local expert", "[ep]") {
  const int64_t ep = test_world(), rank = test_rank(), local = 3;
  // Rank r sends 10·r + e rows to global expert e.
  const torch::Tensor counts = torch::arange(ep * local, torch::kLong) + 10 * rank;
  const torchmoe::ops::ExpertParallelSplits splits =
      torchmoe::ops::exchange_split_sizes(counts, test_group());
  REQUIRE(splits.send.size() == static_cast<size_t>(ep));
  for (int64_t r = 0; r < ep; ++r) {
    int64_t sent = 0, received = 0;
    for (int64_t l = 0; l < local; ++l) {
      sent += 10 * rank + r * local + l;
      received += 10 * r + rank * local + l;
      REQUIRE(splits.recv_per_expert[r * local + l] == 10 * r + rank * local + l);
    }
    REQUIRE(splits.send[r] == sent);
    REQUIRE(splits.recv[r] == received);
  }
}

TEST_CASE("all_to_all_rows: rows reach their rank; the gradient takes the reverse way", "[ep]") {
  const int64_t ep = test_world(), rank = test_rank(), hidden = 5;
  std::vector<int64_t> send, recv;
  std::vector<torch::Tensor> blocks, expected;
  for (int64_t r = 0; r < ep; ++r) {
    send.push_back(rows_between(rank, r));
    recv.push_back(rows_between(r, rank));
    // Each row says where it came from and where it goes.
    blocks.push_back(torch::full({send.back(), hidden}, 100.0 * rank + r, torch::kFloat64));
    expected.push_back(torch::full({recv.back(), hidden}, 100.0 * r + rank, torch::kFloat64));
  }
  const torch::Tensor x = torch::cat(blocks).requires_grad_(true);
  const torch::Tensor y = torchmoe::autograd::all_to_all_rows(x, send, recv, test_group());
  REQUIRE(torch::equal(y, torch::cat(expected)));
  // Each received row's gradient is its value, which names where it came from: back home, the
  // gradient must equal x.
  (y * y.detach()).sum().backward();
  REQUIRE(torch::equal(x.grad(), x.detach()));
  // Under create_graph the same gradient, and a second derivative is refused, not dropped.
  const torch::Tensor x2 = x.detach().clone().requires_grad_(true);
  const torch::Tensor y2 = torchmoe::autograd::all_to_all_rows(x2, send, recv, test_group());
  const torch::Tensor g = torch::autograd::grad({(y2 * y2.detach()).sum()}, {x2}, {},
                                                /*retain_graph=*/true, /*create_graph=*/true)[0];
  CHECK(torch::equal(g, x.detach()));
  REQUIRE_THROWS_WITH(g.sum().backward(),
                      Contains("AllToAllFunction: a second derivative through this function"));
}

TEST_CASE("route_received groups the received chunks by local expert", "[ep]") {
  // 2 sources x 2 local experts: chunks (r0,e0)=1, (r0,e1)=2, (r1,e0)=0, (r1,e1)=3 rows.
  const std::vector<int64_t> counts = {1, 2, 0, 3};
  const torch::Tensor probs = (torch::arange(6, torch::kFloat64) / 10).requires_grad_(true);
  const torchmoe::PermutedTokens grouped =
      torchmoe::autograd::route_received(probs, counts, /*num_local_experts=*/2);
  // Expert 0: row 0; expert 1: rows 1, 2 (rank 0), then 3, 4, 5 (rank 1).
  REQUIRE(torch::equal(grouped.sorted_slots, torch::arange(6, torch::kLong)));
  REQUIRE(torch::equal(grouped.row_tokens, grouped.sorted_slots));
  REQUIRE(grouped.m_splits.host().vec() == std::vector<int64_t>{1, 5});
  REQUIRE_FALSE(grouped.tokens.defined());
  const std::vector<int64_t> chunks = {2, 1, 1, 0};  // (r0,e0)=2, (r0,e1)=1, (r1,e0)=1, (r1,e1)=0
  const torch::Tensor delivered = (torch::arange(4, torch::kFloat64) / 10).requires_grad_(true);
  const torchmoe::PermutedTokens regrouped =
      torchmoe::autograd::route_received(delivered, chunks, 2);
  REQUIRE(torch::equal(regrouped.sorted_slots, torch::tensor({0, 1, 3, 2}, torch::kLong)));
  REQUIRE(torch::equal(regrouped.row_map, torch::tensor({0, 1, 3, 2}, torch::kLong).view({4, 1})));
  REQUIRE(regrouped.m_splits.host().vec() == std::vector<int64_t>{3, 1});
  REQUIRE(torch::equal(regrouped.probs, torch::tensor({0.0, 0.1, 0.3, 0.2}, torch::kFloat64)));
  // The probabilities' gradient goes back to the rows they were delivered with.
  (regrouped.probs * torch::tensor({1.0, 2.0, 3.0, 4.0}, torch::kFloat64)).sum().backward();
  REQUIRE(torch::equal(delivered.grad(), torch::tensor({1.0, 2.0, 4.0, 3.0}, torch::kFloat64)));
  // 3 sources x 2 local experts, one row each but (r2,e1): the map interleaves the sources and is
  // not its own inverse.
  const std::vector<int64_t> three = {1, 1, 1, 1, 1, 0};
  const torchmoe::PermutedTokens interleaved =
      torchmoe::autograd::route_received(torch::zeros({5}, torch::kFloat64), three, 2);
  REQUIRE(torch::equal(interleaved.sorted_slots, torch::tensor({0, 2, 4, 1, 3}, torch::kLong)));
  REQUIRE(torch::equal(interleaved.row_tokens, interleaved.sorted_slots));
  REQUIRE(
      torch::equal(interleaved.row_map, torch::tensor({0, 3, 1, 4, 2}, torch::kLong).view({5, 1})));
  REQUIRE(interleaved.m_splits.host().vec() == std::vector<int64_t>{3, 2});
  REQUIRE_THROWS_WITH(torchmoe::autograd::route_received(torch::zeros({3}), chunks, 2),
                      Contains("route_received: probs must be [4] as the counts say, got [3]"));
}

TEST_CASE("permute_to_capacity pads each expert to capacity and drops the slots past it", "[ep]") {
  // 4 tokens, top-2, 3 experts, capacity 2: expert 1 is chosen by 3 slots, so its last is dropped;
  // slot (3, 1) was dropped by the router already.
  const torch::Tensor indices = torch::tensor({0, 1, 1, 2, 1, 0, 2, -1}, torch::kLong).view({4, 2});
  const torch::Tensor tokens = torch::arange(4, torch::kFloat64).unsqueeze(1).requires_grad_(true);
  const torch::Tensor probs = (torch::arange(8, torch::kFloat64) / 10).view({4, 2});
  const torchmoe::PermutedTokens padded =
      torchmoe::autograd::permute_to_capacity(tokens, indices, probs, 3, 2);
  REQUIRE(torch::equal(padded.row_map,
                       torch::tensor({0, 2, 3, 4, -1, 1, 5, -1}, torch::kLong).view({4, 2})));
  REQUIRE(torch::equal(padded.tokens.squeeze(1),
                       torch::tensor({0., 2., 0., 1., 1., 3.}, torch::kFloat64)));
  REQUIRE(torch::equal(padded.probs, torch::tensor({0., .5, .1, .2, .3, .6}, torch::kFloat64)));
  REQUIRE(padded.m_splits.host().vec() == std::vector<int64_t>{2, 2, 2});
  // Back through the padded layout: each token gets the sum of its kept rows.
  const torch::Tensor back = torchmoe::functional::unpermute_tokens(padded.tokens, padded);
  REQUIRE(torch::equal(back.squeeze(1), torch::tensor({0., 2., 2., 3.}, torch::kFloat64)));
  back.sum().backward();
  REQUIRE(torch::equal(tokens.grad().squeeze(1), torch::tensor({2., 2., 1., 1.}, torch::kFloat64)));
}

TEST_CASE("exchange_split_sizes: a negative count on one rank is an error on every rank", "[ep]") {
  const int64_t ep = test_world(), rank = test_rank();
  torch::Tensor counts = torch::ones({2 * ep}, torch::kLong);
  if (rank == ep - 1) counts[0] = -1;  // a count for rank 0's expert: only rank 0 receives it
  REQUIRE_THROWS_WITH(torchmoe::ops::exchange_split_sizes(counts, test_group()),
                      Contains("rows_per_expert must be >= 0 on every rank, got a negative count "
                               "on rank(s) [" +
                               std::to_string(ep - 1) + "]"));
  // Every rank stopped at the same point: the group still pairs its collectives.
  const torchmoe::ops::ExpertParallelSplits splits =
      torchmoe::ops::exchange_split_sizes(torch::ones({2 * ep}, torch::kInt), test_group());
  CHECK(splits.recv == std::vector<int64_t>(ep, 2));
  CHECK(splits.send == std::vector<int64_t>(ep, 2));
}

TEST_CASE("expert-parallel ops: argument errors", "[ep]") {
  const int64_t ep = test_world();
  const torch::Tensor rows = torch::zeros({4, 2});
  REQUIRE_THROWS_WITH(
      torchmoe::distributed::all_to_all_rows(rows, std::vector<int64_t>(ep + 1, 0),
                                             std::vector<int64_t>(ep, 0), test_group()),
      Contains("must have one entry per rank"));
  std::vector<int64_t> wrong_sum(ep, 0);
  wrong_sum[0] = 3;
  REQUIRE_THROWS_WITH(torchmoe::distributed::all_to_all_rows(
                          rows, wrong_sum, std::vector<int64_t>(ep, 0), test_group()),
                      Contains("send_splits must sum to rows.size(0) = 4"));
  REQUIRE_THROWS_WITH(
      torchmoe::ops::exchange_split_sizes(torch::zeros({2 * ep + 1}, torch::kLong), test_group()),
      Contains("num_experts must be divisible by the group size"));
  REQUIRE_THROWS_WITH(torchmoe::ops::exchange_split_sizes(torch::zeros({2 * ep}), test_group()),
                      Contains("rows_per_expert must be int32 or int64, got Float"));
  // The rows a rank keeps are its own block both ways (every rank refuses before the exchange).
  const int64_t rank = test_rank();
  std::vector<int64_t> keep_send(ep, 0), keep_recv(ep, 0);
  keep_send[rank] = 4;
  keep_recv[rank] = 3;
  REQUIRE_THROWS_WITH(
      torchmoe::distributed::all_to_all_rows(rows, keep_send, keep_recv, test_group()),
      Contains("this rank's own block must be as long sent as received, got "
               "send_splits[" +
               std::to_string(rank) + "] = 4 and recv_splits[" + std::to_string(rank) + "] = 3"));
  // c10d reads a zero timeout as none: a peer that never comes would hang the others.
  torch::Tensor counts = torch::zeros({2});
  REQUIRE_THROWS_WITH(torchmoe::distributed::all_reduce_sum_(
                          counts, torchmoe::ProcessGroupOptions(test_group().group())
                                      .timeout(std::chrono::milliseconds(0))),
                      Contains("all_reduce_sum_: the group's timeout must be positive, got 0 ms"));
  // A group without a CPU backend (as a CUDA-only NCCL group would be) refuses CPU data.
  const auto no_backend = c10::make_intrusive<c10d::ProcessGroup>(
      c10::make_intrusive<c10d::HashStore>(), 0, static_cast<int>(ep));
  torch::Tensor data = torch::zeros({2});
  REQUIRE_THROWS_WITH(
      torchmoe::distributed::all_reduce_sum_(data, torchmoe::ProcessGroupOptions(no_backend)),
      Contains("must have a backend for the data's device cpu"));
}
