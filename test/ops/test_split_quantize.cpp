// FP8 split-quantize (ops/quantize.h) against a CPU reference quantizer written from the
// definitions in kernels/split_quantize.h and TransformerEngine's recipes (never calling the
// kernel): per-tensor current and delayed scaling, 1x128 and 128x128 block scaling; e4m3 and
// e5m2; bf16/fp16/fp32 inputs; zero, odd, prime and non-multiple-of-128 splits; host vs device
// (int32, int64) splits; clamped device splits; all-zero, inf and NaN inputs; the delayed-scaling
// history roll and scale update. Argument errors are checked on the CPU. The gathered and GLU
// sources: test_split_quantize_sources.cpp.

#include <string>
#include <vector>

#include "ops/split_quantize_test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

TEST_CASE("split_quantize matches the reference quantizer", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const Fp8Format format = GENERATE(Fp8Format::kE4M3, Fp8Format::kE5M2);
  const torch::Dtype dtype = GENERATE(torch::kBFloat16, torch::kHalf, torch::kFloat);
  const bool pow2 = GENERATE(false, true);
  // Zero, odd, prime, short and multi-block splits; K not a multiple of 128.
  const std::vector<int64_t> sizes = {0, 131, 1, 256, 17, 0, 300, 127};
  const int64_t rows = 832, k = 272;
  INFO("scaling " << scaling_name(scaling) << ", e" << (format == Fp8Format::kE4M3 ? "4m3" : "5m2")
                  << ", dtype " << dtype << ", pow2 " << pow2);
  const torch::Tensor x = make_input(rows, k, dtype, 5);
  SplitQuantizeOptions o;
  o.format = format;
  o.scaling = scaling;
  o.power_of_2_scales = pow2;
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized q = run(x, sizes, o, scale);
  check_against_reference(q, reference(x, sizes, o, scale), sizes, o, rows, k);
}

TEST_CASE("split_quantize: the columnwise copy is the transpose of the rowwise one",
          "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling = GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed,
                                           QuantizeScaling::kBlock128x128);
  const std::vector<int64_t> sizes = {64, 0, 200, 33, 7};
  const int64_t rows = 304, k = 400;
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized q = run(make_input(rows, k, torch::kBFloat16, 9), sizes, o, scale);
  const torch::Tensor data = q.data.cpu().view(torch::kByte);
  const torch::Tensor colwise = q.columnwise_data.cpu().view(torch::kByte);
  int64_t block_start = 0;
  for (const Split& s : clamp_splits(sizes, rows)) {
    INFO("split at row " << s.start << " of " << s.rows << " rows");
    const int64_t m16 = round_up_columnwise(s.rows);
    const torch::Tensor block = colwise.narrow(0, k * block_start, k * m16).view({k, m16});
    CHECK(torch::equal(block.narrow(1, 0, s.rows), data.narrow(0, s.start, s.rows).t()));
    // The padding columns (m_g up to a multiple of 16) are zeros.
    CHECK(torch::equal(block.narrow(1, s.rows, m16 - s.rows),
                       torch::zeros({k, m16 - s.rows}, torch::kByte)));
    block_start += m16;
  }
}

TEST_CASE("split_quantize: device splits (int32, int64) give the host splits' results",
          "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const torch::Dtype split_type = GENERATE(torch::kInt, torch::kLong);
  // 70 splits (more than one warp's scan), many empty, one past 128 rows.
  std::vector<int64_t> sizes(70, 0);
  for (size_t g = 0; g < sizes.size(); g += 3) sizes[g] = static_cast<int64_t>(g % 11) * 7 + 1;
  sizes[40] = 260;
  int64_t rows = 0;
  for (int64_t s : sizes) rows += s;
  const int64_t k = 160;
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor x = make_input(rows, k, torch::kBFloat16, 13);
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized host = run(x, sizes, o, scale);
  const torch::Tensor device_sizes =
      torch::tensor(sizes, torch::kLong).to(torch::kCUDA, split_type);
  const SplitQuantized device = torchmoe::ops::split_quantize(x, device_sizes, o, scale);
  check_same(device, host, sizes, rows, k);
  check_against_reference(device, reference(x, sizes, o, scale), sizes, o, rows, k);
}

// More tiles than a wave of blocks holds (~1,200 against ~400 on an H100), so the grid-stride
// loop wraps around, and current scaling takes every path: tiles kept in a block's stash until
// their split is complete and then exchanged for the next tile (the 6,000-row split: ~380 tiles),
// and tiles dropped after their amax and loaded again (the 9,000-row split and the one split
// holding every row: more tiles than the blocks can keep). Repeated: a race would show as a
// difference.
TEST_CASE("split_quantize: many waves of tiles", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const std::vector<int64_t> sizes = GENERATE(std::vector<int64_t>{6000, 0, 37, 9000, 129, 4000, 1},
                                              std::vector<int64_t>{0, 19167, 0});
  const int64_t rows = 19167, k = 1024;
  INFO("scaling " << scaling_name(scaling) << ", " << sizes.size() << " splits");
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor x = make_input(rows, k, torch::kBFloat16, 23);
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized q = run(x, sizes, o, scale);
  check_against_reference(q, reference(x, sizes, o, scale), sizes, o, rows, k);
  for (int repeat = 0; repeat < 3; ++repeat) check_same(run(x, sizes, o, scale), q, sizes, rows, k);
}

TEST_CASE("split_quantize: device splits past the rows are clamped", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int64_t rows = 300, k = 64;
  SplitQuantizeOptions o;
  o.scaling = QuantizeScaling::kBlock1x128;
  const torch::Tensor x = make_input(rows, k, torch::kFloat, 17);
  const SplitQuantized q =
      torchmoe::ops::split_quantize(x, torch::tensor({5, -3, 1000, 40}, torch::kLong).cuda(), o);
  // Clamped: 5, 0, 295, 0.
  const std::vector<int64_t> clamped = {5, 0, 295, 0};
  check_against_reference(q, reference(x, clamped, o), clamped, o, rows, k);
}

TEST_CASE("split_quantize: one copy alone equals that copy of both", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling = GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kBlock1x128,
                                           QuantizeScaling::kBlock128x128);
  const std::vector<int64_t> sizes = {100, 0, 29};
  const torch::Tensor x = make_input(129, 128, torch::kHalf, 21);
  SplitQuantizeOptions both, rows_only, cols_only;
  both.scaling = rows_only.scaling = cols_only.scaling = scaling;
  rows_only.columnwise = false;
  cols_only.rowwise = false;
  const SplitQuantized a = run(x, sizes, both, {}), r = run(x, sizes, rows_only, {}),
                       c = run(x, sizes, cols_only, {});
  CHECK_FALSE(r.columnwise_data.defined());
  CHECK_FALSE(c.data.defined());
  CHECK(torch::equal(a.data.view(torch::kByte), r.data.view(torch::kByte)));
  const int64_t used_t = 128 * padded_rows(sizes, 129);
  CHECK(torch::equal(a.columnwise_data.narrow(0, 0, used_t).view(torch::kByte),
                     c.columnwise_data.narrow(0, 0, used_t).view(torch::kByte)));
  check_against_reference(r, reference(x, sizes, rows_only), sizes, rows_only, 129, 128);
  check_against_reference(c, reference(x, sizes, cols_only), sizes, cols_only, 129, 128);
}

TEST_CASE("split_quantize: all-zero input gives finite scales", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling = GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kBlock1x128,
                                           QuantizeScaling::kBlock128x128);
  const std::vector<int64_t> sizes = {0, 130, 3};
  const torch::Tensor x = torch::zeros({133, 32}, torch::kCUDA).to(torch::kBFloat16);
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const SplitQuantized q = run(x, sizes, o, {});
  CHECK(torch::equal(q.amax.cpu(), torch::zeros({3})));
  if (scaling == QuantizeScaling::kCurrent) {
    CHECK(torch::equal(q.scale_inv.cpu(), torch::ones({3})));  // amax 0 → scale 1
  }
  CHECK(torch::equal(q.data.cpu().to(torch::kFloat), torch::zeros({133, 32})));
  check_against_reference(q, reference(x, sizes, o), sizes, o, 133, 32);
  // No features (K = 0): rows but no tile. Every split's scale is still written.
  const SplitQuantized none =
      run(torch::zeros({133, 0}, torch::kCUDA).to(torch::kBFloat16), sizes, o, {});
  CHECK(torch::equal(none.amax.cpu(), torch::zeros({3})));
  if (scaling == QuantizeScaling::kCurrent) {
    CHECK(torch::equal(none.scale_inv.cpu(), torch::ones({3})));
  }
}

TEST_CASE("split_quantize: inf and NaN inputs follow TransformerEngine", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const std::vector<int64_t> sizes = {40, 40, 48};
  torch::Tensor x = make_input(128, 48, torch::kFloat, 25).cpu();
  x[3][5] = std::numeric_limits<float>::infinity();    // split 0: amax inf → scale 1
  x[50][7] = std::numeric_limits<float>::quiet_NaN();  // split 1: NaN ignored by amax
  x[100][1] = -std::numeric_limits<float>::infinity();
  x[100][2] = std::numeric_limits<float>::quiet_NaN();  // split 2: both
  x = x.cuda();
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized q = run(x, sizes, o, scale);
  const Expected e = reference(x, sizes, o, scale);
  check_against_reference(q, e, sizes, o, 128, 48);
  CHECK(std::isinf(q.amax[0].item<float>()));
  CHECK(std::isfinite(q.amax[1].item<float>()));
  CHECK(q.data.cpu().to(torch::kFloat)[50][7].isnan().item<bool>());
  if (scaling == QuantizeScaling::kDelayed) {
    // The next step's scale stays finite and non-zero: the inf amax keeps the old scale.
    const torch::Tensor history = torch::zeros({4, 3}, torch::kCUDA);
    torch::Tensor next = scale.clone(), next_inv = torch::empty_like(scale);
    torchmoe::ops::update_delayed_scaling(history, q.amax, next, next_inv, {});
    const torch::Tensor s = next.cpu();
    CHECK(s[0].item<float>() == scale[0].item<float>());
    CHECK((s.isfinite() & (s > 0)).all().item<bool>());
    CHECK((next_inv.cpu().isfinite() & (next_inv.cpu() > 0)).all().item<bool>());
  }
}

TEST_CASE("split_quantize: delayed scaling maxes into a given amax", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const std::vector<int64_t> sizes = {10, 20};
  const torch::Tensor x = make_input(30, 16, torch::kBFloat16, 29);
  SplitQuantizeOptions o;
  o.scaling = QuantizeScaling::kDelayed;
  const torch::Tensor scale = scale_argument(QuantizeScaling::kDelayed, 2);
  const Expected e = reference(x, sizes, o, scale);
  const torch::Tensor amax = torch::tensor({1e6f, 0.0f}).cuda();
  const SplitQuantized q = torchmoe::ops::split_quantize(x, sizes, o, scale, amax);
  CHECK(q.amax.data_ptr() == amax.data_ptr());
  CHECK(amax[0].item<float>() == 1e6f);
  CHECK(amax[1].item<float>() == e.amax[1].item<float>());
}

TEST_CASE("update_delayed_scaling rolls the history and updates the scale",
          "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const AmaxComputeAlgo algo = GENERATE(AmaxComputeAlgo::kMax, AmaxComputeAlgo::kMostRecent);
  const int64_t length = GENERATE(1, 3, 300);  // 300: more rows than the kernel's threads
  const double margin = 1.0;
  const int64_t groups = 3;
  INFO("history " << length << ", algo " << (algo == AmaxComputeAlgo::kMax ? "max" : "recent"));
  torch::Tensor history = torch::zeros({length, groups}, torch::kCUDA);
  torch::Tensor scale = torch::ones({groups}, torch::kCUDA), scale_inv = torch::ones_like(scale);
  // The reference keeps the same history on the host, from the definition: newest into row 0,
  // scale from max/most recent, then roll so that row H-1 is the newest and row 0 is zero.
  torch::Tensor ref_history = torch::zeros({length, groups});
  torch::Tensor ref_scale = torch::ones({groups});
  const float scaled_max = 448.0f * 0.5f;
  const float kNaN = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::vector<float>> steps = {
      {2.0f, 0.0f, 1.0f},
      {8.0f, 3.0f, std::numeric_limits<float>::infinity()},
      {1.0f, 0.5f, 4.0f},
      {0.25f, 1e-39f, 2.0f},
      // A NaN amax (reduced in from another rank, or loaded): as TE's update, kMostRecent keeps
      // the old scale and kMax's maximum leaves the NaN out (fmaxf; with a history of 1 nothing
      // is left, so the old scale stays too). The NaN rolls through the history like any amax
      // and never reaches a scale: split 0's next amax, 16, past every earlier one, sets its
      // scale at every history length (a NaN kept in the maximum would keep the old scale).
      {kNaN, kNaN, 0.5f},
      {16.0f, 1.0f, kNaN}};
  for (const std::vector<float>& step : steps) {
    const torch::Tensor amax = torch::tensor(step);
    ref_history[0] = amax;
    for (int64_t g = 0; g < groups; ++g) {
      const torch::Tensor column = ref_history.select(1, g);
      const float a = algo == AmaxComputeAlgo::kMax
                          ? column.masked_fill(column.isnan(), 0.0f).max().item<float>()
                          : step[g];
      float s = ref_scale[g].item<float>();
      if (std::isfinite(a) && a > 0.0f) s = scaled_max / a;
      if (std::isinf(s)) s = FLT_MAX;
      ref_scale[g] = s;
    }
    ref_history = torch::roll(ref_history, -1, 0);
    ref_history[0] = 0.0f;
    torchmoe::ops::DelayedScalingUpdateOptions uo;
    uo.margin = margin;
    uo.algo = algo;
    torchmoe::ops::update_delayed_scaling(history, amax.cuda(), scale, scale_inv, uo);
    // Exactly, NaN matching NaN and inf matching inf.
    CHECK(torch::allclose(history.cpu(), ref_history, 0.0, 0.0, /*equal_nan=*/true));
    CHECK(torch::equal(scale.cpu(), ref_scale));
    CHECK(torch::equal(scale_inv.cpu(), 1.0f / ref_scale));
    CHECK((scale.cpu().isfinite() & (scale.cpu() > 0)).all().item<bool>());
  }
  // amax may alias history row 0 (TE's layout: the cast maxes into row 0).
  torchmoe::ops::update_delayed_scaling(history, history[0], scale, scale_inv, {});
  CHECK(torch::equal(history[0].cpu(), torch::zeros({groups})));
}

TEST_CASE("split_quantize and update_delayed_scaling reject bad arguments", "[ops][quantize]") {
  using torchmoe::ops::split_quantize;
  using torchmoe::ops::update_delayed_scaling;
  const torch::Tensor x = torch::randn({8, 32});
  SplitQuantizeOptions o;
  CHECK_THROWS_WITH(split_quantize(x.view({-1}), {8}, o), Contains("input must be a 2-D"));
  CHECK_THROWS_WITH(split_quantize(x.to(torch::kDouble), {8}, o),
                    Contains("input must be float32, float16 or bfloat16, got Double"));
  CHECK_THROWS_WITH(split_quantize(torch::randn({8, 24}), {8}, o),
                    Contains("features must be a multiple of 16"));
  CHECK_THROWS_WITH(split_quantize(x.t(), {32}, o), Contains("input must be contiguous"));
  CHECK_THROWS_WITH(split_quantize(x, std::vector<int64_t>{}, o),
                    Contains("m_splits must have between 1 and 4096 sizes, got 0"));
  CHECK_THROWS_WITH(split_quantize(x, {4, -1, 5}, o),
                    Contains("m_splits[1] must be non-negative, got -1"));
  CHECK_THROWS_WITH(split_quantize(x, {4, 5}, o), Contains("sum to at most the input's 8 rows"));
  SplitQuantizeOptions none;
  none.rowwise = none.columnwise = false;
  CHECK_THROWS_WITH(split_quantize(x, {8}, none), Contains("at least one of rowwise"));
  SplitQuantizeOptions bad_eps;
  bad_eps.amax_epsilon = -1.0;
  CHECK_THROWS_WITH(split_quantize(x, {8}, bad_eps), Contains("amax_epsilon must be finite"));
  SplitQuantizeOptions delayed;
  delayed.scaling = QuantizeScaling::kDelayed;
  CHECK_THROWS_WITH(split_quantize(x, {8}, delayed), Contains("scale must be a defined tensor"));
  CHECK_THROWS_WITH(split_quantize(x, {4, 4}, delayed, torch::ones({3})),
                    Contains("scale must have shape [2]"));
  CHECK_THROWS_WITH(split_quantize(x, {8}, delayed, torch::ones({1}, torch::kDouble)),
                    Contains("scale must be float32, got Double"));
  CHECK_THROWS_WITH(split_quantize(x, {8}, o, torch::ones({1})),
                    Contains("scale and amax are inputs of delayed scaling only"));
  CHECK_THROWS_AS(split_quantize(x, {8}, o), c10::NotImplementedError);
  CHECK_THROWS_AS(split_quantize(x, {8}, delayed, torch::ones({1})), c10::NotImplementedError);

  using torchmoe::ops::glu_split_quantize;
  const torchmoe::ops::GluOptions glu;
  const torch::Tensor z = torch::randn({8, 64});
  CHECK_THROWS_WITH(
      glu_split_quantize(z.view({-1}), {}, glu, {8}, o),
      Contains("glu_split_quantize: input must be a 2-D [rows, 2 * features] tensor"));
  CHECK_THROWS_WITH(glu_split_quantize(torch::randn({8, 63}), {}, glu, {8}, o),
                    Contains("last dimension must be even"));
  CHECK_THROWS_WITH(glu_split_quantize(torch::randn({8, 48}), {}, glu, {8}, o),
                    Contains("input's features must be a multiple of 16 (FP8 GEMM operands), got "
                             "24"));
  CHECK_THROWS_WITH(glu_split_quantize(z, torch::rand({7}), glu, {8}, o),
                    Contains("scales must have shape [8]"));
  torchmoe::ops::GluOptions bad_interleave;
  bad_interleave.interleave = 5;
  CHECK_THROWS_WITH(glu_split_quantize(z, {}, bad_interleave, {8}, o),
                    Contains("glu_interleave_size must be a positive divisor of H="));
  CHECK_THROWS_WITH(
      glu_split_quantize(z, {}, glu, {4, 5}, o),
      Contains("glu_split_quantize: m_splits must sum to at most the input's 8 rows"));
  CHECK_THROWS_WITH(glu_split_quantize(z, {}, glu, {8}, delayed),
                    Contains("glu_split_quantize: scale must be a defined tensor"));
  CHECK_THROWS_AS(glu_split_quantize(z, {}, glu, {8}, o), c10::NotImplementedError);

  using torchmoe::ops::gather_split_quantize;
  const torch::Tensor rows = torch::zeros({10}, torch::kLong);
  CHECK_THROWS_WITH(
      gather_split_quantize(x, rows.to(torch::kInt), {8}, o),
      Contains("gather_split_quantize: rows must be a 1-D int64 tensor, got [10] Int"));
  CHECK_THROWS_WITH(gather_split_quantize(x, rows.view({2, 5}), {8}, o),
                    Contains("rows must be a 1-D int64 tensor, got [2, 5] Long"));
  CHECK_THROWS_WITH(gather_split_quantize(x, rows, {4, 7}, o),
                    Contains("gather_split_quantize: m_splits must sum to at most the gathered 10 "
                             "rows, got [4, 7] (sum above it)"));
  CHECK_THROWS_WITH(
      gather_split_quantize(x, torch::zeros({20}, torch::kLong).slice(0, 0, 20, 2), {8}, o),
      Contains("gather_split_quantize: rows must be contiguous"));
  CHECK_THROWS_WITH(gather_split_quantize(x.view({-1}), rows, {8}, o),
                    Contains("gather_split_quantize: input must be a 2-D"));
  CHECK_THROWS_AS(gather_split_quantize(x, rows, {10}, o), c10::NotImplementedError);

  using torchmoe::ops::glu_backward_split_quantize;
  const torch::Tensor dy = torch::randn({8, 32});
  CHECK_THROWS_WITH(glu_backward_split_quantize(torch::randn({8, 20}), torch::randn({8, 40}), {},
                                                glu, false, {8}, o),
                    Contains("glu_backward_split_quantize: input's features must be a multiple of "
                             "16 (FP8 GEMM operands), got 40"));
  CHECK_THROWS_WITH(glu_backward_split_quantize(dy, z, {}, glu, true, {8}, o),
                    Contains("glu_backward_split_quantize: grad_scales needs scales"));
  CHECK_THROWS_WITH(glu_backward_split_quantize(dy.narrow(1, 0, 16), z, {}, glu, false, {8}, o),
                    Contains("grad_output must have shape [8, 32], got [8, 16]"));
  CHECK_THROWS_WITH(
      glu_backward_split_quantize(dy.to(torch::kHalf), z, {}, glu, false, {8}, o),
      Contains("grad_output must have the input's dtype Float and device cpu, got Half on cpu"));
  CHECK_THROWS_WITH(glu_backward_split_quantize(dy.t().contiguous().t(), z, {}, glu, false, {8}, o),
                    Contains("grad_output must be contiguous"));
  CHECK_THROWS_WITH(glu_backward_split_quantize(dy, z, {}, glu, false, {4, 5}, o),
                    Contains("m_splits must sum to at most the input's 8 rows"));
  CHECK_THROWS_AS(glu_backward_split_quantize(dy, z, {}, glu, false, {8}, o),
                  c10::NotImplementedError);

  using torchmoe::ops::quantize_weights;
  const std::vector<torch::Tensor> w = {torch::randn({16, 32}), torch::randn({16, 32})};
  CHECK_THROWS_WITH(quantize_weights(std::vector<torch::Tensor>{}, o),
                    Contains("needs at least one weight"));
  CHECK_THROWS_WITH(quantize_weights(std::vector<torch::Tensor>{torch::randn({8, 32})}, o),
                    Contains("out_features must be a multiple of 16 (the columnwise copy is "
                             "dgrad's operand), got 8"));
  CHECK_THROWS_WITH(quantize_weights(std::vector<torch::Tensor>{w[0], torch::randn({16, 48})}, o),
                    Contains("weights[1] must have shape [16, 32], got [16, 48]"));
  CHECK_THROWS_WITH(quantize_weights(std::vector<torch::Tensor>{w[0], w[1].to(torch::kHalf)}, o),
                    Contains("weights[1] must have weights[0]'s dtype Float, got Half"));
  CHECK_THROWS_WITH(quantize_weights(w, delayed), Contains("scale must be a defined tensor"));
  CHECK_THROWS_AS(quantize_weights(w, o), c10::NotImplementedError);

  const torch::Tensor history = torch::zeros({4, 2}), v = torch::ones({2});
  CHECK_THROWS_WITH(update_delayed_scaling(history.view({-1}), v, v, v, {}),
                    Contains("amax_history must be a 2-D"));
  CHECK_THROWS_WITH(update_delayed_scaling(torch::zeros({0, 2}), v, v, v, {}),
                    Contains("amax_history must have at least one row, got 0"));
  CHECK_THROWS_WITH(update_delayed_scaling(history, torch::ones({3}), v, v, {}),
                    Contains("amax must have shape [2]"));
  torchmoe::ops::DelayedScalingUpdateOptions bad_margin;
  bad_margin.margin = std::numeric_limits<double>::infinity();
  CHECK_THROWS_WITH(update_delayed_scaling(history, v, v, v, bad_margin),
                    Contains("margin must be finite"));
  CHECK_THROWS_AS(update_delayed_scaling(history, v, v, v, {}), c10::NotImplementedError);
}

TEST_CASE("split_quantize: sizes whose sum wraps around, oversized inputs and GLU types are errors",
          "[ops][quantize]") {
  using torchmoe::ops::split_quantize;
  SplitQuantizeOptions o;
  // 3·2^62 + 2^62 + 16 wraps to 16 in int64: it must not pass as a sum of at most 64 rows.
  const int64_t huge = int64_t{1} << 62;
  CHECK_THROWS_WITH(split_quantize(torch::randn({64, 16}), {huge, huge, huge, huge + 16}, o),
                    Contains("m_splits must sum to at most the input's 64 rows"));
  // The kernel counts 128x128 tiles and 1x128 scale rows in 32 bits (meta tensors: no memory).
  const auto meta = torch::TensorOptions().device(torch::kMeta);
  std::vector<int64_t> one_row(4096, 0);
  one_row[0] = 1;
  CHECK_THROWS_WITH(
      split_quantize(torch::empty({1, int64_t{1} << 22}, meta), one_row, o),
      Contains("in 4096 splits is too large: at most 2^31 - 1 - 3 * splits rows and 2^27"));
  CHECK_THROWS_WITH(split_quantize(torch::empty({int64_t{1} << 31, 16}, meta), {8}, o),
                    Contains("is too large"));
  // quantize_weights has the same limits: G·n rows.
  CHECK_THROWS_WITH(
      torchmoe::ops::quantize_weights(
          torchmoe::ops::GroupedTensors::stacked(torch::empty({4096, 1 << 19, 16}, meta)), o),
      Contains("quantize_weights: [2147483648, 16] in 4096 splits is too large"));
  // The GLU source's types are the CUDA kernels', checked before any kernel type is mapped.
  using torchmoe::ops::glu_split_quantize;
  const torchmoe::ops::GluOptions glu;
  CHECK_THROWS_WITH(glu_split_quantize(torch::randn({4, 64}, torch::kDouble), {}, glu, {4}, o),
                    Contains("input must be float32, float16 or bfloat16, got Double"));
  CHECK_THROWS_WITH(
      glu_split_quantize(torch::randn({4, 64}), torch::rand({4}, torch::kDouble), glu, {4}, o),
      Contains("scales must be float32 or the input's dtype Float, got Double"));
  torchmoe::ops::GluOptions clamped;
  clamped.activation = torchmoe::GluActivation::kClampedSwiGLU;
  clamped.limit = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(glu_split_quantize(torch::randn({4, 64}), {}, clamped, {4}, o),
                    Contains("the clamped SwiGLU needs a finite positive limit"));
  torchmoe::ops::DelayedScalingUpdateOptions big_margin;
  big_margin.margin = 200;
  const torch::Tensor v = torch::ones({2});
  CHECK_THROWS_WITH(
      torchmoe::ops::update_delayed_scaling(torch::zeros({4, 2}), v, v, v, big_margin),
      Contains("margin must be finite and leave fp8_max * 2^-margin a normal float, got 200"));
  CHECK_THROWS_WITH(torchmoe::SplitSizes::uniform(-1, 4, torch::kCPU),
                    Contains("SplitSizes::uniform: groups must be in [0, 2^31) and rows "
                             "non-negative, got -1"));
  // 2^62 sizes would not fit in memory (std::length_error before).
  CHECK_THROWS_WITH(torchmoe::SplitSizes::uniform(int64_t{1} << 62, 0, torch::kCPU),
                    Contains("got 4611686018427387904 and 0"));
}

TEST_CASE("split_quantize: device sizes beside host ones: the columnwise buffer holds their bound",
          "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  // The kernel reads the device sizes; a host copy that disagrees must not shrink the buffer it
  // writes (here the host says 16 rows, the device 64).
  const torch::Tensor x = torch::randn({64, 32}, torch::device(torch::kCUDA));
  const torchmoe::SplitSizes sizes(
      std::vector<int64_t>{16},
      torch::full({1}, 64, torch::dtype(torch::kLong).device(torch::kCUDA)));
  const SplitQuantized q = torchmoe::ops::split_quantize(x, sizes, SplitQuantizeOptions());
  CHECK(q.columnwise_data.numel() == 32 * round_up_columnwise(16));
  CHECK(q.columnwise_data.storage().nbytes() >= static_cast<size_t>(32 * round_up_columnwise(64)));
  torch::cuda::synchronize();
}
