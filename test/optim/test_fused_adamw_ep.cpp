// FusedAdamW's clip_grad_norm over a process group, run as 2 and 4 processes over Gloo (ctest
// ep_n2, ep_n4): with replicated parameters and a sharded one, the norm and the clipped step equal
// a single FusedAdamW's over the whole (unsharded) model.

#include <torchmoe/optim/fused_adamw.h>

#include "distributed/ep_test_utils.h"
#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::optim::FusedAdamW;
using torchmoe::optim::FusedAdamWOptions;

TEST_CASE("FusedAdamW clip_grad_norm over sharded and replicated parameters", "[ep]") {
  const int64_t ranks = test_world(), rank = test_rank(), rows = 3;
  torch::manual_seed(7);  // the same whole model and gradients on every rank
  const auto f64 = torch::TensorOptions(torch::kFloat64);
  const torch::Tensor replicated = torch::randn({5, 4}, f64), bias = torch::randn({4}, f64);
  const torch::Tensor whole = torch::randn({ranks * rows, 6}, f64);
  const torch::Tensor replicated_grad = torch::randn({5, 4}, f64),
                      bias_grad = torch::randn({4}, f64);
  const torch::Tensor whole_grad = torch::randn({ranks * rows, 6}, f64);

  std::vector<torch::Tensor> single = {replicated.clone(), bias.clone(), whole.clone()};
  single[0].mutable_grad() = replicated_grad.clone();
  single[1].mutable_grad() = bias_grad.clone();
  single[2].mutable_grad() = whole_grad.clone();
  FusedAdamW single_adamw(single, FusedAdamWOptions(1e-2).weight_decay(0.1));
  const double max_norm = 1.0;  // well below the norm: the step is clipped
  const torch::Tensor single_norm = single_adamw.clip_grad_norm(max_norm);
  single_adamw.step();

  std::vector<torch::Tensor> mine = {replicated.clone(), bias.clone(),
                                     whole.narrow(0, rank * rows, rows).clone()};
  mine[0].mutable_grad() = replicated_grad.clone();
  mine[1].mutable_grad() = bias_grad.clone();
  mine[2].mutable_grad() = whole_grad.narrow(0, rank * rows, rows).clone();
  FusedAdamW adamw(mine, FusedAdamWOptions(1e-2).weight_decay(0.1));
  const torch::Tensor norm = adamw.clip_grad_norm(max_norm, {mine[2]}, test_group());
  REQUIRE(single_norm.item<double>() > 2 * max_norm);
  CHECK(norm.item<double>() == Approx(single_norm.item<double>()).epsilon(1e-6));
  adamw.step();
  check_close(mine[0], single[0], {1e-6, 1e-9}, "replicated");
  check_close(mine[1], single[1], {1e-6, 1e-9}, "bias");
  check_close(mine[2], single[2].narrow(0, rank * rows, rows), {1e-6, 1e-9}, "shard");

  REQUIRE_THROWS_WITH(adamw.clip_grad_norm(max_norm, {torch::zeros({2})}, test_group()),
                      Contains("every sharded tensor must be one of the optimizer's parameters"));
  REQUIRE_THROWS_WITH(adamw.clip_grad_norm(0.0, {mine[2]}, test_group()),
                      Contains("max_norm must be positive, got 0"));
  // One rank's arguments refused: it joins the all-reduce before it throws, and the others get a
  // NaN norm rather than wait for it.
  if (rank == 0) {
    REQUIRE_THROWS_WITH(adamw.clip_grad_norm(max_norm, {torch::zeros({2})}, test_group()),
                        Contains("every sharded tensor must be one of the optimizer's parameters"));
  } else {
    CHECK(std::isnan(adamw.clip_grad_norm(max_norm, {mine[2]}, test_group()).item<double>()));
  }
}
