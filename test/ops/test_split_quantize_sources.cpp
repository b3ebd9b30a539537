// The split-quantize kernel's other sources (ops/quantize.h): rows gathered from the tokens
// through a routing map, and the SwiGLU and its backward computed inside the cast, each against
// the unfused ops followed by split_quantize and against the reference quantizer.

#include <string>
#include <vector>

#include "ops/split_quantize_test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

// Token rows in expert order: each token picked 0 to 3 times, two indices out of range (-1, a
// padding row's, and one past the end: their rows read as zeros, as a zero row of the gathered
// copy does); host and device splits with empty, odd and multi-tile splits, summing to all the
// gathered rows or to fewer; K not a multiple of 128.
TEST_CASE("gather_split_quantize equals index_select then split_quantize",
          "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const torch::Dtype dtype = GENERATE(torch::kBFloat16, torch::kHalf, torch::kFloat);
  const bool device_splits = GENERATE(false, true);
  const std::vector<int64_t> sizes = GENERATE(std::vector<int64_t>{131, 0, 256, 17, 300},
                                              std::vector<int64_t>{300, 5, 129, 0, 0, 256, 1});
  INFO("scaling " << scaling_name(scaling) << ", dtype " << dtype << ", device splits "
                  << device_splits << ", " << sizes.size() << " splits");
  const int64_t tokens = 301, rows = 704, k = 160;
  const torch::Tensor x = make_input(tokens, k, dtype, 43);
  const auto gen = at::make_generator<at::CPUGeneratorImpl>(47);
  torch::Tensor index = torch::randint(0, tokens, {rows}, gen, torch::kLong);
  index[500] = tokens + 7;
  index[133] = -1;
  // The out-of-range indices pick an appended zero row (+0: a product with 0 could give -0).
  const torch::Tensor source = torch::where(index >= 0, index, tokens).clamp_max(tokens);
  const torch::Tensor gathered =
      torch::cat({x, torch::zeros({1, k}, x.options())}).index_select(0, source.cuda());
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized two_ops = run(gathered, sizes, o, scale);
  const torchmoe::SplitSizes splits =
      device_splits ? torchmoe::SplitSizes(torch::tensor(sizes, torch::kInt).cuda())
                    : torchmoe::SplitSizes(sizes);
  const SplitQuantized fused =
      torchmoe::ops::gather_split_quantize(x, index.cuda(), splits, o, scale);
  check_same(fused, two_ops, sizes, rows, k);
}

// The fused activation + cast (fc2's input in an FP8 GroupedMLP) against the two ops it replaces:
// bit for bit equal to glu_forward then split_quantize, and, through the activation glu_forward
// wrote, to the reference quantizer. Axes: every scaling; bf16/fp16/fp32; SwiGLU in halves and
// GLU-interleaved, ClampedSwiGLU; scales float32, in the input's dtype, or none; host and device
// splits (an empty split, odd and multi-tile ones, K not a multiple of 128).
TEST_CASE("glu_split_quantize equals glu_forward then split_quantize", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const torch::Dtype dtype = GENERATE(torch::kBFloat16, torch::kHalf, torch::kFloat);
  // SwiGLU halves, interleaved by 32, clamped, clamped interleaved by 1 (GPT-OSS: the GLU and the
  // quantize as two launches inside the op)
  const int variant = GENERATE(0, 1, 2, 3);
  const int scale_kind = GENERATE(0, 1, 2);  // float32 scales, the input's dtype, none
  const bool device_splits = GENERATE(false, true);
  const std::vector<int64_t> sizes = {131, 0, 256, 17, 300};
  const int64_t rows = 704, k = 160;
  INFO("scaling " << scaling_name(scaling) << ", dtype " << dtype << ", variant " << variant
                  << ", scales " << scale_kind << ", device splits " << device_splits);
  torchmoe::ops::GluOptions glu;
  if (variant == 1) glu.interleave = 32;
  if (variant >= 2) glu.activation = torchmoe::GluActivation::kClampedSwiGLU;
  if (variant == 3) glu.interleave = 1;
  // Pre-activations of a few units, some past the clamp limit (7).
  const torch::Tensor z = make_input(rows, 2 * k, dtype, 31) * 4;
  torch::Tensor scales;
  if (scale_kind < 2) {
    scales = torch::rand({rows}, torch::TensorOptions().device(torch::kCUDA));
    if (scale_kind == 1) scales = scales.to(dtype);
  }
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const torch::Tensor h = torchmoe::ops::glu_forward(z, scales, glu);
  const SplitQuantized two_ops = run(h, sizes, o, scale);
  const torchmoe::SplitSizes splits =
      device_splits ? torchmoe::SplitSizes(torch::tensor(sizes, torch::kInt).cuda())
                    : torchmoe::SplitSizes(sizes);
  const SplitQuantized fused = torchmoe::ops::glu_split_quantize(z, scales, glu, splits, o, scale);
  check_same(fused, two_ops, sizes, rows, k);
  check_against_reference(fused, reference(h, sizes, o, scale), sizes, o, rows, k);
}

// Current scaling's amax visits compute the activation too: many waves, one split holding most
// rows, repeated.
TEST_CASE("glu_split_quantize: many waves of tiles", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling = GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kBlock1x128);
  const std::vector<int64_t> sizes = {9000, 0, 37, 4000};
  const int64_t rows = 13037, k = 1024;
  const torch::Tensor z = make_input(rows, 2 * k, torch::kBFloat16, 37);
  const torch::Tensor probs = torch::rand({rows}, torch::TensorOptions().device(torch::kCUDA));
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torchmoe::ops::GluOptions glu;
  const SplitQuantized expected =
      run(torchmoe::ops::glu_forward(z, probs, glu), sizes, o, torch::Tensor());
  for (int repeat = 0; repeat < 3; ++repeat) {
    check_same(torchmoe::ops::glu_split_quantize(z, probs, glu, sizes, o), expected, sizes, rows,
               k);
  }
}

// A fused grad_scales against glu_backward's float64 reference (the CPU one): within fp32
// summation error of the row's Σ_j |dy_j·act(a_j)·gate(b_j)| (the sum's terms cancel, so its
// order moves it by more than a relative tolerance of the result allows), plus one rounding to
// the scales' dtype. Missing or doubled terms (each about 1/K of that sum) stay far outside.
void check_grad_scales(const torch::Tensor& actual, const torch::Tensor& dy, const torch::Tensor& z,
                       const torch::Tensor& scales, const torchmoe::ops::GluOptions& glu) {
  const torch::Tensor z64 = z.cpu().to(torch::kDouble), dy64 = dy.cpu().to(torch::kDouble);
  const torch::Tensor expected =
      torchmoe::ops::glu_backward(dy64, z64, scales.cpu().to(torch::kDouble), glu, true)
          .grad_scales;
  const torch::Tensor magnitude = (dy64 * torchmoe::ops::glu_forward(z64, {}, glu)).abs().sum(-1);
  const double rounding = scales.scalar_type() == torch::kBFloat16 ? 0x1p-8
                          : scales.scalar_type() == torch::kHalf   ? 0x1p-11
                                                                   : 0.0;
  // Compared in double, except that a sum past the dtype's range must be its infinity.
  const torch::Tensor rounded = expected.to(scales.scalar_type()).to(torch::kDouble);
  const torch::Tensor a = actual.cpu().to(torch::kDouble);
  const torch::Tensor bound = 1e-4 * magnitude + rounding * expected.abs();
  CHECK(actual.scalar_type() == scales.scalar_type());
  CHECK(((a == rounded) | ((a - expected).abs() <= bound)).all().item<bool>());
}

// glu_backward_split_quantize's fused launch at any size (the op takes the two ops below 8 waves
// of tiles, which these shapes are).
torchmoe::ops::GluGradsQuantized fused_launch(const torch::Tensor& dy, const torch::Tensor& z,
                                              const torch::Tensor& scales,
                                              const torchmoe::ops::GluOptions& glu,
                                              bool grad_scales, const torchmoe::SplitSizes& splits,
                                              const SplitQuantizeOptions& o,
                                              const torch::Tensor& scale) {
  return torchmoe::ops::detail::glu_backward_split_quantize(dy, z, scales, glu, grad_scales, splits,
                                                            o, scale, torch::Tensor(), 0.0);
}

// The fused activation gradient + cast (fc1's output gradient in an FP8 GroupedMLP's backward)
// against the two ops it replaces: the FP8 copies, scales and amax bit for bit those of
// glu_backward then split_quantize, and through the gradient glu_backward wrote, the reference
// quantizer's; grad_scales glu_backward's up to its fp32 sum's order. Axes: as the forward's
// above, with K = 96 (the quantized width 192: one and a half tiles, the first holding a and b
// columns) and 256 (a and b tiles paired), and splits ending before the last rows (their
// grad_scales are 0).
TEST_CASE("glu_backward_split_quantize equals glu_backward then split_quantize",
          "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling =
      GENERATE(QuantizeScaling::kCurrent, QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128,
               QuantizeScaling::kBlock128x128);
  const torch::Dtype dtype = GENERATE(torch::kBFloat16, torch::kHalf, torch::kFloat);
  // SwiGLU halves, interleaved by 32, clamped, clamped interleaved by 1 (GPT-OSS: the GLU and the
  // quantize as two launches inside the op)
  const int variant = GENERATE(0, 1, 2, 3);
  const int scale_kind = GENERATE(0, 1, 2);  // float32 scales, the input's dtype, none
  const bool device_splits = GENERATE(false, true);
  const std::vector<int64_t> sizes = {131, 0, 256, 17, 300};
  // K = 96: a and b blocks are not whole tiles, so each tile computes its own pieces; K = 256
  // (and an interleave of 128): 16-bit types pair each a tile with its b tile.
  const int64_t k = GENERATE(96, 256);
  const int64_t rows = 704;
  INFO("K " << k << ", scaling " << scaling_name(scaling) << ", dtype " << dtype << ", variant "
            << variant << ", scales " << scale_kind << ", device splits " << device_splits);
  torchmoe::ops::GluOptions glu;
  if (variant == 1) glu.interleave = k == 256 ? 128 : 32;
  if (variant >= 2) glu.activation = torchmoe::GluActivation::kClampedSwiGLU;
  if (variant == 3) glu.interleave = 1;
  const torch::Tensor z = make_input(rows, 2 * k, dtype, 41) * 4;  // some past the clamp (7)
  const torch::Tensor dy = make_input(rows, k, dtype, 43);
  torch::Tensor scales;
  if (scale_kind < 2) {
    scales = torch::rand({rows}, torch::TensorOptions().device(torch::kCUDA));
    if (scale_kind == 1) scales = scales.to(dtype);
  }
  const bool grad_scales = scales.defined();
  SplitQuantizeOptions o;
  o.scaling = scaling;
  o.format = Fp8Format::kE5M2;  // the gradients' format under HYBRID
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const torchmoe::ops::GluGrads two = torchmoe::ops::glu_backward(dy, z, scales, glu, grad_scales);
  const SplitQuantized two_ops = run(two.grad_input, sizes, o, scale);
  const torchmoe::SplitSizes splits =
      device_splits ? torchmoe::SplitSizes(torch::tensor(sizes, torch::kInt).cuda())
                    : torchmoe::SplitSizes(sizes);
  const torchmoe::ops::GluGradsQuantized fused =
      fused_launch(dy, z, scales, glu, grad_scales, splits, o, scale);
  check_same(fused.grad_input, two_ops, sizes, rows, 2 * k);
  check_against_reference(fused.grad_input, reference(two.grad_input, sizes, o, scale), sizes, o,
                          rows, 2 * k);
  REQUIRE(fused.grad_scales.defined() == grad_scales);
  if (grad_scales) {
    check_grad_scales(fused.grad_scales, dy, z, scales, glu);
    // Splits that end 9 rows early: those rows are not visited (under current scaling, the two
    // ops' path masks them, against the host's sum or the device's).
    const std::vector<int64_t> short_sizes = {131, 0, 256, 17, 291};
    const torchmoe::SplitSizes short_splits =
        device_splits ? torchmoe::SplitSizes(torch::tensor(short_sizes, torch::kInt).cuda())
                      : torchmoe::SplitSizes(short_sizes);
    const torch::Tensor part = fused_launch(dy, z, scales, glu, true, short_splits, o, scale)
                                   .grad_scales.to(torch::kFloat);
    CHECK(torch::equal(part.narrow(0, 0, 695),
                       fused.grad_scales.to(torch::kFloat).narrow(0, 0, 695)));
    CHECK(torch::equal(part.narrow(0, 695, 9), torch::zeros({9}, part.options())));
    if (device_splits) {
      // Garbage device sizes clamp (a negative one to 0, the sum to the rows): every row visited.
      const torch::Tensor wild = torch::tensor({131, -5, 256, 17, 400}, torch::kInt).cuda();
      const torch::Tensor all =
          fused_launch(dy, z, scales, glu, true, torchmoe::SplitSizes(wild), o, scale)
              .grad_scales.to(torch::kFloat);
      CHECK(torch::equal(all, fused.grad_scales.to(torch::kFloat)));
    }
  }
}

// The fused launch over several waves of tiles (paired a and b tiles, one split holding most
// rows), repeated: the same bytes as the two ops and the scale gradient summed from every tile
// column. (Under current scaling the op is the two ops.) Then the op itself at this size, below
// 8 waves on an H100 or H200: the two ops' bytes and glu_backward's scale gradient.
TEST_CASE("glu_backward_split_quantize: many waves of tiles", "[ops][quantize][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const QuantizeScaling scaling = GENERATE(QuantizeScaling::kDelayed, QuantizeScaling::kBlock1x128);
  const std::vector<int64_t> sizes = {9000, 0, 37, 4000};
  const int64_t rows = 13037, k = 768;
  const torch::Tensor z = make_input(rows, 2 * k, torch::kBFloat16, 47);
  const torch::Tensor dy = make_input(rows, k, torch::kBFloat16, 53);
  const torch::Tensor probs = torch::rand({rows}, torch::TensorOptions().device(torch::kCUDA));
  SplitQuantizeOptions o;
  o.scaling = scaling;
  const torchmoe::ops::GluOptions glu;
  const torch::Tensor scale = scale_argument(scaling, static_cast<int64_t>(sizes.size()));
  const SplitQuantized expected =
      run(torchmoe::ops::glu_backward(dy, z, probs, glu, false).grad_input, sizes, o, scale);
  for (int repeat = 0; repeat < 3; ++repeat) {
    const torchmoe::ops::GluGradsQuantized fused =
        fused_launch(dy, z, probs, glu, true, sizes, o, scale);
    check_same(fused.grad_input, expected, sizes, rows, 2 * k);
    check_grad_scales(fused.grad_scales, dy, z, probs, glu);
  }
  const torchmoe::ops::GluGradsQuantized op =
      torchmoe::ops::glu_backward_split_quantize(dy, z, probs, glu, true, sizes, o, scale);
  check_same(op.grad_input, expected, sizes, rows, 2 * k);
  CHECK(torch::equal(op.grad_scales,
                     torchmoe::ops::glu_backward(dy, z, probs, glu, true).grad_scales));
}
