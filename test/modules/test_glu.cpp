// SwiGLU family (modules/glu.h): forward, input and scale gradients against an independent float64
// reference (explicit de-interleave indices + autograd), on CPU and CUDA; bad input.
//
// Axes: activation {swiglu, clamped (default, limit 0.75 with offsets 1 and 0)} × scaled ×
// shape {(17,64), (13,100), (71,192), (5,7,128), (1024,2048), (0,64)} × interleave {none, 32} ×
// grads on/off × dtype (CPU fp32/fp64/bf16; CUDA fp32/fp16/bf16 with fp32 or data-dtype scales).

#include <torchmoe/torchmoe.h>

#include "test_utils.h"

using namespace torchmoe::test;
using Catch::Matchers::Contains;

namespace {

struct GluCase {
  bool clamped = false;
  bool scaled = true;
  double limit = 7.0, alpha = 1.702, offset = 1.0;
  std::optional<int64_t> interleave;
};

std::string describe(const GluCase& c, const std::vector<int64_t>& shape, torch::Dtype dtype,
                     torch::Dtype scale_dtype) {
  std::ostringstream s;
  s << (c.scaled ? "scaled " : "") << (c.clamped ? "clamped_swiglu" : "swiglu")
    << " shape=" << torch::IntArrayRef(shape) << " dtype=" << dtype << " scales=" << scale_dtype
    << " limit=" << c.limit << " offset=" << c.offset
    << " interleave=" << (c.interleave ? std::to_string(*c.interleave) : "none");
  return s.str();
}

// Positions of a_j and b_j within a row of width 2H, computed independently of the code under test.
std::pair<torch::Tensor, torch::Tensor> glu_indices(int64_t hidden, std::optional<int64_t> g) {
  std::vector<int64_t> a(hidden), b(hidden);
  for (int64_t j = 0; j < hidden; ++j) {
    a[j] = g ? (j / *g) * 2 * *g + j % *g : j;
    b[j] = g ? a[j] + *g : j + hidden;
  }
  return {torch::tensor(a), torch::tensor(b)};
}

struct GluReference {
  torch::Tensor output, grad_input, grad_scales;
};

GluReference reference(const torch::Tensor& input, const torch::Tensor& scales,
                       const torch::Tensor& grad_output, const GluCase& c) {
  torch::AutoGradMode enable(true);
  const int64_t hidden = input.size(-1) / 2;
  const torch::Tensor x = input.detach().to(torch::kFloat64).requires_grad_(true);
  const auto [ai, bi] = glu_indices(hidden, c.interleave);
  const torch::Tensor a = x.index_select(-1, ai.to(x.device()));
  const torch::Tensor b = x.index_select(-1, bi.to(x.device()));
  torch::Tensor y;
  if (c.clamped) {
    const torch::Tensor ac = torch::clamp_max(a, c.limit);
    y = ac * torch::sigmoid(c.alpha * ac) * (torch::clamp(b, -c.limit, c.limit) + c.offset);
  } else {
    y = a * torch::sigmoid(a) * b;
  }
  torch::Tensor s;
  if (c.scaled) {
    s = scales.detach().to(torch::kFloat64).requires_grad_(true);
    y = y * s.unsqueeze(-1);
  }
  (y * grad_output.to(torch::kFloat64)).sum().backward();
  return {y.detach(), x.grad(), c.scaled ? s.grad() : torch::Tensor()};
}

Tolerance glu_tolerance(torch::Dtype dtype) {
  switch (dtype) {
    case torch::kFloat64:
      return {1e-12, 1e-12};
    case torch::kFloat32:
      return {5e-5, 5e-5};  // TE's test_scaled_activation fp32 tolerance
    default:
      return tolerance_for(dtype);
  }
}

void run_glu_case(const GluCase& c, std::vector<int64_t> shape, torch::Device device,
                  torch::Dtype dtype, torch::Dtype scale_dtype, bool input_grad, bool scale_grad) {
  if (c.interleave && (shape.back() / 2) % *c.interleave != 0) return;  // layout impossible
  INFO(describe(c, shape, dtype, scale_dtype)
       << " input_grad=" << input_grad << " scale_grad=" << scale_grad);
  torch::manual_seed(17);
  const auto options = torch::TensorOptions().device(device);
  const torch::Tensor x = (torch::randn(shape, options) * 2).to(dtype).requires_grad_(input_grad);
  std::vector<int64_t> row_shape(shape.begin(), shape.end() - 1);
  const torch::Tensor scales =
      torch::rand(row_shape, options).to(scale_dtype).requires_grad_(scale_grad);
  shape.back() /= 2;
  const torch::Tensor dy = torch::randn(shape, options).to(dtype);

  torch::Tensor y;
  torchmoe::SwiGLUOptions swi;
  swi.glu_interleave_size(c.interleave);
  torchmoe::ClampedSwiGLUOptions clamped;
  clamped.limit(c.limit).alpha(c.alpha).offset(c.offset).glu_interleave_size(c.interleave);
  if (c.scaled) {
    y = c.clamped ? torchmoe::ScaledClampedSwiGLU(clamped)(x, scales)
                  : torchmoe::ScaledSwiGLU(swi)(x, scales);
  } else {
    y = c.clamped ? torchmoe::ClampedSwiGLU(clamped)(x) : torchmoe::SwiGLU(swi)(x);
  }
  REQUIRE(y.scalar_type() == dtype);
  const GluReference ref = reference(x, scales, dy, c);
  const Tolerance tol = glu_tolerance(dtype);
  check_close(y, ref.output, tol, "output");
  if (!input_grad && !(c.scaled && scale_grad)) return;
  y.backward(dy);
  if (input_grad) check_close(x.grad(), ref.grad_input, tol, "grad_input");
  if (c.scaled && scale_grad) {
    REQUIRE(scales.grad().scalar_type() == scale_dtype);
    check_close(scales.grad(), ref.grad_scales, glu_tolerance(scale_dtype), "grad_scales");
  }
  if (!c.scaled) CHECK_FALSE(scales.grad().defined());
}

GluCase make_case(int activation, bool scaled, std::optional<int64_t> interleave) {
  GluCase c;
  c.clamped = activation > 0;
  if (activation >= 2) c.limit = 0.75;  // most values clamped: the masks matter
  if (activation == 3) c.offset = 0.0;
  c.scaled = scaled;
  c.interleave = interleave;
  return c;
}

// Edge shapes: rows of 1 to 71 (5 × 7 rows in 3-D), H = 32 (one 16-byte vector per lane and
// less), 50 (no 16-byte vectors), 96, 64, and no rows at all.
const std::vector<std::vector<int64_t>> kShapes = {
    {17, 64}, {13, 100}, {71, 192}, {5, 7, 128}, {0, 64}};
// CUDA only (the CPU path is the reference's own arithmetic): a grid of many blocks.
const std::vector<int64_t> kWideRows = {1024, 2048};
// CUDA only: H = 4224 spans 17 chunks of 16-byte vectors in bf16 (the forward's work items), the
// last one a half chunk.
const std::vector<int64_t> kLongRows = {37, 8448};

}  // namespace

TEST_CASE("SwiGLU family on CPU vs float64 reference", "[modules][glu]") {
  const int activation = GENERATE(0, 1, 2, 3);  // swiglu, clamped, limit 0.75, limit 0.75 offset 0
  const bool scaled = GENERATE(false, true);
  // 1: GPT-OSS's alternating columns; 8: finer than a 16-byte vector of bf16 or fp32.
  const auto interleave = GENERATE(std::optional<int64_t>{}, std::optional<int64_t>{1},
                                   std::optional<int64_t>{8}, std::optional<int64_t>{32});
  const auto dtype = GENERATE(torch::kFloat32, torch::kFloat64, torch::kBFloat16);
  const bool input_grad = GENERATE(true, false);
  const bool scale_grad = GENERATE(true, false);
  for (const auto& shape : kShapes) {
    run_glu_case(make_case(activation, scaled, interleave), shape, torch::kCPU, dtype, dtype,
                 input_grad, scale_grad);
  }
}

TEST_CASE("SwiGLU family fused CUDA kernels vs float64 reference", "[modules][glu][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const int activation = GENERATE(0, 1, 2, 3);
  const bool scaled = GENERATE(false, true);
  const auto interleave = GENERATE(std::optional<int64_t>{}, std::optional<int64_t>{1},
                                   std::optional<int64_t>{8}, std::optional<int64_t>{32});
  const auto dtype = GENERATE(torch::kFloat32, torch::kFloat16, torch::kBFloat16);
  const bool fp32_scales = GENERATE(true, false);
  const bool input_grad = GENERATE(true, false);
  const bool scale_grad = GENERATE(true, false);
  for (const auto& shape : kShapes) {
    run_glu_case(make_case(activation, scaled, interleave), shape, torch::kCUDA, dtype,
                 fp32_scales ? torch::kFloat32 : dtype, input_grad, scale_grad);
  }
  for (const auto& shape : {kWideRows, kLongRows}) {
    run_glu_case(make_case(activation, scaled, interleave), shape, torch::kCUDA, dtype,
                 fp32_scales ? torch::kFloat32 : dtype, input_grad, scale_grad);
  }
}

TEST_CASE("SwiGLU CUDA kernel takes the scalar path for unaligned rows", "[modules][glu][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  // H = 50 and 4225 are not multiples of the 8-wide bf16 vector (4225: 133 chunks of 32 single
  // elements, the last one partly past the row); a sliced input is not 16-byte aligned.
  const GluCase c = make_case(1, true, std::nullopt);
  run_glu_case(c, {33, 100}, torch::kCUDA, torch::kBFloat16, torch::kFloat32, true, true);
  run_glu_case(c, {9, 8450}, torch::kCUDA, torch::kBFloat16, torch::kFloat32, true, true);
  const auto bf16 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor big = torch::randn({9 * 64 + 1}, bf16);
  const torch::Tensor x = big.narrow(0, 1, 9 * 64).view({9, 64});  // offset by one element
  const torch::Tensor y = torchmoe::functional::swiglu(x);
  const torch::Tensor ref = torchmoe::functional::swiglu(x.cpu().to(torch::kFloat32));
  check_close(y, ref, tolerance_for(torch::kBFloat16), "unaligned output");
}

TEST_CASE("SwiGLU family rejects bad input", "[modules][glu][errors]") {
  const torch::Tensor x = torch::randn({4, 6, 64});
  SECTION("odd last dimension") {
    REQUIRE_THROWS_WITH(torchmoe::functional::swiglu(torch::randn({4, 7})),
                        Contains("input's last dimension must be even") && Contains("got 7"));
    REQUIRE_THROWS_WITH(torchmoe::functional::swiglu(torch::Tensor()),
                        Contains("swiglu: input must be a defined tensor [..., 2H]"));
    // H = 0: no halves to split (the reference's reshape divided by it).
    REQUIRE_THROWS_WITH(torchmoe::functional::swiglu(torch::randn({4, 0})),
                        Contains("must be even and positive") && Contains("got 0"));
  }
  SECTION("scales of the wrong shape") {
    REQUIRE_THROWS_WITH(torchmoe::functional::scaled_swiglu(x, torch::rand({4})),
                        Contains("scales must have shape [4, 6]") && Contains("got [4]"));
  }
  SECTION("scales on another device") {
    REQUIRE_THROWS_WITH(torchmoe::functional::scaled_swiglu(x, torch::empty({4, 6}, torch::kMeta)),
                        Contains("scales must be on cpu like the input, got meta"));
  }
  SECTION("non-floating scales") {
    REQUIRE_THROWS_WITH(torchmoe::functional::scaled_swiglu(x, torch::ones({4, 6}, torch::kLong)),
                        Contains("scales must have a floating dtype, got Long"));
  }
  SECTION("interleave that does not divide H") {
    REQUIRE_THROWS_WITH(
        torchmoe::functional::swiglu(torch::randn({2, 160}),
                                     torchmoe::SwiGLUOptions().glu_interleave_size(64)),
        Contains("glu_interleave_size must be a positive divisor of H=80, got 64"));
    REQUIRE_THROWS_WITH(
        torchmoe::functional::swiglu(x, torchmoe::SwiGLUOptions().glu_interleave_size(5)),
        Contains("glu_interleave_size must be a positive divisor of H=32, got 5"));
  }
  SECTION("interleave that is not positive") {
    REQUIRE_THROWS_WITH(
        torchmoe::functional::swiglu(x, torchmoe::SwiGLUOptions().glu_interleave_size(0)),
        Contains("glu_interleave_size must be positive when given, got 0"));
  }
  SECTION("non-floating input") {
    REQUIRE_THROWS_WITH(torchmoe::functional::swiglu(torch::ones({2, 4}, torch::kInt)),
                        Contains("input must have a floating dtype, got Int"));
  }
}

TEST_CASE("SwiGLU modules print their options", "[modules][glu]") {
  std::ostringstream s;
  s << torchmoe::ScaledSwiGLU(torchmoe::SwiGLUOptions().glu_interleave_size(32)) << " "
    << torchmoe::ClampedSwiGLU();
  CHECK(s.str() ==
        "torchmoe::ScaledSwiGLU(glu_interleave_size=32) "
        "torchmoe::ClampedSwiGLU(limit=7, alpha=1.702, offset=1)");
}
