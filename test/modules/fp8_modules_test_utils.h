#pragma once
// Helpers of the FP8 module tests (test_grouped_linear_fp8_cuda.cpp, test_grouped_mlp_fp8_cuda.cpp,
// test_grouped_linear_fp8_backends.cpp): their shapes and bounds
// (test_grouped_linear_fp8_cuda.cpp's comment says why), inputs with split-dependent magnitudes,
// runs and gradients of a layer, error measures, the recipes under test and their delayed-scaling
// calibration.

#include <torchmoe/autograd/glu_function.h>
#include <torchmoe/fp8/autocast.h>
#include <torchmoe/fp8/recipe.h>
#include <torchmoe/fp8/state.h>
#include <torchmoe/modules/grouped_linear.h>
#include <torchmoe/modules/grouped_mlp.h>

#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ops/fp8_reference.h"
#include "ops/split_quantize_reference.h"
#include "test_utils.h"

namespace torchmoe::test::fp8_modules {

using torchmoe::GroupedLinear;
using torchmoe::GroupedLinearOptions;
using torchmoe::GroupedMLP;
using torchmoe::GroupedMLPOptions;
namespace fp8 = torchmoe::fp8;
using fp8::TensorRole;

inline constexpr int64_t kGroups = 4, kIn = 256, kOut = 384, kHistory = 4;
inline const std::vector<int64_t> kSplits = {100, 0, 37, 211};  // an empty split, odd sizes
inline constexpr int64_t kRows = 348;

// Relative Frobenius error bounds (file comment).
inline constexpr double kE4M3Bound = 0.05;    // e4m3 × e4m3
inline constexpr double kHybridBound = 0.08;  // e5m2 × e4m3

inline const auto kCudaBf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);

// [Σ splits, cols] normal values times factors[g] on split g.
inline torch::Tensor split_scaled(int64_t cols, const std::vector<double>& factors, uint64_t seed) {
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  torch::Tensor x = torch::randn({kRows, cols}, gen);
  int64_t start = 0;
  for (size_t g = 0; g < kSplits.size(); ++g) {
    x.narrow(0, start, kSplits[g]).mul_(factors[g]);
    start += kSplits[g];
  }
  return x.to(kCudaBf16);
}

// Inputs of 2^0, -, 2^-8 and 2^9 per split: a cast with scale 1 (a delayed scale never updated)
// saturates the last split at 448; output gradients of 0.2 · (2^0, -, 2^6, 2^-6).
inline torch::Tensor make_input(uint64_t seed = 1) {
  return split_scaled(kIn, {1.0, 1.0, std::pow(2.0, -8), std::pow(2.0, 9)}, seed);
}
inline torch::Tensor make_grad(int64_t cols = kOut, uint64_t seed = 2) {
  return split_scaled(cols, {0.2, 0.2, 0.2 * 64, 0.2 / 64}, seed);
}

inline GroupedLinearOptions layer_options(int64_t history = 0) {
  return GroupedLinearOptions(kGroups, kIn, kOut)
      .params_dtype(torch::kBFloat16)
      .device(torch::kCUDA)
      .fp8_amax_history_len(history);
}

// Seeded, with random biases (so that a lost bias shows).
inline GroupedLinear make_layer(GroupedLinearOptions options) {
  torch::manual_seed(7);
  GroupedLinear m(options);
  torch::NoGradGuard no_grad;
  for (torch::Tensor b : m->expert_biases()) b.uniform_(-0.5, 0.5);
  return m;
}

struct Grads {
  torch::Tensor y, dx;
  std::vector<torch::Tensor> dw, db;
};

inline std::vector<torch::Tensor> grads_of(torch::nn::Module& m, const std::string& name,
                                           int64_t n) {
  auto params = m.named_parameters();
  std::vector<torch::Tensor> grads;
  for (int64_t g = 0; g < n; ++g) {
    const torch::Tensor grad = params[name + std::to_string(g)].grad();
    grads.push_back(grad.defined() ? grad.clone() : grad);
  }
  return grads;
}

// forward under `recipe` (none: no guard), backward outside the guard, as a training loop does.
inline Grads run_layer(GroupedLinear& m, const torch::Tensor& x, const torch::Tensor& dy,
                       const MaybeRecipe& recipe, std::optional<bool> first = std::nullopt) {
  m->zero_grad();
  const torch::Tensor input = x.detach().requires_grad_(true);
  torch::Tensor y;
  {
    const auto guard = autocast_for(recipe);
    y = m(input, kSplits, first);
  }
  y.backward(dy);
  Grads r;
  r.y = y.detach();
  r.dx = input.grad();
  if (!m->options.delay_wgrad_compute()) r.dw = grads_of(*m, "weight", kGroups);
  r.db = grads_of(*m, "bias", kGroups);
  return r;
}

inline double relative_error(const torch::Tensor& a, const torch::Tensor& e) {
  return ((a - e).norm() / e.norm()).item<double>();
}

// FP8 vs bf16 (file comment): relative Frobenius error <= bound, and per element
// |a - e| <= 0.125·|e| + rms_share·rms(e). An all-zero expectation (an empty expert's gradient)
// must be matched exactly.
inline void check_fp8_close(const torch::Tensor& actual, const torch::Tensor& expected,
                            double bound, const std::string& what, double rms_share = 0.5) {
  INFO(what);
  REQUIRE(actual.defined());
  REQUIRE(expected.defined());
  REQUIRE(actual.sizes() == expected.sizes());
  const torch::Tensor a = actual.detach().to(torch::kCPU, torch::kFloat64);
  const torch::Tensor e = expected.detach().to(torch::kCPU, torch::kFloat64);
  REQUIRE_FALSE(a.isnan().any().item<bool>());
  if (a.numel() == 0) return;
  const double norm = e.norm().item<double>();
  if (norm == 0.0) {
    CHECK(a.abs().max().item<double>() == 0.0);
    return;
  }
  const double rel = relative_error(a, e);
  INFO("relative Frobenius error " << rel << " (bound " << bound << ")");
  CHECK(rel <= bound);
  // Per element: e4m3's 0.125 relative step, plus a share of the split's rms for elements near 0.
  const double rms = norm / std::sqrt(static_cast<double>(e.numel()));
  check_close(a, e, {0.125, rms_share * rms}, "elementwise, split rms " + std::to_string(rms));
}

// Row-grouped tensors (output, input gradient) split by split.
inline void check_rows_close(const torch::Tensor& actual, const torch::Tensor& expected,
                             double bound, const std::string& what, double rms_share = 0.5) {
  REQUIRE(actual.size(0) == kRows);
  int64_t start = 0;
  for (size_t g = 0; g < kSplits.size(); ++g) {
    check_fp8_close(actual.narrow(0, start, kSplits[g]), expected.narrow(0, start, kSplits[g]),
                    bound, what + " rows of split " + std::to_string(g), rms_share);
    start += kSplits[g];
  }
}

inline void check_experts_close(const std::vector<torch::Tensor>& actual,
                                const std::vector<torch::Tensor>& expected, double bound,
                                const std::string& what, double rms_share = 0.5) {
  REQUIRE(actual.size() == expected.size());
  for (size_t g = 0; g < actual.size(); ++g) {
    check_fp8_close(actual[g], expected[g], bound, what + " of expert " + std::to_string(g),
                    rms_share);
  }
}

struct RecipeCase {
  const char* name;
  fp8::Recipe recipe;
  bool hybrid;  // e5m2 gradients
};

inline RecipeCase recipe_case(int index) {
  switch (index) {
    case 0:
      return {"DelayedScaling (hybrid)", fp8::DelayedScaling().amax_history_len(kHistory), true};
    case 1:
      return {"CurrentScaling (hybrid)", fp8::CurrentScaling(), true};
    case 2:
      return {"BlockScaling (e4m3; 1x128 input and grad, 128x128 weight)", fp8::BlockScaling(),
              false};
    case 3:
      return {"CurrentScaling (hybrid; split accumulation in fprop only)",
              fp8::CurrentScaling()
                  .fprop_split_accumulator(true)
                  .dgrad_split_accumulator(false)
                  .wgrad_split_accumulator(false),
              true};
    default:
      return {
          "BlockScaling (hybrid; all 1x128)",
          fp8::BlockScaling().format(fp8::Format::kHybrid).weight_block(fp8::BlockShape::k1x128),
          true};
  }
}

inline bool is_delayed(const fp8::Recipe& recipe) {
  return std::holds_alternative<fp8::DelayedScaling>(recipe);
}

// The amax history that a recipe's layers need: only delayed scaling keeps one.
inline int64_t history_for(const fp8::Recipe& recipe) { return is_delayed(recipe) ? kHistory : 0; }

// Both delayed-scaling updates (forward, then backward) of the `states` FP8 states in `model`.
inline void update_delayed(torch::nn::Module& model, const fp8::Recipe& recipe, int64_t states) {
  const auto& delayed = std::get<fp8::DelayedScaling>(recipe);
  CHECK(fp8::update_delayed_scaling(model, delayed, fp8::Pass::kForward) == states);
  CHECK(fp8::update_delayed_scaling(model, delayed, fp8::Pass::kBackward) == states);
}

// Delayed scaling's first step casts with scale 1, which saturates split 3. A calibration step
// and both updates make the next step's scales fp8_max over this data's amaxes (its delayed
// weight gradients run and are discarded). Other recipes: nothing.
inline void calibrate(GroupedLinear& m, const torch::Tensor& x, const torch::Tensor& dy,
                      const fp8::Recipe& recipe) {
  if (!is_delayed(recipe)) return;
  run_layer(m, x, dy, recipe, true);
  if (m->options.delay_wgrad_compute()) m->backward_dw();
  update_delayed(*m, recipe, 1);
}

// Two layers that ran the same steps under delayed scaling recorded the same amaxes and hold
// the same scales, role by role.
inline void check_same_delayed_state(GroupedLinear& a, GroupedLinear& b) {
  for (TensorRole role : {TensorRole::kInput, TensorRole::kWeight, TensorRole::kGradOutput}) {
    INFO(fp8::role_name(role));
    const fp8::DelayedScalingTensors& ta = a->fp8_state()->tensors(role);
    const fp8::DelayedScalingTensors& tb = b->fp8_state()->tensors(role);
    CHECK(torch::equal(ta.amax_history, tb.amax_history));
    CHECK(torch::equal(ta.scale, tb.scale));
  }
}

// FP8 ran: quantization noise (~0.04) is far above bf16's (~0.004).
inline void check_not_bf16(const torch::Tensor& fp8_result, const torch::Tensor& bf16_result) {
  CHECK(relative_error(fp8_result.to(torch::kFloat), bf16_result.to(torch::kFloat)) > 0.01);
}

}  // namespace torchmoe::test::fp8_modules
