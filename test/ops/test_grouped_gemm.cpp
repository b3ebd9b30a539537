// Grouped GEMM ops: the dispatch table, op-level validation, and wgrad write/accumulate semantics
// (CPU reference backend and CUDA cuBLASLt backend) against per-group float64 products.

#include <torchmoe/ops/grouped_gemm.h>

#include "test_utils.h"

using namespace torchmoe::test;
namespace ops = torchmoe::ops;
using Catch::Matchers::Contains;

namespace {

std::vector<torch::Tensor> make_weights(int64_t groups, int64_t out, int64_t in,
                                        const torch::TensorOptions& options) {
  std::vector<torch::Tensor> w;
  for (int64_t g = 0; g < groups; ++g) w.push_back(torch::randn({out, in}, options) * 0.1);
  return w;
}

// Checks wgrad (with accumulate on/off and bias grads) against float64 per-group products.
void check_wgrad(const torch::TensorOptions& options, torch::Dtype grad_dtype, bool accumulate,
                 const std::vector<int64_t>& splits, int64_t in, int64_t out, Tolerance tol,
                 ops::GemmBackendChoice backend = ops::GemmBackendChoice::kAuto) {
  INFO("accumulate=" << accumulate << " grad_dtype=" << grad_dtype
                     << " splits=" << torch::IntArrayRef(splits));
  int64_t rows = 0;
  for (int64_t s : splits) rows += s;
  const torch::Tensor x = torch::randn({rows, in}, options);
  const torch::Tensor dy =
      torch::randn({rows, out}, options) / std::sqrt(std::max<int64_t>(rows, 1));
  std::vector<torch::Tensor> dw, db;
  for (size_t g = 0; g < splits.size(); ++g) {
    dw.push_back(torch::full({out, in}, 0.25, options.dtype(grad_dtype)));
    db.push_back(torch::full({out}, 9.0, options));
  }
  ops::grouped_linear_wgrad(x, dy, splits, dw, accumulate, db, backend);
  int64_t offset = 0;
  for (size_t g = 0; g < splits.size(); ++g) {
    const torch::Tensor x_g = x.narrow(0, offset, splits[g]).to(torch::kFloat64);
    const torch::Tensor dy_g = dy.narrow(0, offset, splits[g]).to(torch::kFloat64);
    const torch::Tensor expected = dy_g.t().mm(x_g) + (accumulate ? 0.25 : 0.0);
    check_close(dw[g], expected, tol, "dW group " + std::to_string(g));
    check_close(db[g], dy_g.sum(0), tol, "db group " + std::to_string(g));
    offset += splits[g];
  }
}

}  // namespace

TEST_CASE("grouped GEMM dispatch table", "[ops]") {
  const ops::GemmShape shape{64, 64, 4};
  CHECK(ops::select_backend(torch::empty({1, 64}, torch::kFloat32), shape) ==
        ops::GemmBackend::kReference);
  CHECK(ops::select_backend(torch::empty({1, 64}, torch::kBFloat16), shape) ==
        ops::GemmBackend::kReference);
  REQUIRE_THROWS_AS(ops::select_backend(torch::empty({1, 64}, torch::kInt32), shape),
                    c10::NotImplementedError);
  REQUIRE_THROWS_WITH(ops::select_backend(torch::empty({1, 64}, torch::kMeta), shape),
                      Contains("no backend for meta tensors of dtype Float"));
  // A forced GPU backend on CPU tensors is refused, not silently ignored.
  REQUIRE_THROWS_WITH(ops::select_backend(torch::empty({1, 64}, torch::kBFloat16), shape,
                                          ops::GemmBackendChoice::kSm90),
                      Contains("sm90 backend runs on CUDA tensors only"));
}

TEST_CASE("grouped GEMM dispatch table on CUDA", "[ops][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto bf16 =
      torch::empty({1, 64}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
  const auto fp32 = bf16.to(torch::kFloat32);
  const ops::GemmShape good{64, 64, 4}, odd_k{64, 60, 4}, many{64, 64, 2000};
  const bool sm90 = sm90_available();
  CHECK(ops::select_backend(bf16, good) ==
        (sm90 ? ops::GemmBackend::kSm90 : ops::GemmBackend::kCublasLt));
  CHECK(ops::select_backend(bf16, good, ops::GemmBackendChoice::kCublasLt) ==
        ops::GemmBackend::kCublasLt);
  CHECK(ops::select_backend(fp32, good) == ops::GemmBackend::kCublasLt);
  CHECK(ops::select_backend(bf16, odd_k) == ops::GemmBackend::kCublasLt);
  CHECK(ops::select_backend(bf16, many) == ops::GemmBackend::kCublasLt);
  REQUIRE_THROWS_WITH(ops::select_backend(fp32, good, ops::GemmBackendChoice::kSm90),
                      Contains("bfloat16 and float16 operands only"));
  if (sm90) {
    CHECK(ops::select_backend(bf16, good, ops::GemmBackendChoice::kSm90) ==
          ops::GemmBackend::kSm90);
    REQUIRE_THROWS_WITH(ops::select_backend(bf16, odd_k, ops::GemmBackendChoice::kSm90),
                        Contains("positive multiples of 8"));
    REQUIRE_THROWS_WITH(ops::select_backend(bf16, many, ops::GemmBackendChoice::kSm90),
                        Contains("1 to 1024 groups"));
    const ops::GemmShape unaligned{64, 64, 4, /*aligned=*/false};
    REQUIRE_THROWS_WITH(ops::select_backend(bf16, unaligned, ops::GemmBackendChoice::kSm90),
                        Contains("16-byte boundary"));
  }
}

TEST_CASE("grouped GEMM ops reject bad operands", "[ops][errors]") {
  const auto w = make_weights(2, 4, 6, torch::kFloat32);
  const torch::Tensor x = torch::randn({5, 6});
  const std::vector<int64_t> splits = {2, 3};
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(torch::randn({6, 5}).t(), splits, w, {}),
                      Contains("grouped_linear_forward: input must be contiguous"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(x.unsqueeze(0), splits, w, {}),
                      Contains("input must be a 2-D [rows, features] tensor, got 3-D"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(x.to(torch::kLong), splits, w, {}),
                      Contains("input must have a floating dtype, got Long"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(x, splits, {w[0], w[1].to(torch::kFloat64)}, {}),
                      Contains("weights[1] must have the input's dtype Float, got Double"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(x, splits, {w[0], torch::randn({4, 5})}, {}),
                      Contains("weights[1] must have shape [4, 6], got [4, 5]"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(x, splits, w, {torch::zeros({4})}),
                      Contains("biases must be empty or hold one tensor per group (2), got 1"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(x, {2, 2}, w, {}),
                      Contains("m_splits must sum to the number of rows (5), got [2, 2] (sum 4)"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad(torch::randn({5, 3}), splits, w),
                      Contains("grad_output must have 4 features"));
  std::vector<torch::Tensor> dw = {torch::zeros({4, 6}, torch::kFloat16),
                                   torch::zeros({4, 6}, torch::kFloat16)};
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_wgrad(x, torch::randn({5, 4}), splits, dw, false, {}),
      Contains("weight_grads_out must have the input's dtype Float or float32, got Half"));
  const std::vector<torch::Tensor> dw16 = {torch::zeros({4, 6}, torch::kBFloat16),
                                           torch::zeros({4, 6}, torch::kBFloat16)};
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_wgrad(x.to(torch::kBFloat16), torch::randn({5, 4}, torch::kBFloat16),
                                splits, dw16, true, {}),
      Contains("accumulate requires float32 (or float64) weight_grads_out, got BFloat16"));
}

TEST_CASE("grouped GEMM CPU forward and dgrad vs float64", "[ops]") {
  torch::manual_seed(3);
  const std::vector<int64_t> splits = {3, 0, 8, 1};
  const auto w = make_weights(4, 5, 7, torch::kFloat64);
  std::vector<torch::Tensor> b;
  for (int g = 0; g < 4; ++g) b.push_back(torch::randn({5}, torch::kFloat64));
  const torch::Tensor x = torch::randn({12, 7}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({12, 5}, torch::kFloat64);
  const torch::Tensor y = ops::grouped_linear_forward(x, splits, w, b);
  const torch::Tensor dx = ops::grouped_linear_dgrad(dy, splits, w);
  int64_t offset = 0;
  for (int g = 0; g < 4; ++g) {
    check_close(y.narrow(0, offset, splits[g]),
                torch::linear(x.narrow(0, offset, splits[g]), w[g], b[g]), {1e-12, 1e-12}, "y");
    check_close(dx.narrow(0, offset, splits[g]), dy.narrow(0, offset, splits[g]).mm(w[g]),
                {1e-12, 1e-12}, "dx");
    offset += splits[g];
  }
}

TEST_CASE("grouped GEMM CPU wgrad writes, accumulates, zero-fills empty groups", "[ops]") {
  torch::manual_seed(4);
  const bool accumulate = GENERATE(false, true);
  check_wgrad(torch::kFloat32, torch::kFloat32, accumulate, {5, 0, 9}, 6, 4,
              tolerance_for(torch::kFloat32));
  check_wgrad(torch::kFloat64, torch::kFloat32, accumulate, {0, 0}, 6, 4,
              tolerance_for(torch::kFloat32));
}

TEST_CASE("grouped GEMM cuBLASLt wgrad into fp32 main-grad and bias grads", "[ops][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  torch::manual_seed(5);
  const bool accumulate = GENERATE(false, true);
  const auto dtype = GENERATE(torch::kBFloat16, torch::kFloat16, torch::kFloat32);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
  // Same-dtype output fuses the bias gradient into the GEMM epilogue; fp32 output cannot.
  // Accumulation is into fp32 main-grad only.
  const auto grad_dtype = GENERATE(true, false) && !accumulate ? dtype : torch::kFloat32;
  check_wgrad(cuda, grad_dtype, accumulate, {64, 0, 17, 1, 300, 0, 7, 128}, 96, 40,
              tolerance_for(dtype), ops::GemmBackendChoice::kCublasLt);
}

TEST_CASE("grouped GEMM on CUDA rejects float64 as not implemented", "[ops][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto cuda64 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat64);
  REQUIRE_THROWS_AS(ops::grouped_linear_forward(torch::randn({2, 4}, cuda64), {2},
                                                {torch::randn({3, 4}, cuda64)}, {}),
                    c10::NotImplementedError);
}

TEST_CASE("GroupSplits reads CPU tensors at once and keeps CUDA tensors", "[ops]") {
  const ops::GroupSplits cpu(torch::tensor({3, 0, 5}, torch::kInt16));
  CHECK_FALSE(cpu.on_device());
  CHECK(cpu.host().vec() == std::vector<int64_t>{3, 0, 5});
  REQUIRE_THROWS_WITH(ops::GroupSplits(torch::ones({2, 2}, torch::kLong)),
                      Contains("m_splits must be a 1-D tensor, got 2-D"));
  REQUIRE_THROWS_WITH(ops::GroupSplits(torch::ones({2}, torch::kFloat32)),
                      Contains("m_splits must have an integer dtype, got Float"));
}

TEST_CASE("GroupSplits keeps CUDA tensors on the device", "[ops][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const ops::GroupSplits cuda(
      torch::tensor({3, 0, 5}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt32)));
  CHECK(cuda.on_device());
  CHECK(cuda.size() == 3);
  CHECK(cuda.to_host() == std::vector<int64_t>{3, 0, 5});
}
