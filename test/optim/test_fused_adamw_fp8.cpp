// FusedAdamW writing a GroupedLinear's FP8 weights with each step (set_fp8_weights): the copies'
// bytes against an e4m3 cast written from the format's definition (CPU) and against the
// split-quantize kernel's cast of the new masters (CUDA), the amax and scale_inv it records, the
// masters and moments against the plain step, and the layer's forwards: they read the copies
// while the weights are unchanged, and quantize the weights again once a weight moves. Errors.
//
// Axes: the layer's weight layout (one [G, out, in] parameter or G separate ones); shapes whose
// rows and columns are not multiples of the kernel's 64×64 tiles; per-expert scales that put
// values in e4m3's subnormal range and near its largest finite value.

#include <torchmoe/fp8/autocast.h>
#include <torchmoe/fp8/recipe.h>
#include <torchmoe/fp8/state.h>
#include <torchmoe/modules/grouped_linear.h>
#include <torchmoe/optim/fused_adamw.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "test_utils.h"
#include "torchmoe/ops/quantize.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;
using torchmoe::GroupedLinear;
using torchmoe::GroupedLinearOptions;
using torchmoe::optim::FusedAdamW;
using torchmoe::optim::FusedAdamWOptions;
namespace fp8 = torchmoe::fp8;

namespace {

constexpr int64_t kGroups = 3, kIn = 80, kOut = 112, kHistory = 2;

// e4m3 (the "fn" variant) from its definition: a sign, 4 exponent bits with bias 7 (0: subnormal),
// 3 mantissa bits; S.1111.111 is NaN, so the largest finite magnitude is 448.
double e4m3_value(int code) {
  const int e = (code >> 3) & 15, m = code & 7;
  const double magnitude =
      e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (code & 0x80) != 0 ? -magnitude : magnitude;
}

// The saturating round-to-nearest-even cast: the nearest finite code of x's sign, ties to the
// even mantissa (NaN inputs are not used here).
uint8_t e4m3_code(float x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  int best = sign;
  double best_distance = std::numeric_limits<double>::infinity();
  for (int magnitude = 0; magnitude < 0x7f; ++magnitude) {
    const double distance = std::fabs(e4m3_value(sign | magnitude) - static_cast<double>(x));
    if (distance < best_distance || (distance == best_distance && (magnitude & 1) == 0)) {
      best = sign | magnitude;
      best_distance = distance;
    }
  }
  return static_cast<uint8_t>(best);
}

struct Setup {
  GroupedLinear layer{nullptr};
  std::vector<torch::Tensor> masters;
};

// A bf16 layer with FP8 state, its fp32 masters (the weights' values) and per-expert weight
// scales of 64, 0.25 and 8: with weights of ±0.11 at most, the first expert's products reach 7,
// the second's 0.03 (e4m3 subnormals start below 0.016).
Setup make_layer(const torch::Device& device, bool single, int64_t in = kIn) {
  torch::manual_seed(3);
  Setup s;
  s.layer = GroupedLinear(GroupedLinearOptions(kGroups, in, kOut)
                              .params_dtype(torch::kBFloat16)
                              .device(device)
                              .bias(false)
                              .single_grouped_weight(single)
                              .fp8_amax_history_len(kHistory));
  for (const torch::Tensor& w : s.layer->weight_parameters()) {
    s.masters.push_back(w.detach().to(torch::kFloat32).requires_grad_(true));
  }
  const torch::NoGradGuard no_grad;
  s.layer->fp8_state()
      ->tensors(fp8::TensorRole::kWeight)
      .scale.copy_(torch::tensor({64.0f, 0.25f, 8.0f}));
  return s;
}

FusedAdamW make_optimizer(const Setup& s, double lr = 1e-2) {
  FusedAdamW adamw(s.masters, FusedAdamWOptions(lr).weight_decay(0.1));
  for (size_t i = 0; i < s.masters.size(); ++i) {
    adamw.set_model_copy(s.masters[i], s.layer->weight_parameters()[i]);
  }
  adamw.set_fp8_weights(s.layer, s.masters);
  return adamw;
}

void set_grads(const std::vector<torch::Tensor>& masters, uint64_t seed) {
  torch::manual_seed(seed);
  for (const torch::Tensor& m : masters) m.mutable_grad() = torch::randn_like(m) * 0.1;
}

// The masters as [G, out, in] on the CPU.
torch::Tensor stacked_masters(const std::vector<torch::Tensor>& masters) {
  const torch::Tensor all = masters.size() == 1 ? masters[0] : torch::stack(masters);
  return all.detach().cpu();
}

}  // namespace

TEST_CASE("FusedAdamW writes a GroupedLinear's FP8 weights as the e4m3 definition casts them",
          "[optim][fp8]") {
  const bool single = GENERATE(true, false);
  INFO("single_grouped_weight=" << single);
  Setup s = make_layer(torch::kCPU, single);
  FusedAdamW adamw = make_optimizer(s);
  const fp8::DelayedScalingTensors& state = s.layer->fp8_state()->tensors(fp8::TensorRole::kWeight);
  torch::Tensor previous_amax = torch::zeros({kGroups});
  for (int step = 0; step < 2; ++step) {
    set_grads(s.masters, 10 + step);
    adamw.step();
    const torch::Tensor p = stacked_masters(s.masters);
    const torchmoe::ops::SplitQuantized& q = s.layer->optimizer_fp8_weights();
    const torch::Tensor rowwise = q.data.view(torch::kUInt8).view({kGroups, kOut, kIn});
    const torch::Tensor columnwise =
        q.columnwise_data.view(torch::kUInt8).view({kGroups, kIn, kOut});
    const float scales[kGroups] = {64.0f, 0.25f, 8.0f};
    int64_t mismatches = 0;
    for (int64_t g = 0; g < kGroups; ++g) {
      const torch::Tensor pg = p[g], rg = rowwise[g], cg = columnwise[g];
      const auto pa = pg.accessor<float, 2>();
      const auto ra = rg.accessor<uint8_t, 2>();
      const auto ca = cg.accessor<uint8_t, 2>();
      for (int64_t r = 0; r < kOut; ++r) {
        for (int64_t c = 0; c < kIn; ++c) {
          const uint8_t want = e4m3_code(pa[r][c] * scales[g]);
          mismatches += ra[r][c] != want;
          mismatches += ca[c][r] != want;
        }
      }
    }
    CHECK(mismatches == 0);
    // amax: this step's max |p| per expert, maxed into what the history row held (the first
    // step's values, as no update ran in between).
    const torch::Tensor amax = std::get<0>(p.abs().view({kGroups, -1}).max(1));
    CHECK(torch::equal(state.amax_history[0], torch::maximum(amax, previous_amax)));
    previous_amax = torch::maximum(amax, previous_amax);
    CHECK(torch::equal(q.scale_inv, 1.0f / state.scale));
    // The model copies are the masters rounded, as without FP8 copies.
    for (size_t i = 0; i < s.masters.size(); ++i) {
      CHECK(torch::equal(s.layer->weight_parameters()[i],
                         s.masters[i].detach().to(torch::kBFloat16)));
    }
  }
}

TEST_CASE("FusedAdamW::set_fp8_weights refuses layers and masters it cannot write",
          "[optim][fp8][errors]") {
  Setup s = make_layer(torch::kCPU, /*single=*/false);
  FusedAdamW adamw(s.masters, FusedAdamWOptions(1e-2));
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer, s.masters),
                      Contains("masters[0] must be the layer's weight parameter 0 or the master "
                               "whose model copy it is (set_model_copy first)"));
  for (size_t i = 0; i < s.masters.size(); ++i) {
    adamw.set_model_copy(s.masters[i], s.layer->weight_parameters()[i]);
  }
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer, {s.masters[0]}),
                      Contains("needs one master per weight parameter of the layer (3), got 1"));
  REQUIRE_THROWS_WITH(
      adamw.set_fp8_weights(s.layer, {s.masters[0], s.masters[1], torch::zeros({kOut, kIn})}),
      Contains("masters[2] is not one of the optimizer's parameters"));
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer, {s.masters[1], s.masters[0], s.masters[2]}),
                      Contains("masters[0] must be the layer's weight parameter 0"));
  adamw.set_fp8_weights(s.layer, s.masters);
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer, s.masters),
                      Contains("the layer already has its masters"));

  GroupedLinear no_state(GroupedLinearOptions(kGroups, kIn, kOut).bias(false));
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(no_state, no_state->weight_parameters()),
                      Contains("build the layer with fp8_amax_history_len > 0"));
  Setup narrow = make_layer(torch::kCPU, /*single=*/true, /*in=*/72);
  FusedAdamW narrow_adamw(narrow.masters);
  REQUIRE_THROWS_WITH(
      narrow_adamw.set_fp8_weights(narrow.layer, narrow.masters),
      Contains("the layer's in and out features must be multiples of 16 (FP8 GEMM operands), "
               "got 72 and 112"));
  // A float64 master is refused.
  Setup grouped = make_layer(torch::kCPU, /*single=*/true);
  const torch::Tensor wide = grouped.masters[0].detach().to(torch::kFloat64).requires_grad_(true);
  FusedAdamW wide_adamw({wide});
  REQUIRE_THROWS_WITH(wide_adamw.set_fp8_weights(grouped.layer, {wide}),
                      Contains("masters[0] must be float32 of shape [3, 112, 80], got Double"));
}

TEST_CASE("FusedAdamW on CUDA writes FP8 weights that the layer's forwards read",
          "[optim][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool single = GENERATE(true, false);
  INFO("single_grouped_weight=" << single);
  Setup s = make_layer(torch::kCUDA, single);
  // The same step without FP8 copies, on clones: the tiled kernel must update every element as
  // the plain one does.
  std::vector<torch::Tensor> plain_masters;
  for (const torch::Tensor& m : s.masters) {
    plain_masters.push_back(m.detach().clone().requires_grad_(true));
  }
  FusedAdamW adamw = make_optimizer(s);
  FusedAdamW plain(plain_masters, FusedAdamWOptions(1e-2).weight_decay(0.1));
  const fp8::DelayedScalingTensors& state = s.layer->fp8_state()->tensors(fp8::TensorRole::kWeight);
  for (int step = 0; step < 2; ++step) {
    set_grads(s.masters, 20 + step);
    for (size_t i = 0; i < s.masters.size(); ++i) {
      plain_masters[i].mutable_grad() = s.masters[i].grad().clone();
    }
    const torch::Tensor amax_before = state.amax_history[0].clone();
    adamw.step();
    plain.step();
    for (size_t i = 0; i < s.masters.size(); ++i) {
      CHECK(torch::equal(s.masters[i], plain_masters[i]));
      CHECK(torch::equal(s.layer->weight_parameters()[i],
                         s.masters[i].detach().to(torch::kBFloat16)));
    }
    // The split-quantize kernel's cast of the new masters with the same scales.
    const torch::Tensor p =
        s.masters.size() == 1 ? s.masters[0].detach() : torch::stack(s.masters).detach();
    torchmoe::ops::SplitQuantizeOptions options;
    options.scaling = torchmoe::ops::QuantizeScaling::kDelayed;
    const torchmoe::ops::SplitQuantized want = torchmoe::ops::quantize_weights(
        torchmoe::ops::GroupedTensors(std::vector<torch::Tensor>(p.unbind(0))), options,
        state.scale);
    const torchmoe::ops::SplitQuantized& q = s.layer->optimizer_fp8_weights();
    CHECK(torch::equal(q.data.view(torch::kUInt8), want.data.view(torch::kUInt8)));
    CHECK(torch::equal(q.columnwise_data.view(torch::kUInt8),
                       want.columnwise_data.view(torch::kUInt8)));
    CHECK(torch::equal(q.scale_inv, want.scale_inv));
    CHECK(torch::equal(state.amax_history[0], torch::maximum(amax_before, want.amax)));
  }

  // The layer's forwards. Masters left where they are (lr 0, no decay): the copies then hold what
  // a cast of the bf16 weights gives, so a forward and its input gradient are bit for bit the
  // cast's, and the copies must be read while the weights' version counters stand still.
  Setup t = make_layer(torch::kCUDA, single);
  FusedAdamW still = make_optimizer(t, /*lr=*/0.0);
  set_grads(t.masters, 30);
  still.step();
  const std::vector<int64_t> splits = {40, 0, 77};
  const torch::Tensor x =
      torch::randn({117, kIn}, torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA));
  const torch::Tensor dy = torch::randn({117, kOut}, x.options());
  const auto run = [&] {
    const torch::Tensor input = x.detach().requires_grad_(true);
    const fp8::Autocast guard(fp8::DelayedScaling().amax_history_len(kHistory));
    const torch::Tensor y = t.layer->forward(input, splits);
    y.backward(dy);
    return std::make_pair(y.detach(), input.grad());
  };
  const auto [y_copies, dx_copies] = run();
  {
    // Doubled through a tensor that shares the storage but not the version counter: the
    // forward still reads the copies.
    for (const torch::Tensor& w : t.layer->weight_parameters()) w.variable_data().mul_(2);
    const auto [y, dx] = run();
    CHECK(torch::equal(y, y_copies));
    CHECK(torch::equal(dx, dx_copies));
    for (const torch::Tensor& w : t.layer->weight_parameters()) w.variable_data().mul_(0.5);
  }
  {
    // An in-place change through the parameter moves its version counter: the forward casts
    // the bf16 weights, which hold the copies' values.
    const torch::NoGradGuard no_grad;
    t.layer->weight_parameters()[0].mul_(1);
  }
  const auto [y_cast, dx_cast] = run();
  CHECK(torch::equal(y_cast, y_copies));
  CHECK(torch::equal(dx_cast, dx_copies));
  {
    // ... and reads the weights' values from then on.
    const torch::NoGradGuard no_grad;
    for (const torch::Tensor& w : t.layer->weight_parameters()) w.mul_(2);
  }
  const torch::Tensor y_doubled = run().first;
  check_close(y_doubled, y_copies * 2, {0.1, 0.1}, "y with doubled weights");
}
