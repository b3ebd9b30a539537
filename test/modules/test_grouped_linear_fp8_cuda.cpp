// GroupedLinear in FP8 (fp8::Autocast) against the same module in 16 bits: one
// module, run twice with the same parameters, so the only difference is FP8. Per recipe
// (DelayedScaling after a calibration step, CurrentScaling, BlockScaling and its hybrid form),
// with bf16 and fp16 parameters; CurrentScaling's gradients against the float64 products of its
// dequantized operands (and those by finite differences); the delayed-scaling state (amax rows,
// history roll, scale = fp8_max / amax); the weight cache of is_first_microbatch; fused main-grad
// accumulation, delayed wgrad and a single grouped weight under delayed, current and block
// scaling; backward outside the guard; a 3-D input. GroupedMLP: test_grouped_mlp_fp8_cuda.cpp; the
// refusals and backends: test_grouped_linear_fp8_backends.cpp.
//
// How close FP8 is to bf16. Rounding to e4m3 (3 mantissa bits) leaves a relative error of about
// 0.026 rms per element, e5m2 (2 bits) about 0.052; a product's relative Frobenius error is the
// two operands' in quadrature: about 0.037 for e4m3 × e4m3 and 0.059 for e5m2 × e4m3 (measured in
// a float64 simulation of these shapes and recipes: 0.036-0.038 and 0.058-0.060). So the bounds:
// 0.05 where both operands are e4m3, 0.08 where one is e5m2 (TE's hybrid gradients), per split.
// Per element, |fp8 - bf16| <= 0.125·|bf16| + 0.5·rms(split) (TE's rtol 0.125; its atol 0.125
// assumes outputs of unit size, so here it is 0.5 of the split's rms: the simulation's worst
// element is 0.30). A missing or doubled scale is off by the scale itself (here 2^-8 .. 2^9 times:
// the splits have inputs of different magnitudes so that a neighbour's scale is wrong too), far
// past both bounds.

#include "modules/fp8_modules_test_utils.h"

using namespace torchmoe::test;
using namespace torchmoe::test::fp8_modules;
using Catch::Matchers::Contains;

TEST_CASE("GroupedLinear FP8 is close to the same layer in 16 bits", "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const RecipeCase rc = recipe_case(GENERATE(range(0, 5)));
  const torch::Dtype dtype = GENERATE(torch::kBFloat16, torch::kHalf);  // the outputs' too
  INFO(rc.name << ", " << dtype);
  GroupedLinear m = make_layer(layer_options(history_for(rc.recipe)).params_dtype(dtype));
  const torch::Tensor x = make_input().to(dtype), dy = make_grad().to(dtype);
  const Grads ref = run_layer(m, x, dy, std::nullopt);
  calibrate(m, x, dy, rc.recipe);
  const Grads out = run_layer(m, x, dy, rc.recipe);
  CHECK(out.y.scalar_type() == dtype);
  CHECK(out.dx.scalar_type() == dtype);
  const double grad_bound = rc.hybrid ? kHybridBound : kE4M3Bound;
  check_rows_close(out.y, ref.y, kE4M3Bound, "y");
  check_rows_close(out.dx, ref.dx, grad_bound, "dx");
  check_experts_close(out.dw, ref.dw, grad_bound, "dW");
  // Bias gradients are column sums of the unquantized grad_output (as TE's): bf16-close.
  check_experts_close(out.db, ref.db, 0.01, "db");
  check_not_bf16(out.y, ref.y);
  check_not_bf16(out.dx, ref.dx);
}

// `t` [rows, cols] as current scaling casts it per split of rows (the split-quantize tests'
// reference quantizer, from the definitions), dequantized, in float64.
torch::Tensor current_dequantized(const torch::Tensor& t, const std::vector<int64_t>& splits,
                                  Fp8Format format) {
  SplitQuantizeOptions options;
  options.format = format;
  options.scaling = QuantizeScaling::kCurrent;
  const Expected e = reference(t.detach(), splits, options);
  torch::Tensor out = e.data.to(torch::kFloat64);
  int64_t start = 0;
  for (size_t g = 0; g < splits.size(); ++g) {
    out.narrow(0, start, splits[g]).mul_(e.scale_inv[g].item<double>());
    start += splits[g];
  }
  return out;
}

// The gradients of the dequantized model. Under CurrentScaling (hybrid) the layer computes
// y = x̂·Ŵᵀ + b, dx = dŷ·Ŵ and dW = dŷᵀ·x̂ per split, where x̂, Ŵ are the e4m3 casts of x and W
// and dŷ the e5m2 cast of dy, each dequantized (current_dequantized, from the definitions).
// Central finite differences of the float64 loss Σ (x̂·Ŵᵀ + b) ⊙ dŷ at sampled elements confirm
// that the float64 products of those operands are its gradients; the layer matches them per
// element within the bf16 output's rounding plus the op tests' accumulation bound (fp8_reference.h:
// fprop's fast accumulation, split accumulation in dgrad and wgrad by CurrentScaling's default).
// A wrong format, scale or operand copy is off by percents of Σ|a·b|.
TEST_CASE("GroupedLinear FP8 gradients are the dequantized model's", "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  GroupedLinear m = make_layer(layer_options());
  const torch::Tensor x = make_input(), dy = make_grad();
  const Grads out = run_layer(m, x, dy, fp8::Recipe(fp8::CurrentScaling()));
  const torch::Tensor xq = current_dequantized(x, kSplits, Fp8Format::kE4M3);
  const torch::Tensor dyq = current_dequantized(dy, kSplits, Fp8Format::kE5M2);
  const std::vector<int64_t> expert_rows(kGroups, kOut);
  const torch::Tensor wq =
      current_dequantized(torch::stack(m->expert_weights()).view({kGroups * kOut, kIn}),
                          expert_rows, Fp8Format::kE4M3)
          .view({kGroups, kOut, kIn});
  const torch::Tensor b = torch::stack(m->expert_biases()).to(torch::kCPU, torch::kFloat64);

  Product y = per_split_abt(xq, wq.view({kGroups * kOut, kIn}), kSplits, kOut);
  const Product dx =
      per_split_abt(dyq, wq.transpose(1, 2).reshape({kGroups * kIn, kOut}), kSplits, kIn);
  const Product dw = per_split_atb(dyq, xq, kSplits);
  int64_t start = 0;
  for (int64_t g = 0; g < kGroups; ++g) {
    y.value.narrow(0, start, kSplits[g]).add_(b[g]);
    y.abs_sum.narrow(0, start, kSplits[g]).add_(b[g].abs());
    start += kSplits[g];
  }

  const auto loss = [&](const torch::Tensor& xs, const torch::Tensor& ws) {
    double sum = 0.0;
    int64_t first = 0;
    for (int64_t g = 0; g < kGroups; ++g) {
      const int64_t rows = kSplits[g];
      const torch::Tensor yg = torch::addmm(b[g], xs.narrow(0, first, rows), ws[g].t());
      sum += (yg * dyq.narrow(0, first, rows)).sum().item<double>();
      first += rows;
    }
    return sum;
  };
  // Central differences (the loss is bilinear: exact up to float64 rounding, ~1e-7 of these
  // gradients at a loss of ~1e6) at sampled elements of x and of the non-empty experts' W.
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  const double eps = 1e-3;
  const std::vector<int64_t> used_experts = {0, 2, 3};
  for (int i = 0; i < 15; ++i) {
    const int64_t r = torch::randint(kRows, {1}, gen).item<int64_t>();
    const int64_t c = torch::randint(kIn, {1}, gen).item<int64_t>();
    torch::Tensor plus = xq.clone(), minus = xq.clone();
    plus[r][c] += eps;
    minus[r][c] -= eps;
    INFO("dx at (" << r << ", " << c << ")");
    CHECK((loss(plus, wq) - loss(minus, wq)) / (2 * eps) ==
          Approx(dx.value[r][c].item<double>()).epsilon(1e-6).margin(1e-6));
    const int64_t g = used_experts[i % 3], o = torch::randint(kOut, {1}, gen).item<int64_t>();
    torch::Tensor wplus = wq.clone(), wminus = wq.clone();
    wplus[g][o][c] += eps;
    wminus[g][o][c] -= eps;
    INFO("dW at (" << g << ", " << o << ", " << c << ")");
    CHECK((loss(xq, wplus) - loss(xq, wminus)) / (2 * eps) ==
          Approx(dw.value[g][o][c].item<double>()).epsilon(1e-6).margin(1e-6));
  }
  const double rtol = output_rtol(torch::kBFloat16);
  check_within(out.y, y.value, rtol * y.value.abs() + kFastAccumulationTol * y.abs_sum, "y");
  check_within(out.dx, dx.value, rtol * dx.value.abs() + kAccumulationTol * dx.abs_sum, "dx");
  for (int64_t g = 0; g < kGroups; ++g) {
    check_within(out.dw[g], dw.value[g],
                 rtol * dw.value[g].abs() + kAccumulationTol * dw.abs_sum[g],
                 "dW of expert " + std::to_string(g));
  }
}

// The recipe's accumulation choice reaches each product: the same quantized operands (current
// scaling casts the same tensors the same way) give results that differ by the accumulation's
// rounding alone, in every product (reductions of 256, 384 and up to 211 deep: two or more
// 128-deep blocks, where the two accumulations part).
TEST_CASE("GroupedLinear FP8: CurrentScaling's split_accumulator fields reach the products",
          "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  GroupedLinear m = make_layer(layer_options());
  const torch::Tensor x = make_input(), dy = make_grad();
  const Grads te = run_layer(m, x, dy, fp8::Recipe(fp8::CurrentScaling()));
  const Grads flipped = run_layer(m, x, dy,
                                  fp8::Recipe(fp8::CurrentScaling()
                                                  .fprop_split_accumulator(true)
                                                  .dgrad_split_accumulator(false)
                                                  .wgrad_split_accumulator(false)));
  CHECK_FALSE(torch::equal(te.y, flipped.y));
  CHECK_FALSE(torch::equal(te.dx, flipped.dx));
  bool dw_differs = false;
  for (int64_t g = 0; g < kGroups; ++g) dw_differs |= !torch::equal(te.dw[g], flipped.dw[g]);
  CHECK(dw_differs);
  // By little: far inside the quantization's error (bf16 rounding and fast accumulation's ~1e-3).
  CHECK(relative_error(flipped.y.to(torch::kFloat), te.y.to(torch::kFloat)) < 0.01);
  CHECK(relative_error(flipped.dx.to(torch::kFloat), te.dx.to(torch::kFloat)) < 0.01);
  for (int64_t g = 0; g < kGroups; ++g) {
    if (te.dw[g].abs().max().item<double>() == 0.0) continue;  // the empty split's expert
    CHECK(relative_error(flipped.dw[g].to(torch::kFloat), te.dw[g].to(torch::kFloat)) < 0.01);
  }
}

TEST_CASE("GroupedLinear FP8 delayed scaling records amaxes and updates the scales",
          "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto recipe = fp8::DelayedScaling().amax_history_len(kHistory);
  GroupedLinear m = make_layer(layer_options(kHistory));
  const torch::Tensor x = make_input(), dy = make_grad();
  // max |t| per split on the host; 0 for an empty split.
  auto split_amax = [](const torch::Tensor& t) {
    std::vector<float> amax;
    int64_t start = 0;
    for (int64_t rows : kSplits) {
      amax.push_back(
          rows == 0 ? 0.0f : t.narrow(0, start, rows).abs().max().to(torch::kFloat).item<float>());
      start += rows;
    }
    return amax;
  };
  std::vector<float> weight_amax;
  for (const torch::Tensor& w : m->expert_weights()) {
    weight_amax.push_back(w.abs().max().to(torch::kFloat).item<float>());
  }
  const fp8::Fp8State state = m->fp8_state();
  REQUIRE(state);
  const fp8::DelayedScalingTensors& in = state->tensors(TensorRole::kInput);
  const fp8::DelayedScalingTensors& wt = state->tensors(TensorRole::kWeight);
  const fp8::DelayedScalingTensors& go = state->tensors(TensorRole::kGradOutput);
  auto check_row = [](const torch::Tensor& history, int64_t row, const std::vector<float>& amax,
                      const std::string& what) {
    INFO(what << ", history row " << row);
    const torch::Tensor r = history[row].cpu();
    for (int64_t g = 0; g < kGroups; ++g) {
      INFO("expert " << g);
      CHECK(r[g].item<float>() == amax[g]);
    }
  };
  const std::vector<float> zeros(kGroups, 0.0f);

  const torch::Tensor input = x.detach().requires_grad_(true);
  torch::Tensor y;
  {
    const fp8::Autocast guard(recipe);
    y = m(input, kSplits);
  }
  check_row(in.amax_history, 0, split_amax(x), "input amax after forward");
  check_row(wt.amax_history, 0, weight_amax, "weight amax after forward");
  check_row(go.amax_history, 0, zeros, "grad_output amax before backward");
  y.backward(dy);
  check_row(go.amax_history, 0, split_amax(dy), "grad_output amax after backward");

  // A second micro-batch of the same step maxes into row 0: split 0 four times larger.
  const torch::Tensor x2 = x.clone();
  x2.narrow(0, 0, kSplits[0]).mul_(4);
  {
    const fp8::Autocast guard(recipe);
    m(x2, kSplits);
  }
  const std::vector<float> input_amax = split_amax(x2);
  check_row(in.amax_history, 0, input_amax, "input amax after two micro-batches");
  const std::vector<float> grad_amax = split_amax(dy);

  // The update: row 0 becomes the newest entry (row H-1), row 0 is zeroed, and
  // scale = fp8_max / amax in fp32 (margin 0; the history held nothing larger); an empty split
  // (amax 0) keeps scale 1.
  auto check_scales = [](const fp8::DelayedScalingTensors& t, const std::vector<float>& amax,
                         float fp8_max, const std::string& what) {
    INFO(what);
    const torch::Tensor scale = t.scale.cpu(), scale_inv = t.scale_inv.cpu();
    for (int64_t g = 0; g < kGroups; ++g) {
      INFO("expert " << g << ", amax " << amax[g]);
      const float expected = amax[g] > 0.0f ? fp8_max / amax[g] : 1.0f;
      CHECK(scale[g].item<float>() == expected);
      CHECK(scale_inv[g].item<float>() == 1.0f / expected);
    }
  };
  CHECK(fp8::update_delayed_scaling(*m, recipe, fp8::Pass::kForward) == 1);
  check_row(in.amax_history, 0, zeros, "input after the forward update");
  check_row(in.amax_history, kHistory - 1, input_amax, "input after the forward update");
  check_row(wt.amax_history, kHistory - 1, weight_amax, "weight after the forward update");
  check_scales(in, input_amax, 448.0f, "input scale (e4m3)");
  check_scales(wt, weight_amax, 448.0f, "weight scale (e4m3)");
  // The forward update leaves grad_output alone.
  check_row(go.amax_history, 0, grad_amax, "grad_output after the forward update");
  CHECK(go.scale.eq(1).all().item<bool>());
  CHECK(fp8::update_delayed_scaling(*m, recipe, fp8::Pass::kBackward) == 1);
  check_row(go.amax_history, 0, zeros, "grad_output after the backward update");
  check_row(go.amax_history, kHistory - 1, grad_amax, "grad_output after the backward update");
  check_scales(go, grad_amax, 57344.0f, "grad_output scale (e5m2 under kHybrid)");
}

TEST_CASE("GroupedLinear FP8 is_first_microbatch caches the FP8 weights", "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const fp8::Recipe recipe = fp8::CurrentScaling();
  GroupedLinear m = make_layer(layer_options());
  const torch::Tensor x = make_input(), dy = make_grad();
  auto double_weights = [&] {
    torch::NoGradGuard no_grad;
    for (torch::Tensor w : m->expert_weights()) w.mul_(2);  // exact in bf16
  };

  SECTION("false reuses the weights cached by true, even after they change") {
    const Grads first = run_layer(m, x, dy, recipe, true);
    double_weights();
    const Grads cached = run_layer(m, x, dy, recipe, false);
    CHECK(torch::equal(cached.y, first.y));
    CHECK(torch::equal(cached.dx, first.dx));  // dgrad reads the cached columnwise copy too
    // Without the flag, or with true, the new weights are quantized: close to bf16 with them.
    const Grads bf16 = run_layer(m, x, dy, std::nullopt);
    const Grads fresh = run_layer(m, x, dy, recipe, std::nullopt);
    CHECK_FALSE(torch::equal(fresh.y, first.y));
    check_rows_close(fresh.y, bf16.y, kE4M3Bound, "y, weights quantized again");
    const Grads recached = run_layer(m, x, dy, recipe, true);
    CHECK(torch::equal(recached.y, fresh.y));
    const Grads reused = run_layer(m, x, dy, recipe, false);
    CHECK(torch::equal(reused.y, fresh.y));
  }
  SECTION("nullopt quantizes every call") {
    const Grads before = run_layer(m, x, dy, recipe);
    double_weights();
    const Grads after = run_layer(m, x, dy, recipe);
    CHECK_FALSE(torch::equal(after.y, before.y));
  }
  SECTION("DelayedScaling: false reuses the cache and records no weight amax") {
    const auto delayed = fp8::DelayedScaling().amax_history_len(kHistory);
    GroupedLinear d = make_layer(layer_options(kHistory));
    const torch::Tensor history = d->fp8_state()->tensors(TensorRole::kWeight).amax_history;
    const Grads first = run_layer(d, x, dy, delayed, true);
    const torch::Tensor recorded = history[0].clone();
    CHECK(recorded.gt(0).all().item<bool>());
    {
      torch::NoGradGuard no_grad;
      for (torch::Tensor w : d->expert_weights()) w.mul_(2);
    }
    const Grads cached = run_layer(d, x, dy, delayed, false);
    CHECK(torch::equal(cached.y, first.y));
    CHECK(torch::equal(history[0], recorded));  // the doubled weights were not cast
    run_layer(d, x, dy, delayed, true);
    CHECK(torch::equal(history[0], 2 * recorded));  // cast again: their amax maxed into the row
  }
  SECTION("false under a recipe whose weights differ from the cached ones is an error") {
    run_layer(m, x, dy, recipe, true);               // per-tensor e4m3 weights
    const fp8::Recipe blocks = fp8::BlockScaling();  // 128x128 weight blocks
    const fp8::Autocast guard(blocks);
    REQUIRE_THROWS_WITH(m(x, kSplits, false), Contains("differ in format or scaling"));
  }
  SECTION("false with nothing cached is an error") {
    const fp8::Autocast guard(recipe);
    REQUIRE_THROWS_AS(m(x, kSplits, false), c10::Error);
    REQUIRE_THROWS_WITH(m(x, kSplits, false), Contains("is_first_microbatch"));
  }
  SECTION("to() drops the cache: its copies stay on the old device, from the old weights") {
    for (const bool by_dtype : {true, false}) {
      INFO("by_dtype=" << by_dtype);
      run_layer(m, x, dy, recipe, true);
      if (by_dtype) {
        m->to(torch::kFloat32);  // a dtype change alone (Module::to(Dtype)), and back
        m->to(torch::kBFloat16);
      } else {
        m->to(torch::kCPU);
        m->to(torch::kCUDA);
      }
      const fp8::Autocast guard(recipe);
      REQUIRE_THROWS_WITH(m(x, kSplits, false), Contains("and there was none"));
    }
  }
}

TEST_CASE("GroupedLinear FP8 with fused main-grad accumulation", "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const RecipeCase rc = recipe_case(GENERATE(0, 1, 2));  // delayed, current, blocks
  INFO(rc.name);
  const fp8::Recipe& recipe = rc.recipe;
  GroupedLinear m = make_layer(layer_options(history_for(recipe)).fuse_wgrad_accumulation(true));
  const torch::Tensor x = make_input(), dy = make_grad();
  auto main_grads = [&] {
    std::vector<torch::Tensor> copies;
    for (const torch::Tensor& g : m->main_grads()) copies.push_back(g.clone());
    return copies;
  };
  calibrate(m, x, dy, recipe);
  run_layer(m, x, dy, std::nullopt, true);
  const std::vector<torch::Tensor> bf16 = main_grads();
  const Grads first = run_layer(m, x, dy, recipe, true);  // overwrites
  const std::vector<torch::Tensor> fp8_first = main_grads();
  REQUIRE(fp8_first.size() == static_cast<size_t>(kGroups));
  CHECK(fp8_first[0].scalar_type() == torch::kFloat32);
  check_experts_close(fp8_first, bf16, rc.hybrid ? kHybridBound : kE4M3Bound, "main_grad");
  check_not_bf16(fp8_first[0], bf16[0]);
  // A second micro-batch (cached weights) adds the same product: twice the first, to fp32
  // rounding.
  run_layer(m, x, dy, recipe, false);
  const std::vector<torch::Tensor> fp8_second = main_grads();
  for (int64_t g = 0; g < kGroups; ++g) {
    const double scale = fp8_first[g].abs().max().item<double>();
    check_close(fp8_second[g], fp8_first[g] * 2, {1e-5, 1e-6 * scale + 1e-30},
                "main_grad after two micro-batches, expert " + std::to_string(g));
  }
  CHECK(first.db.size() == static_cast<size_t>(kGroups));  // bias gradients still go to .grad
  CHECK(first.db[0].defined());
}

TEST_CASE("GroupedLinear FP8 with delayed wgrad computes the same weight gradients",
          "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const RecipeCase rc = recipe_case(GENERATE(0, 1, 2));  // delayed, current, blocks
  INFO(rc.name);
  const fp8::Recipe& recipe = rc.recipe;
  const int64_t history = history_for(recipe);
  GroupedLinear now = make_layer(layer_options(history));
  GroupedLinear later = make_layer(layer_options(history).delay_wgrad_compute(true));
  REQUIRE(torch::equal(now->expert_weights()[2], later->expert_weights()[2]));
  const torch::Tensor x = make_input(), dy = make_grad();
  calibrate(now, x, dy, recipe);
  calibrate(later, x, dy, recipe);
  const Grads expected = run_layer(now, x, dy, recipe);
  const Grads got = run_layer(later, x, dy, recipe);
  CHECK(torch::equal(got.y, expected.y));
  CHECK(torch::equal(got.dx, expected.dx));
  CHECK(later->pending_wgrad_count() == 1);
  later->backward_dw();
  CHECK(later->pending_wgrad_count() == 0);
  const std::vector<torch::Tensor> dw = grads_of(*later, "weight", kGroups);
  for (int64_t g = 0; g < kGroups; ++g) {
    INFO("expert " << g);
    REQUIRE(dw[g].defined());
    CHECK(torch::equal(dw[g], expected.dw[g]));
  }
  if (is_delayed(recipe)) check_same_delayed_state(now, later);
  check_not_bf16(expected.dw[0], run_layer(now, x, dy, std::nullopt).dw[0]);
}

TEST_CASE("GroupedLinear FP8 backward follows the forward's recipe wherever it runs",
          "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const fp8::Recipe recipe = fp8::CurrentScaling();
  GroupedLinear m = make_layer(layer_options());
  const torch::Tensor x = make_input(), dy = make_grad();
  const Grads outside = run_layer(m, x, dy, recipe);  // backward after the guard
  auto run_backward_under = [&](const fp8::Recipe& backward_recipe, bool enabled) {
    m->zero_grad();
    const torch::Tensor input = x.detach().requires_grad_(true);
    const fp8::Autocast guard(recipe);
    const torch::Tensor y = m(input, kSplits);
    const fp8::Autocast inner(backward_recipe, enabled);
    y.backward(dy);
    return std::make_pair(input.grad(), grads_of(*m, "weight", kGroups));
  };
  SECTION("inside the guard") {
    const auto [dx, dw] = run_backward_under(recipe, true);
    CHECK(torch::equal(dx, outside.dx));
    CHECK(torch::equal(dw[3], outside.dw[3]));
  }
  SECTION("inside a disabled guard") {
    const auto [dx, dw] = run_backward_under(recipe, false);
    CHECK(torch::equal(dx, outside.dx));
    CHECK(torch::equal(dw[3], outside.dw[3]));
  }
  SECTION("inside another recipe's guard") {
    const auto [dx, dw] = run_backward_under(fp8::BlockScaling(), true);
    CHECK(torch::equal(dx, outside.dx));
    CHECK(torch::equal(dw[3], outside.dw[3]));
  }
  // And backward was FP8 (e5m2 grad_output: ~0.06 from bf16), not bf16.
  const Grads bf16 = run_layer(m, x, dy, std::nullopt);
  check_not_bf16(outside.dx, bf16.dx);
  check_not_bf16(outside.dw[0], bf16.dw[0]);
}

TEST_CASE("GroupedLinear FP8 with a single grouped weight matches separate weights",
          "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  // quantize_weights reads a [G, out, in] weight in place and stacks separate ones: same bytes,
  // so the same results, and under delayed scaling the same recorded amaxes.
  const RecipeCase rc = recipe_case(GENERATE(0, 1, 2));  // delayed, current, blocks
  INFO(rc.name);
  const fp8::Recipe& recipe = rc.recipe;
  const int64_t history = history_for(recipe);
  GroupedLinear separate = make_layer(layer_options(history));
  GroupedLinear single =
      make_layer(layer_options(history).single_grouped_weight(true).single_grouped_bias(true));
  {
    torch::NoGradGuard no_grad;
    for (int64_t g = 0; g < kGroups; ++g) {
      single->expert_weights()[g].copy_(separate->expert_weights()[g]);
      single->expert_biases()[g].copy_(separate->expert_biases()[g]);
    }
  }
  const torch::Tensor x = make_input(), dy = make_grad();
  const torch::Tensor input = x.detach().requires_grad_(true);
  auto run_single = [&] {  // run_layer's step; the single weight has one gradient
    single->zero_grad();
    input.mutable_grad() = torch::Tensor();
    torch::Tensor y;
    {
      const fp8::Autocast guard(recipe);
      y = single(input, kSplits);
    }
    y.backward(dy);
    return y;
  };
  calibrate(separate, x, dy, recipe);
  if (is_delayed(recipe)) {  // calibrate's step for the single weight
    run_single();
    update_delayed(*single, recipe, 1);
  }
  const Grads expected = run_layer(separate, x, dy, recipe);
  const torch::Tensor y = run_single();
  CHECK(torch::equal(y, expected.y));
  CHECK(torch::equal(input.grad(), expected.dx));
  const torch::Tensor dw = single->named_parameters()["weight"].grad();
  REQUIRE(dw.defined());
  for (int64_t g = 0; g < kGroups; ++g) {
    INFO("expert " << g);
    CHECK(torch::equal(dw[g], expected.dw[g]));
  }
  if (is_delayed(recipe)) check_same_delayed_state(separate, single);
  check_not_bf16(expected.y, run_layer(separate, x, dy, std::nullopt).y);
}

TEST_CASE("GroupedLinear FP8 takes a 3-D input", "[modules][fp8][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const fp8::Recipe recipe = fp8::CurrentScaling();
  GroupedLinear m = make_layer(layer_options());
  const torch::Tensor x = make_input(), dy = make_grad();
  const Grads flat = run_layer(m, x, dy, recipe);
  m->zero_grad();
  const torch::Tensor input = x.view({2, kRows / 2, kIn}).detach().requires_grad_(true);
  torch::Tensor y;
  {
    const fp8::Autocast guard(recipe);
    y = m(input, kSplits);
  }
  REQUIRE(y.sizes() == torch::IntArrayRef({2, kRows / 2, kOut}));
  y.backward(dy.view({2, kRows / 2, kOut}));
  CHECK(torch::equal(y.reshape({kRows, kOut}), flat.y));
  REQUIRE(input.grad().sizes() == input.sizes());
  CHECK(torch::equal(input.grad().reshape({kRows, kIn}), flat.dx));
  CHECK(torch::equal(grads_of(*m, "weight", kGroups)[3], flat.dw[3]));
}
