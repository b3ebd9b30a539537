// The delayed-scaling amax reduction (DelayedScaling::reduce_amax) over Gloo, run as 2, 3 and 4
// processes (ctest ep_n2, fp8_reduce_amax_n3, ep_n4): after fp8::reduce_amax, Fp8State::reduce_amax
// or an update given the group, row 0 of the histories of the pass's roles is the elementwise max
// of the ranks' rows on every rank, and everything else (the other rows, the other pass's roles,
// the scales) is as it was; with reduce_amax(false) or no group nothing is reduced. The update
// itself is CUDA only: on the CPU it raises NotImplementedError after the reduction, which is what
// these cases check.

#include <torchmoe/fp8/state.h>
#include <torchmoe/modules/grouped_mlp.h>

#include <algorithm>
#include <initializer_list>
#include <vector>

#include "distributed/ep_test_utils.h"
#include "test_utils.h"

using namespace torchmoe::fp8;
using namespace torchmoe::test;
using torchmoe::GroupedLinearOptions;
using torchmoe::GroupedMLP;
using torchmoe::GroupedMLPOptions;

namespace {

constexpr int64_t kHistory = 4, kExperts = 3;
constexpr TensorRole kAllRoles[] = {TensorRole::kInput, TensorRole::kWeight,
                                    TensorRole::kGradOutput};
const auto kForwardRoles = {TensorRole::kInput, TensorRole::kWeight};
const auto kBackwardRoles = {TensorRole::kGradOutput};

GroupedMLP fp8_mlp() {
  return GroupedMLP(GroupedMLPOptions(kExperts, 16, 32)
                        .linear(GroupedLinearOptions(1, 1, 1).fp8_amax_history_len(kHistory)));
}

std::vector<Fp8StateImpl*> states(const GroupedMLP& mlp) {
  return {mlp->fc1->fp8_state().get(), mlp->fc2->fp8_state().get()};
}

// [world, num_gemms]: row r is rank r's amaxes of `role` in layer `layer`, the same table on every
// rank, so that each knows the max. Expert g's largest amax is on the rank r with
// (r + g + role + layer) mod world = world - 1, another rank for the next expert: with 2 or more
// ranks every rank has experts whose max is another rank's, and the reduction changes its row.
torch::Tensor all_ranks_amaxes(int64_t layer, TensorRole role) {
  const int64_t world = test_world(), k = static_cast<int64_t>(role);
  torch::Tensor table = torch::empty({world, kExperts});
  for (int64_t r = 0; r < world; ++r) {
    for (int64_t g = 0; g < kExperts; ++g) {
      table[r][g] = 1.0 + 10.0 * ((r + g + k + layer) % world) + 0.5 * g + 0.25 * k;
    }
  }
  return table;
}

// Row 0 of each history from all_ranks_amaxes; the other rows and the scales from a seed of this
// rank, so they differ between ranks and a reduction of the wrong rows would show.
void fill_states(const GroupedMLP& mlp) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(100 + test_rank());
  int64_t layer = 0;
  for (Fp8StateImpl* state : states(mlp)) {
    for (TensorRole role : kAllRoles) {
      const DelayedScalingTensors& t = state->tensors(role);
      t.amax_history.uniform_(0.5, 8.0);
      t.amax_history[0].copy_(all_ranks_amaxes(layer, role)[test_rank()]);
      t.scale.uniform_(1.0, 4.0);
      t.scale_inv.copy_(1.0 / t.scale);
    }
    ++layer;
  }
}

// `mlp`'s states against `before` (their copies from before the reduction): row 0 of the
// `reduced` roles is the max over the ranks, everything else is unchanged.
void check_reduced(const GroupedMLP& mlp, const std::vector<torch::Tensor>& before,
                   std::initializer_list<TensorRole> reduced) {
  size_t i = 0;
  int64_t layer = 0;
  for (const Fp8StateImpl* state : states(mlp)) {
    for (TensorRole role : kAllRoles) {
      INFO("layer " << layer << ", " << role_name(role));
      const DelayedScalingTensors& t = state->tensors(role);
      const torch::Tensor& history = before.at(i++);
      const torch::Tensor& scale = before.at(i++);
      const torch::Tensor& scale_inv = before.at(i++);
      const bool is_reduced = std::find(reduced.begin(), reduced.end(), role) != reduced.end();
      const torch::Tensor all = all_ranks_amaxes(layer, role);
      const torch::Tensor expected = is_reduced ? all.amax(0) : all[test_rank()];
      CHECK(t.amax_history[0].equal(expected));
      if (is_reduced) CHECK_FALSE(t.amax_history[0].equal(all[test_rank()]));
      CHECK(t.amax_history.narrow(0, 1, kHistory - 1).equal(history.narrow(0, 1, kHistory - 1)));
      CHECK(t.scale.equal(scale));
      CHECK(t.scale_inv.equal(scale_inv));
    }
    ++layer;
  }
}

std::vector<torch::Tensor> snapshot(const GroupedMLP& mlp) {
  std::vector<torch::Tensor> copies;
  for (const Fp8StateImpl* state : states(mlp)) {
    for (TensorRole role : kAllRoles) {
      const DelayedScalingTensors& t = state->tensors(role);
      for (const torch::Tensor& b : {t.amax_history, t.scale, t.scale_inv})
        copies.push_back(b.clone());
    }
  }
  return copies;
}

}  // namespace

TEST_CASE("fp8::reduce_amax maxes this step's amaxes of a pass over the group",
          "[ep][fp8_reduce_amax]") {
  REQUIRE(test_world() >= 2);
  GroupedMLP mlp = fp8_mlp();
  fill_states(mlp);
  const std::vector<torch::Tensor> before = snapshot(mlp);
  SECTION("forward: input and weight") {
    CHECK(reduce_amax(*mlp, Pass::kForward, test_group()) == 2);
    check_reduced(mlp, before, kForwardRoles);
  }
  SECTION("backward: grad_output") {
    CHECK(reduce_amax(*mlp, Pass::kBackward, test_group()) == 2);
    check_reduced(mlp, before, kBackwardRoles);
  }
  SECTION("one state at a time") {
    // Forward reduces a concatenation of two rows, backward the one row in place.
    mlp->fc1->fp8_state()->reduce_amax(Pass::kForward, test_group());
    mlp->fc2->fp8_state()->reduce_amax(Pass::kForward, test_group());
    mlp->fc1->fp8_state()->reduce_amax(Pass::kBackward, test_group());
    mlp->fc2->fp8_state()->reduce_amax(Pass::kBackward, test_group());
    check_reduced(mlp, before, {TensorRole::kInput, TensorRole::kWeight, TensorRole::kGradOutput});
  }
}

TEST_CASE("fp8::update_delayed_scaling reduces the amaxes with a group and reduce_amax",
          "[ep][fp8_reduce_amax]") {
  GroupedMLP mlp = fp8_mlp();
  fill_states(mlp);
  const std::vector<torch::Tensor> before = snapshot(mlp);
  const auto recipe = DelayedScaling().amax_history_len(kHistory);
  // The update proper is CUDA only; on the CPU it stops at the op, after the reduction.
  SECTION("reduce_amax (the default) and a group: the max over the ranks") {
    REQUIRE(recipe.reduce_amax());
    CHECK_THROWS_AS(update_delayed_scaling(*mlp, recipe, Pass::kForward, test_group()),
                    c10::NotImplementedError);
    check_reduced(mlp, before, kForwardRoles);
  }
  SECTION("Fp8State::update with a group: its own roles") {
    CHECK_THROWS_AS(mlp->fc1->fp8_state()->update(recipe, Pass::kBackward, test_group()),
                    c10::NotImplementedError);
    CHECK_THROWS_AS(mlp->fc2->fp8_state()->update(recipe, Pass::kBackward, test_group()),
                    c10::NotImplementedError);
    check_reduced(mlp, before, kBackwardRoles);
  }
  SECTION("reduce_amax(false): each rank keeps its amaxes") {
    CHECK_THROWS_AS(update_delayed_scaling(*mlp, DelayedScaling(recipe).reduce_amax(false),
                                           Pass::kForward, test_group()),
                    c10::NotImplementedError);
    CHECK_THROWS_AS(mlp->fc1->fp8_state()->update(DelayedScaling(recipe).reduce_amax(false),
                                                  Pass::kBackward, test_group()),
                    c10::NotImplementedError);
    check_reduced(mlp, before, {});
  }
  SECTION("no group: each rank keeps its amaxes") {
    CHECK_THROWS_AS(update_delayed_scaling(*mlp, recipe, Pass::kForward), c10::NotImplementedError);
    check_reduced(mlp, before, {});
  }
}
