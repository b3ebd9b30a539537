#pragma once
// Helpers for the expert-parallel tests, which run as several processes (run_ranks.sh sets
// RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun does): one Gloo process group per
// process, made on first use, and slices of the global batch that every rank builds alike.

#include <torch/torch.h>
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "torchmoe/distributed/collectives.h"
#include "torchmoe/distributed/process_group.h"

namespace torchmoe::test {

// TORCHMOE_TEST_TIMEOUT_MS (ctest sets a short one for the failure cases), else 60 s.
inline std::chrono::milliseconds test_timeout() {
  const char* value = std::getenv("TORCHMOE_TEST_TIMEOUT_MS");
  return std::chrono::milliseconds(value ? std::stoll(value) : 60000);
}

// The process's group, with the test timeout on every collective.
inline const ProcessGroupOptions& test_group() {
  static const ProcessGroupOptions group =
      ProcessGroupOptions(distributed::init_process_group(torch::kCPU, test_timeout()))
          .timeout(test_timeout());
  return group;
}

inline int64_t test_rank() { return test_group().group()->getRank(); }
inline int64_t test_world() { return test_group().group()->getSize(); }

// Rows [offset of rank, + sizes[rank]) of a global batch split into consecutive per-rank blocks.
inline torch::Tensor rank_rows(const torch::Tensor& global, const std::vector<int64_t>& sizes,
                               int64_t rank) {
  const int64_t offset = std::accumulate(sizes.begin(), sizes.begin() + rank, int64_t{0});
  return global.narrow(0, offset, sizes[rank]);
}

}  // namespace torchmoe::test
