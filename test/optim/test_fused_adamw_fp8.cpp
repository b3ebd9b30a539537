// FusedAdamW writing a GroupedLinear's FP8 weights with each step (set_fp8_weights): the copies'
// bytes against an e4m3 cast written from the format's definition (CPU and CUDA) and against the
// split-quantize kernel's cast of the new masters (CUDA), the amax and scale_inv it records, the
// masters and moments against the plain step, and the layer's forwards: they read the copies
// while the weights are unchanged, and quantize the weights again once a weight moves or a step
// skips a master. Errors.
//
// Axes: the layer's weight layout (one [G, out, in] parameter or G separate ones, 20 of them on
// CUDA: two launches); shapes whose rows and columns are not multiples of the kernel's 64×64
// tiles; per-expert scales that put values in e4m3's subnormal range and past its largest finite
// value (saturated), changed between steps; a clipped step; a plain parameter in the same
// optimizer.

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
#include "torchmoe/ops/multi_tensor_adamw.h"
#include "torchmoe/ops/quantize.h"
#include "torchmoe/optim/fp8_weight_offers.h"

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

// Per-expert weight scales, cycled over the experts: with weights of ±0.11 at most, 64 takes
// them to 7, 0.25 to 0.03 (e4m3 subnormals start below 0.016), 8192 past 448 for |w| > 0.055
// (saturated).
std::vector<float> weight_scales(int64_t groups, float factor = 1.0f) {
  const float pattern[] = {64.0f, 0.25f, 8192.0f};
  std::vector<float> scales;
  for (int64_t g = 0; g < groups; ++g) scales.push_back(pattern[g % 3] * factor);
  return scales;
}

void set_weight_scales(const GroupedLinear& layer, const std::vector<float>& scales) {
  const torch::NoGradGuard no_grad;
  layer->fp8_state()->tensors(fp8::TensorRole::kWeight).scale.copy_(torch::tensor(scales));
}

// A bf16 layer with FP8 state and its fp32 masters (the weights' values).
Setup make_layer(const torch::Device& device, bool single, int64_t in = kIn,
                 int64_t groups = kGroups, bool from_optimizer = true) {
  torch::manual_seed(3);
  Setup s;
  s.layer = GroupedLinear(GroupedLinearOptions(groups, in, kOut)
                              .params_dtype(torch::kBFloat16)
                              .device(device)
                              .bias(false)
                              .single_grouped_weight(single)
                              .fp8_amax_history_len(kHistory)
                              .fp8_weights_from_optimizer(from_optimizer));
  for (const torch::Tensor& w : s.layer->weight_parameters()) {
    s.masters.push_back(w.detach().to(torch::kFloat32).requires_grad_(true));
  }
  set_weight_scales(s.layer, weight_scales(groups));
  return s;
}

FusedAdamW make_optimizer(Setup& s, double lr = 1e-2,
                          const std::vector<torch::Tensor>& extra = {}) {
  std::vector<torch::Tensor> params = s.masters;
  params.insert(params.end(), extra.begin(), extra.end());
  FusedAdamW adamw(params, FusedAdamWOptions(lr).weight_decay(0.1));
  for (size_t i = 0; i < s.masters.size(); ++i) {
    adamw.set_model_copy(s.masters[i], s.layer->weight_parameters()[i]);
  }
  adamw.set_fp8_weights(s.layer->fp8_weight_target(), s.masters);
  return adamw;
}

void set_grads(const std::vector<torch::Tensor>& params, uint64_t seed) {
  torch::manual_seed(seed);
  for (const torch::Tensor& p : params) p.mutable_grad() = torch::randn_like(p) * 0.1;
}

// The masters as [G, out, in] on the CPU.
torch::Tensor stacked_masters(const std::vector<torch::Tensor>& masters) {
  const torch::Tensor all = masters.size() == 1 ? masters[0] : torch::stack(masters);
  return all.detach().cpu();
}

// Bytes of the layer's optimizer-written copies that differ from e4m3_code(p · scale), both
// copies counted.
int64_t definition_mismatches(Setup& s, const std::vector<float>& scales) {
  const torch::Tensor p = stacked_masters(s.masters);
  const int64_t groups = p.size(0), out = p.size(1), in = p.size(2);
  const torchmoe::optim::Fp8WeightCopies q = s.layer->fp8_weight_target().copies();
  const torch::Tensor rowwise = q.rowwise.view(torch::kUInt8).cpu().view({groups, out, in});
  const torch::Tensor columnwise = q.columnwise.view(torch::kUInt8).cpu().view({groups, in, out});
  int64_t mismatches = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const torch::Tensor pg = p[g], rg = rowwise[g], cg = columnwise[g];
    const auto pa = pg.accessor<float, 2>();
    const auto ra = rg.accessor<uint8_t, 2>();
    const auto ca = cg.accessor<uint8_t, 2>();
    for (int64_t r = 0; r < out; ++r) {
      for (int64_t c = 0; c < in; ++c) {
        const uint8_t want = e4m3_code(pa[r][c] * scales[g]);
        mismatches += ra[r][c] != want;
        mismatches += ca[c][r] != want;
      }
    }
  }
  return mismatches;
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
    // The second step casts with other scales (as after a delayed-scaling update).
    const std::vector<float> scales = weight_scales(kGroups, step == 0 ? 1.0f : 0.5f);
    set_weight_scales(s.layer, scales);
    set_grads(s.masters, 10 + step);
    adamw.step();
    CHECK(definition_mismatches(s, scales) == 0);
    // amax: this step's max |p| per expert, maxed into what the history row held (the first
    // step's values, as no update ran in between).
    const torch::Tensor amax =
        std::get<0>(stacked_masters(s.masters).abs().view({kGroups, -1}).max(1));
    CHECK(torch::equal(state.amax_history[0], torch::maximum(amax, previous_amax)));
    previous_amax = torch::maximum(amax, previous_amax);
    CHECK(torch::equal(s.layer->fp8_weight_target().copies().scale_inv, 1.0f / state.scale));
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
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(torchmoe::optim::Fp8WeightTarget(), s.masters),
                      Contains("target must be a layer's (e.g. "
                               "GroupedLinearImpl::fp8_weight_target()), got one without its layer "
                               "or calls"));
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer->fp8_weight_target(), s.masters),
                      Contains("masters[0] must be the layer's weight parameter 0 or the master "
                               "whose model copy it is (set_model_copy first)"));
  for (size_t i = 0; i < s.masters.size(); ++i) {
    adamw.set_model_copy(s.masters[i], s.layer->weight_parameters()[i]);
  }
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer->fp8_weight_target(), {s.masters[0]}),
                      Contains("needs one master per weight parameter of the layer (3), got 1"));
  REQUIRE_THROWS_WITH(
      adamw.set_fp8_weights(s.layer->fp8_weight_target(),
                            {s.masters[0], s.masters[1], torch::zeros({kOut, kIn})}),
      Contains("masters[2] is not one of the optimizer's parameters"));
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer->fp8_weight_target(),
                                            {s.masters[1], s.masters[0], s.masters[2]}),
                      Contains("masters[0] must be the layer's weight parameter 0"));
  adamw.set_fp8_weights(s.layer->fp8_weight_target(), s.masters);
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(s.layer->fp8_weight_target(), s.masters),
                      Contains("the layer already has its masters"));
  Setup other = make_layer(torch::kCPU, /*single=*/false);
  REQUIRE_THROWS_WITH(adamw.set_fp8_weights(other.layer->fp8_weight_target(), s.masters),
                      Contains("masters[0] already writes another layer's FP8 weights"));

  GroupedLinear no_state(GroupedLinearOptions(kGroups, kIn, kOut).bias(false));
  REQUIRE_THROWS_WITH(no_state->fp8_weight_target(),
                      Contains("GroupedLinear::fp8_weight_target: the copies are scaled with the "
                               "layer's delayed-scaling state, so the layer must be built with "
                               "fp8_amax_history_len > 0, got 0"));
  // A const layer hands out its target; a target says it was written only after its copies were.
  Setup fresh = make_layer(torch::kCPU, /*single=*/false);
  const GroupedLinear& as_const = fresh.layer;
  REQUIRE_THROWS_WITH(as_const->fp8_weight_target().written(),
                      Contains("written() before the copies were handed out"));
  Setup narrow = make_layer(torch::kCPU, /*single=*/true, /*in=*/72);
  REQUIRE_THROWS_WITH(
      narrow.layer->fp8_weight_target(),
      Contains("the layer's in and out features must be multiples of 16 (FP8 GEMM operands), "
               "got 72 and 112"));
  // A float64 master is refused.
  Setup grouped = make_layer(torch::kCPU, /*single=*/true);
  const torch::Tensor wide = grouped.masters[0].detach().to(torch::kFloat64).requires_grad_(true);
  FusedAdamW wide_adamw({wide});
  REQUIRE_THROWS_WITH(wide_adamw.set_fp8_weights(grouped.layer->fp8_weight_target(), {wide}),
                      Contains("masters[0] must be float32 of shape [3, 112, 80], got Double"));

  // A master whose model copy is no longer the layer's weight.
  adamw.set_model_copy(s.masters[1], torch::zeros({kOut, kIn}, torch::kBFloat16));
  set_grads(s.masters, 1);
  REQUIRE_THROWS_WITH(adamw.step(),
                      Contains("the master of the layer's weight parameter 1 (set_fp8_weights) no "
                               "longer writes that parameter"));
}

TEST_CASE("ops::adamw_step refuses malformed FP8 copies", "[optim][fp8][errors]") {
  namespace ops = torchmoe::ops;
  const torch::Tensor p = torch::randn({2, 32, 16});
  ops::AdamWTensors t;
  t.params = {p};
  t.grads = {torch::randn_like(p)};
  t.exp_avgs = {torch::zeros_like(p)};
  t.exp_avg_sqs = {torch::zeros_like(p)};
  t.models = {torch::Tensor()};
  const auto e4m3 = torch::TensorOptions(torch::kFloat8_e4m3fn);
  ops::AdamWFp8Copy copy{torch::empty({64, 16}, e4m3), torch::empty({1024}, e4m3), torch::ones({2}),
                         torch::empty({2}), torch::zeros({2})};
  t.fp8_copies = {copy};
  ops::adamw_step(t, {}, {});  // well formed

  t.fp8_copies[0].rowwise = torch::empty({64, 16}, torch::kUInt8);
  REQUIRE_THROWS_WITH(ops::adamw_step(t, {}, {}),
                      Contains("fp8_copies[0].rowwise must be a contiguous Float8_e4m3fn [64, 16] "
                               "tensor on cpu, got a contiguous Byte [64, 16] tensor on cpu"));
  t.fp8_copies[0] = copy;
  t.fp8_copies[0].columnwise = torch::Tensor();
  REQUIRE_THROWS_WITH(ops::adamw_step(t, {}, {}),
                      Contains("fp8_copies[0].columnwise must be defined"));
  t.fp8_copies[0] = copy;
  t.fp8_copies[0].scale = torch::ones({3});
  REQUIRE_THROWS_WITH(ops::adamw_step(t, {}, {}),
                      Contains("fp8_copies[0].scale must be a contiguous Float [2] tensor on cpu, "
                               "got a contiguous Float [3] tensor on cpu"));
  t.fp8_copies = {copy, copy};
  REQUIRE_THROWS_WITH(ops::adamw_step(t, {}, {}),
                      Contains("fp8_copies must be empty or have one entry per parameter (1), "
                               "got 2"));
  t.fp8_copies = {copy};
  t.params = {torch::randn({2, 32, 12})};
  t.grads = {torch::randn({2, 32, 12})};
  t.exp_avgs = {torch::zeros({2, 32, 12})};
  t.exp_avg_sqs = {torch::zeros({2, 32, 12})};
  REQUIRE_THROWS_WITH(ops::adamw_step(t, {}, {}),
                      Contains("params[0] has an FP8 copy, so its rows and columns must be "
                               "multiples of 16 (FP8 GEMM operands), got [2, 32, 12]"));
}

TEST_CASE("FusedAdamW on CUDA writes FP8 weights that the layer's forwards read",
          "[optim][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool single = GENERATE(true, false);
  // Separate weights: 20 masters, two launches of at most 16.
  const int64_t groups = single ? kGroups : 20;
  INFO("single_grouped_weight=" << single << ", experts=" << groups);
  Setup s = make_layer(torch::kCUDA, single, kIn, groups);
  // The same steps without FP8 copies, on clones, and a plain parameter in both: the tiled
  // kernel must update every element as the flat one does, clipped or not.
  std::vector<torch::Tensor> plain_masters;
  for (const torch::Tensor& m : s.masters) {
    plain_masters.push_back(m.detach().clone().requires_grad_(true));
  }
  const torch::Tensor vector =
      torch::randn({1001}, torch::TensorOptions(torch::kCUDA)).requires_grad_(true);
  const torch::Tensor plain_vector = vector.detach().clone().requires_grad_(true);
  FusedAdamW adamw = make_optimizer(s, 1e-2, {vector});
  plain_masters.push_back(plain_vector);
  FusedAdamW plain(plain_masters, FusedAdamWOptions(1e-2).weight_decay(0.1));
  plain_masters.pop_back();
  const fp8::DelayedScalingTensors& state = s.layer->fp8_state()->tensors(fp8::TensorRole::kWeight);
  for (int step = 0; step < 2; ++step) {
    const std::vector<float> scales = weight_scales(groups, step == 0 ? 1.0f : 0.5f);
    set_weight_scales(s.layer, scales);
    std::vector<torch::Tensor> all = s.masters;
    all.push_back(vector);
    set_grads(all, 20 + step);
    for (size_t i = 0; i < s.masters.size(); ++i) {
      plain_masters[i].mutable_grad() = s.masters[i].grad().clone();
    }
    plain_vector.mutable_grad() = vector.grad().clone();
    if (step == 1) {  // a clipped step: every gradient scaled by a device coefficient
      adamw.clip_grad_norm(0.5);
      plain.clip_grad_norm(0.5);
    }
    const torch::Tensor amax_before = state.amax_history[0].clone();
    adamw.step();
    plain.step();
    CHECK(torch::equal(vector, plain_vector));
    for (size_t i = 0; i < s.masters.size(); ++i) {
      CHECK(torch::equal(s.masters[i], plain_masters[i]));
      CHECK(torch::equal(s.layer->weight_parameters()[i],
                         s.masters[i].detach().to(torch::kBFloat16)));
    }
    CHECK(definition_mismatches(s, scales) == 0);
    // The split-quantize kernel's cast of the new masters with the same scales.
    const torch::Tensor p =
        s.masters.size() == 1 ? s.masters[0].detach() : torch::stack(s.masters).detach();
    torchmoe::ops::SplitQuantizeOptions options;
    options.scaling = torchmoe::ops::QuantizeScaling::kDelayed;
    const torchmoe::ops::SplitQuantized want = torchmoe::ops::quantize_weights(
        torchmoe::ops::GroupedTensors(std::vector<torch::Tensor>(p.unbind(0))), options,
        state.scale);
    const torchmoe::optim::Fp8WeightCopies q = s.layer->fp8_weight_target().copies();
    CHECK(torch::equal(q.rowwise.view(torch::kUInt8), want.data.view(torch::kUInt8)));
    CHECK(torch::equal(q.columnwise.view(torch::kUInt8), want.columnwise_data.view(torch::kUInt8)));
    CHECK(torch::equal(q.scale_inv, want.scale_inv));
    CHECK(torch::equal(state.amax_history[0], torch::maximum(amax_before, want.amax)));
  }

  // The layer's forwards. Masters left where they are (lr 0, no decay): the copies then hold what
  // a cast of the bf16 weights gives, so a forward and its input gradient are bit for bit the
  // cast's, and the copies must be read while the weights' version counters stand still.
  Setup t = make_layer(torch::kCUDA, single, kIn, groups);
  set_weight_scales(t.layer, std::vector<float>(groups, 64.0f));  // nothing saturates
  FusedAdamW still = make_optimizer(t, /*lr=*/0.0);
  set_grads(t.masters, 30);
  still.step();
  std::vector<int64_t> splits(groups, 0);
  splits[0] = 40;
  splits[groups - 1] = 77;
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
  // Doubles the weights through tensors that share their storage but not their version
  // counters: a forward that reads the copies does not see it.
  const auto scale_unseen = [&](double factor) {
    for (const torch::Tensor& w : t.layer->weight_parameters()) w.variable_data().mul_(factor);
  };
  const auto [y_copies, dx_copies] = run();
  scale_unseen(2);
  {
    const auto [y, dx] = run();
    CHECK(torch::equal(y, y_copies));
    CHECK(torch::equal(dx, dx_copies));
  }
  scale_unseen(0.5);
  {
    // An in-place change through the parameter moves its version counter: the forward casts
    // the bf16 weights, which hold the copies' values.
    const torch::NoGradGuard no_grad;
    t.layer->weight_parameters()[0].mul_(1);
  }
  const auto [y_cast, dx_cast] = run();
  CHECK(torch::equal(y_cast, y_copies));
  CHECK(torch::equal(dx_cast, dx_copies));
  if (!single) {
    // A step that skips a master (no gradient) does not make the copies current again.
    set_grads(t.masters, 31);
    t.masters[0].mutable_grad() = torch::Tensor();
    still.step();
    scale_unseen(2);
    check_close(run().first, y_copies * 2, {0.1, 0.1}, "y after a step that skipped a master");
    scale_unseen(0.5);
  }
  // A full step makes them current again (a change the counters do not see is not read); an
  // in-place doubling is then read by the next cast.
  set_grads(t.masters, 32);
  still.step();
  scale_unseen(2);
  CHECK(torch::equal(run().first, y_copies));
  scale_unseen(0.5);
  {
    const torch::NoGradGuard no_grad;
    for (const torch::Tensor& w : t.layer->weight_parameters()) w.mul_(2);
  }
  check_close(run().first, y_copies * 2, {0.1, 0.1}, "y with doubled weights");
}

TEST_CASE("FP8 weights written for an fp32 layer's own weights go stale under another optimizer",
          "[optim][fp8][cuda]") {
  // The masters are the layer's weights (no model copies). A second optimizer that steps them
  // without writing the FP8 copies moves their version counters, so the layer casts them again.
  TORCHMOE_REQUIRE_CUDA();
  torch::manual_seed(5);
  GroupedLinear layer(GroupedLinearOptions(kGroups, kIn, kOut)
                          .device(torch::kCUDA)
                          .bias(false)
                          .single_grouped_weight(true)
                          .fp8_amax_history_len(kHistory));
  const std::vector<torch::Tensor> weights = layer->weight_parameters();
  FusedAdamW writer(weights, FusedAdamWOptions(1e-2));
  writer.set_fp8_weights(layer->fp8_weight_target(), weights);
  const std::vector<int64_t> splits = {40, 0, 37};
  const torch::Tensor x = torch::randn({77, kIn}, torch::TensorOptions(torch::kCUDA));
  const auto forward = [&] {
    const fp8::Autocast guard(fp8::DelayedScaling().amax_history_len(kHistory));
    return layer->forward(x, splits).detach();
  };
  set_grads(weights, 40);
  writer.step();
  const torch::Tensor y_written = forward();
  FusedAdamW other(weights, FusedAdamWOptions(0.5));
  set_grads(weights, 41);
  other.step();  // large steps: the weights move far from what the copies hold
  const torch::Tensor y_moved = forward();
  // Splits 0 and 2 against their experts' moved weights in float64: the cast of the moved
  // weights is within e4m3's error (a few % of the norm), the copies' output (the weights before
  // the second step, each moved by ~0.5 where they were ~0.1) is not.
  const torch::Tensor w = weights[0].detach().to(torch::kFloat64);
  const torch::Tensor x64 = x.to(torch::kFloat64);
  const torch::Tensor y_ref = torch::cat(
      {torch::linear(x64.narrow(0, 0, 40), w[0]), torch::linear(x64.narrow(0, 40, 37), w[2])});
  const auto relative = [&](const torch::Tensor& y) {
    return ((y.to(torch::kFloat64) - y_ref).norm() / y_ref.norm()).item<double>();
  };
  CHECK(relative(y_moved) < 0.1);
  CHECK(relative(y_written) > 0.5);
}

TEST_CASE("FusedAdamW takes the FP8 weights a layer offers, one optimizer at a time",
          "[optim][fp8]") {
  // A GroupedLinear offers its weights at its first forward under DelayedScaling (CUDA only,
  // below); here the offer is made as that forward makes it.
  Setup s = make_layer(torch::kCPU, /*single=*/false);
  const std::weak_ptr<const torch::nn::Module> alive = s.layer.ptr();
  const auto offer = [&] {
    torchmoe::optim::detail::offer_fp8_weights(s.layer.get(), alive, [alive] {
      const auto layer = std::dynamic_pointer_cast<const torchmoe::GroupedLinearImpl>(alive.lock());
      return layer->fp8_weight_target();
    });
  };
  const std::vector<float> scales = weight_scales(kGroups);
  const torch::Tensor amax_row =
      s.layer->fp8_state()->tensors(fp8::TensorRole::kWeight).amax_history[0];
  // More optimizers of the same weights through other masters (k times the values), so that the
  // copies say which optimizer wrote them.
  const auto other_masters = [&](double k) {
    Setup other{s.layer, {}};
    for (const torch::Tensor& m : s.masters) {
      other.masters.push_back((m.detach() * k).requires_grad_(true));
    }
    return other;
  };
  const auto optimizer_of = [&](const Setup& o) {
    auto adamw = std::make_unique<FusedAdamW>(o.masters, FusedAdamWOptions(1e-2));
    for (size_t i = 0; i < o.masters.size(); ++i) {
      adamw->set_model_copy(o.masters[i], s.layer->weight_parameters()[i]);
    }
    return adamw;
  };
  const auto step = [&](FusedAdamW& adamw, const Setup& o, uint64_t seed) {
    set_grads(o.masters, seed);
    adamw.step();
  };
  Setup second = other_masters(2), third = other_masters(3), fourth = other_masters(4);
  auto a = optimizer_of(s), b = optimizer_of(second), c = optimizer_of(third),
       d = optimizer_of(fourth);
  step(*a, s, 50);  // nothing offered yet: no copies written, no amax recorded
  CHECK(torch::equal(amax_row, torch::zeros_like(amax_row)));
  offer();
  step(*a, s, 51);  // takes the offer
  CHECK(definition_mismatches(s, scales) == 0);
  CHECK(amax_row.gt(0).all().item<bool>());
  step(*b, second, 52);  // the layer is a's
  CHECK(definition_mismatches(s, scales) == 0);
  // A master of a's re-pointed at another tensor: a lets the layer go (its step does not throw)
  // and b takes it at its next step.
  a->set_model_copy(s.masters[0], torch::zeros({kOut, kIn}, torch::kBFloat16));
  REQUIRE_NOTHROW(step(*a, s, 53));
  step(*b, second, 54);
  CHECK(definition_mismatches(second, scales) == 0);
  // A refused call by hand changes nothing: b still writes the layer it took from the offer.
  REQUIRE_THROWS_WITH(b->set_fp8_weights(s.layer->fp8_weight_target(), {second.masters[0]}),
                      Contains("needs one master per weight parameter of the layer (3), got 1"));
  step(*b, second, 59);
  CHECK(definition_mismatches(second, scales) == 0);
  // Given by hand, the layer moves from the optimizer that took it from the offer; that one lets
  // it go at its next step, and no other can be given it by hand.
  c->set_fp8_weights(s.layer->fp8_weight_target(), third.masters);
  step(*c, third, 55);
  step(*b, second, 56);
  CHECK(definition_mismatches(third, scales) == 0);
  REQUIRE_THROWS_WITH(d->set_fp8_weights(s.layer->fp8_weight_target(), fourth.masters),
                      Contains("FusedAdamW::set_fp8_weights: another FusedAdamW was given the "
                               "layer's FP8 weights by hand"));
  // With c gone, the offer stands again: d, which has looked at the offers before, takes it.
  step(*d, fourth, 57);
  CHECK(definition_mismatches(third, scales) == 0);
  c.reset();
  step(*d, fourth, 58);
  CHECK(definition_mismatches(fourth, scales) == 0);
}

TEST_CASE("A GroupedLinear's forward offers its FP8 weights to the FusedAdamW that steps them",
          "[optim][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool from_optimizer = GENERATE(true, false);
  INFO("fp8_weights_from_optimizer=" << from_optimizer);
  Setup t = make_layer(torch::kCUDA, /*single=*/true, kIn, kGroups, from_optimizer);
  set_weight_scales(t.layer, std::vector<float>(kGroups, 64.0f));  // nothing saturates
  // lr 0: the copies hold what a cast of the bf16 weights gives, so reading them is bit for bit
  // the cast's output.
  FusedAdamW adamw(t.masters, FusedAdamWOptions(0.0));
  adamw.set_model_copy(t.masters[0], t.layer->weight_parameters()[0]);
  const std::vector<int64_t> splits = {40, 0, 77};
  const torch::Tensor x =
      torch::randn({117, kIn}, torch::TensorOptions(torch::kBFloat16).device(torch::kCUDA));
  const auto forward = [&] {
    const torch::NoGradGuard no_grad;
    const fp8::Autocast guard(fp8::DelayedScaling().amax_history_len(kHistory));
    return t.layer->forward(x, splits);
  };
  const torch::Tensor y_cast = forward();  // casts the weights, and offers them
  set_grads(t.masters, 60);
  adamw.step();
  // Doubled through a tensor that shares the weight's storage but not its version counter: only
  // a forward that casts sees it.
  t.layer->weight_parameters()[0].variable_data().mul_(2);
  const torch::Tensor y = forward();
  if (from_optimizer) {
    CHECK(torch::equal(y, y_cast));
  } else {
    check_close(y, y_cast * 2, {0.1, 0.1}, "y of the doubled weights");
  }
  if (!from_optimizer) return;
  // A master 4 bytes past a 16-byte boundary: the FP8 kernel cannot write its copies, and the
  // step neither throws nor makes stale copies current (the forward casts the doubled weights).
  Setup u = make_layer(torch::kCUDA, /*single=*/true);
  set_weight_scales(u.layer, std::vector<float>(kGroups, 64.0f));
  const torch::Tensor weight = u.layer->weight_parameters()[0];
  const torch::Tensor odd =
      torch::empty({weight.numel() + 1}, weight.options().dtype(torch::kFloat32))
          .narrow(0, 1, weight.numel())
          .view(weight.sizes())
          .copy_(weight.detach())
          .requires_grad_(true);
  FusedAdamW unaligned({odd}, FusedAdamWOptions(0.0));
  unaligned.set_model_copy(odd, weight);
  const auto forward_u = [&] {
    const torch::NoGradGuard no_grad;
    const fp8::Autocast guard(fp8::DelayedScaling().amax_history_len(kHistory));
    return u.layer->forward(x, splits);
  };
  const torch::Tensor yu_cast = forward_u();
  set_grads({odd}, 61);
  REQUIRE_NOTHROW(unaligned.step());
  for (const torchmoe::optim::Fp8WeightTarget& open :
       torchmoe::optim::detail::open_fp8_weight_offers()) {
    CHECK(open.layer != u.layer.get());  // taken, so the skipped copy was this optimizer's
  }
  weight.variable_data().mul_(2);
  check_close(forward_u(), yu_cast * 2, {0.1, 0.1}, "y of a layer whose master is not aligned");
}
