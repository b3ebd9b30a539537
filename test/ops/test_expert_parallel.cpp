// ops/expert_parallel.h without a process group: the capacity map on a hand-worked case
// (positions in slot order, slots past the capacity dropped, -1 and indices outside [0, E)
// dropped), the CUDA map against the CPU one, and its errors. The exchanges are tested across
// Gloo ranks (test/distributed).

#include <torchmoe/ops/expert_parallel.h>

#include "test_utils.h"

using Catch::Matchers::Contains;
namespace ops = torchmoe::ops;

TEST_CASE("make_capacity_map places slots in order and drops the rest", "[ops][moe]") {
  // E = 3, capacity 2. Slots in order: 0→e0, 1→e2, 2→e2, 3 dropped (-1), 4 outside [0, 3),
  // 5→e0, 6→e2 (its third: past the capacity), 7→e1.
  const torch::Tensor indices = torch::tensor({0, 2, 2, -1, 5, 0, 2, 1}).view({4, 2});
  for (const torch::Dtype dtype : {torch::kLong, torch::kInt}) {
    INFO("dtype=" << dtype);
    const ops::CapacityMap map = ops::make_capacity_map(indices.to(dtype), 3, 2);
    // Row e·capacity + position.
    CHECK(torch::equal(map.row_map,
                       torch::tensor({0, 4, 5, -1, -1, 1, -1, 2}, torch::kLong).view({4, 2})));
    // Each padded row's slot; row 3 (e1's second) is padding.
    CHECK(torch::equal(map.sorted_slots, torch::tensor({0, 5, 7, -1, 1, 2}, torch::kLong)));
  }
  const ops::CapacityMap none = ops::make_capacity_map(indices, 3, 0);
  CHECK((none.row_map == -1).all().item<bool>());
  CHECK(none.sorted_slots.numel() == 0);
}

TEST_CASE("make_capacity_map on CUDA (the routing map's sort) equals the CPU's one-hot count",
          "[ops][moe][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  torch::manual_seed(3);
  // E = 64; -1 (dropped) and 64..69 (outside [0, E)) among the indices.
  const torch::Tensor indices = torch::randint(-1, 70, {300, 4}, torch::kLong);
  for (const torch::Dtype dtype : {torch::kLong, torch::kInt}) {
    for (const int64_t capacity : {0, 3, 20, 2000}) {
      INFO("dtype=" << dtype << " capacity=" << capacity);
      const ops::CapacityMap cpu = ops::make_capacity_map(indices.to(dtype), 64, capacity);
      const ops::CapacityMap cuda =
          ops::make_capacity_map(indices.to(dtype).to(torch::kCUDA), 64, capacity);
      CHECK(torch::equal(cuda.row_map.cpu(), cpu.row_map));
      CHECK(torch::equal(cuda.sorted_slots.cpu(), cpu.sorted_slots));
    }
  }
}

TEST_CASE("make_capacity_map errors", "[ops][moe][errors]") {
  const torch::Tensor indices = torch::zeros({4, 2}, torch::kLong);
  CHECK_THROWS_WITH(ops::make_capacity_map(indices.view({8}), 3, 2),
                    Contains("make_capacity_map: indices must be 2-D [T, topk], got [8]"));
  CHECK_THROWS_WITH(ops::make_capacity_map(indices.to(torch::kFloat), 3, 2),
                    Contains("make_capacity_map: indices must be int32 or int64, got Float"));
  CHECK_THROWS_WITH(ops::make_capacity_map(indices, 0, 2),
                    Contains("num_experts must be positive and capacity >= 0, got 0 and 2"));
}
