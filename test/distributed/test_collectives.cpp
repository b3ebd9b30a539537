// The checked collectives (distributed/collectives.h), run as 2 and 4 processes over Gloo: the max
// all-reduce, and a peer that exits or never joins makes the others fail with an error within the
// timeout ([ep_peer_exits], [ep_peer_absent]: ctest runs those alone).

#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "distributed/ep_test_utils.h"
#include "test_utils.h"
#include "torchmoe/distributed/collectives.h"
#include "torchmoe/ops/expert_parallel.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

TEST_CASE("all_reduce_max_: the elementwise max over the ranks, in place", "[ep]") {
  const int64_t ep = test_world(), rank = test_rank();
  // Column 0 is largest on the last rank, column 1 on rank 0, column 2 on rank 1.
  torch::Tensor t = torch::tensor({static_cast<float>(rank), static_cast<float>(-rank),
                                   static_cast<float>((rank + ep - 2) % ep)});
  const void* data = t.const_data_ptr();
  torchmoe::distributed::all_reduce_max_(t, test_group());
  REQUIRE(t.const_data_ptr() == data);
  REQUIRE(torch::equal(
      t, torch::tensor({static_cast<float>(ep - 1), 0.0f, static_cast<float>(ep - 1)})));
  torch::Tensor strided = torch::zeros({4}).slice(0, 0, 4, 2);
  REQUIRE_THROWS_WITH(torchmoe::distributed::all_reduce_max_(strided, test_group()),
                      Contains("all_reduce_max_: tensor must be a defined contiguous tensor"));
}

TEST_CASE("a peer that exits makes the others fail within the timeout", "[ep_peer_exits]") {
  const auto& group = test_group();  // every rank joins the group first
  const int64_t rank = test_rank(), ep = test_world();
  torch::Tensor counts = torch::ones({ep}, torch::kLong);
  torchmoe::distributed::all_reduce_sum_(counts, group);
  if (rank == ep - 1) std::_Exit(0);  // a crash: no destructor, no goodbye
  const auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(torchmoe::ops::exchange_split_sizes(counts, group),
                      Contains("exchange_split_sizes: the collective failed on rank"));
  REQUIRE(std::chrono::steady_clock::now() - start < group.timeout() + std::chrono::seconds(5));
}

TEST_CASE("a peer that never joins makes the others fail after the timeout", "[ep_peer_absent]") {
  const auto& group = test_group();
  const int64_t rank = test_rank(), ep = test_world();
  if (rank == ep - 1) {
    // Alive but stuck: it joins no collective until the others have given up.
    std::this_thread::sleep_for(group.timeout() + std::chrono::seconds(3));
    return;
  }
  torch::Tensor counts = torch::ones({ep}, torch::kLong);
  const auto start = std::chrono::steady_clock::now();
  REQUIRE_THROWS_WITH(torchmoe::distributed::all_reduce_sum_(counts, group),
                      Contains("all_reduce_sum_: the collective failed on rank"));
  const auto waited = std::chrono::steady_clock::now() - start;
  REQUIRE(waited >= group.timeout() - std::chrono::milliseconds(100));
  REQUIRE(waited < group.timeout() + std::chrono::seconds(5));
}
