// Grouped GEMM ops: the planning step (dispatch table, split checks, host/device copies), op-level
// validation, and wgrad write/accumulate semantics (CPU reference backend and CUDA cuBLASLt
// backend) against per-group float64 products.

#include <torchmoe/ops/grouped_gemm.h>

#include "test_utils.h"

using namespace torchmoe::test;
namespace ops = torchmoe::ops;
using Catch::Matchers::Contains;

namespace {

// One layer's plan for `input`.
ops::GemmPlan plan_for(const torch::Tensor& input, int64_t n, int64_t k,
                       const torchmoe::SplitSizes& splits,
                       torchmoe::GemmBackend backend = torchmoe::GemmBackend::kAuto) {
  return ops::plan_grouped_gemms("test", input, {ops::GemmShape{n, k, splits.size()}}, splits,
                                 backend)
      .front();
}

std::vector<torch::Tensor> make_weights(int64_t groups, int64_t out, int64_t in,
                                        const torch::TensorOptions& options) {
  std::vector<torch::Tensor> w;
  for (int64_t g = 0; g < groups; ++g) w.push_back(torch::randn({out, in}, options) * 0.1);
  return w;
}

// Checks wgrad (with accumulate on/off and bias grads) against float64 per-group products.
void check_wgrad(const torch::TensorOptions& options, torch::Dtype grad_dtype, bool accumulate,
                 const std::vector<int64_t>& splits, int64_t in, int64_t out, Tolerance tol,
                 torchmoe::GemmBackend backend = torchmoe::GemmBackend::kAuto) {
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
  ops::grouped_linear_wgrad(plan_for(x, out, in, splits, backend), x, dy, dw, accumulate, db);
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

// The backend a plan picks for a layer of this shape on `input`.
torchmoe::GemmBackend backend_for(const torch::Tensor& input, const ops::GemmShape& shape,
                                  torchmoe::GemmBackend choice = torchmoe::GemmBackend::kAuto) {
  const std::vector<int64_t> splits(shape.groups, 0);
  return ops::plan_grouped_gemms("test", input.narrow(0, 0, 0), {shape}, splits, choice)
      .front()
      .backend;
}

TEST_CASE("grouped GEMM dispatch table", "[ops]") {
  const ops::GemmShape shape{64, 64, 4};
  CHECK(backend_for(torch::empty({1, 64}, torch::kFloat32), shape) ==
        torchmoe::GemmBackend::kReference);
  CHECK(backend_for(torch::empty({1, 64}, torch::kBFloat16), shape) ==
        torchmoe::GemmBackend::kReference);
  REQUIRE_THROWS_AS(backend_for(torch::empty({1, 64}, torch::kInt32), shape),
                    c10::NotImplementedError);
  REQUIRE_THROWS_WITH(backend_for(torch::empty({1, 64}, torch::kMeta), shape),
                      Contains("test: no grouped GEMM backend for meta tensors of dtype Float"));
  // A forced GPU backend on CPU tensors is refused, not silently ignored.
  REQUIRE_THROWS_WITH(
      backend_for(torch::empty({1, 64}, torch::kBFloat16), shape, torchmoe::GemmBackend::kSm90),
      Contains("test: the sm90 grouped GEMM backend runs on CUDA tensors only"));
}

TEST_CASE("grouped GEMM dispatch table on CUDA", "[ops][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto bf16 =
      torch::empty({1, 64}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16));
  const auto fp32 = bf16.to(torch::kFloat32);
  const ops::GemmShape good{64, 64, 4}, odd_k{64, 60, 4}, many{64, 64, 2000};
  const bool sm90 = sm90_available();
  const bool grouped = gemm_backend_skip_reason(torchmoe::GemmBackend::kCublasLtGrouped).empty();
  constexpr auto kCublasLt = torchmoe::GemmBackend::kCublasLt;
  constexpr auto kSm90 = torchmoe::GemmBackend::kSm90;
  constexpr auto kGrouped = torchmoe::GemmBackend::kCublasLtGrouped;
  // kAuto's order for bf16/fp16: sm90, cuBLASLt grouped, per-group cuBLASLt.
  const torchmoe::GemmBackend best = sm90      ? torchmoe::GemmBackend::kSm90
                                     : grouped ? torchmoe::GemmBackend::kCublasLtGrouped
                                               : torchmoe::GemmBackend::kCublasLt;
  CHECK(backend_for(bf16, good) == best);
  CHECK(backend_for(bf16, good, kCublasLt) == torchmoe::GemmBackend::kCublasLt);
  CHECK(backend_for(fp32, good) == torchmoe::GemmBackend::kCublasLt);
  CHECK(backend_for(bf16, odd_k) == torchmoe::GemmBackend::kCublasLt);
  CHECK(backend_for(bf16, many) ==
        (grouped ? torchmoe::GemmBackend::kCublasLtGrouped : torchmoe::GemmBackend::kCublasLt));
  if (grouped) {
    CHECK(backend_for(bf16, good, kGrouped) == torchmoe::GemmBackend::kCublasLtGrouped);
    CHECK(backend_for(fp32, good, kGrouped) == torchmoe::GemmBackend::kCublasLtGrouped);
    REQUIRE_THROWS_WITH(backend_for(bf16, odd_k, kGrouped), Contains("positive multiples of 8"));
  }
  REQUIRE_THROWS_WITH(backend_for(fp32, good, kSm90),
                      Contains("bfloat16 and float16 operands only"));
  if (sm90) {
    CHECK(backend_for(bf16, good, kSm90) == torchmoe::GemmBackend::kSm90);
    REQUIRE_THROWS_WITH(backend_for(bf16, odd_k, kSm90), Contains("positive multiples of 8"));
    REQUIRE_THROWS_WITH(backend_for(bf16, many, kSm90), Contains("1 to 1024 groups"));
    const ops::GemmShape unaligned{64, 64, 4, /*aligned=*/false};
    REQUIRE_THROWS_WITH(backend_for(bf16, unaligned, kSm90), Contains("16-byte boundaries"));
    CHECK(backend_for(bf16, unaligned) == torchmoe::GemmBackend::kCublasLt);
  }
}

TEST_CASE("the loaded cuBLASLt is reported", "[ops]") {
  // Linked into the library, so loaded with or without a GPU.
  const torchmoe::LoadedCublasLt lt = torchmoe::loaded_cublaslt();
  INFO("cuBLASLt " << lt.version << " from " << lt.library);
  CHECK(lt.version >= 130000);
  CHECK_THAT(lt.library, Contains("libcublasLt"));
  CHECK(lt.grouped == (lt.version >= 130800));
}

TEST_CASE("planning checks split sizes once and copies them at most once", "[ops]") {
  const torch::Tensor x = torch::randn({5, 6});
  REQUIRE_THROWS_WITH(plan_for(x, 4, 6, std::vector<int64_t>{2, 2}),
                      Contains("test: m_splits must sum to the number of rows (5), got [2, 2] "
                               "(sum 4)"));
  REQUIRE_THROWS_WITH(plan_for(x, 4, 6, std::vector<int64_t>{6, -1}),
                      Contains("test: m_splits[1] must be non-negative, got -1"));
  // 2^62 · 3 + (2^62 + 5) wraps around to 5 in int64: not a sum of 5 rows.
  const int64_t huge = int64_t{1} << 62;
  REQUIRE_THROWS_WITH(
      plan_for(x, 4, 6, std::vector<int64_t>{huge, huge, huge, huge + 5}),
      Contains("test: m_splits must sum to the number of rows (5)") && Contains("(sum above it)"));
  REQUIRE_THROWS_WITH(
      ops::plan_grouped_gemms("test", x, {ops::GemmShape{4, 6, 3}}, std::vector<int64_t>{2, 3},
                              torchmoe::GemmBackend::kAuto),
      Contains("test: m_splits must have num_gemms=3 entries, got 2"));
  const ops::GemmPlan plan = plan_for(x, 4, 6, std::vector<int64_t>{2, 3});
  CHECK(plan.backend == torchmoe::GemmBackend::kReference);
  CHECK(plan.rows == 5);
  CHECK(plan.m_splits.host().vec() == std::vector<int64_t>{2, 3});
  CHECK_FALSE(plan.m_splits.has_device());
}

TEST_CASE("planning refuses shapes it cannot plan; the forward, inputs of other widths",
          "[ops][errors]") {
  const torch::Tensor x = torch::randn({5, 6});
  const std::vector<int64_t> splits = {2, 3};
  const auto plan_shapes = [&](std::vector<ops::GemmShape> shapes) {
    return ops::plan_grouped_gemms("test", x, shapes, splits, torchmoe::GemmBackend::kAuto);
  };
  REQUIRE_THROWS_WITH(plan_shapes({}),
                      Contains("test: needs at least one layer's GemmShape to plan, got none"));
  REQUIRE_THROWS_WITH(plan_shapes({ops::GemmShape{4, 6, 0}}),
                      Contains("test: shapes[0] must have groups >= 1 and positive n (out "
                               "features) and k (in features), got groups 0, n 4, k 6"));
  REQUIRE_THROWS_WITH(plan_shapes({ops::GemmShape{4, 6, 2}, ops::GemmShape{0, 4, 2}}),
                      Contains("shapes[1] must have groups >= 1 and positive n (out features) "
                               "and k (in features), got groups 2, n 0, k 4"));
  REQUIRE_THROWS_WITH(plan_shapes({ops::GemmShape{4, 6, 2}, ops::GemmShape{6, 4, 3}}),
                      Contains("test: every layer planned together must have shapes[0]'s 2 "
                               "groups, got 3 in shapes[1]"));
  const ops::GemmPlan plan = plan_shapes({ops::GemmShape{4, 6, 2}}).front();
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, torch::randn({5, 7}),
                                                  make_weights(2, 4, 6, torch::kFloat32), {}),
                      Contains("grouped_linear_forward: input must have 6 features, got 7"));
}

TEST_CASE("planning on CUDA: device splits stay, host splits go up once", "[ops][cuda]") {
  TORCHMOE_REQUIRE_SM90();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  const torch::Tensor x = torch::randn({5, 64}, cuda.dtype(torch::kBFloat16));
  const torch::Tensor sizes = torch::tensor({2, 3}, cuda.dtype(torch::kInt32));
  // fc1 fits the sm90 kernel, fc2 (60 features) does not: both share one host copy.
  const std::vector<ops::GemmPlan> mixed =
      ops::plan_grouped_gemms("test", x, {ops::GemmShape{64, 64, 2}, ops::GemmShape{60, 64, 2}},
                              torchmoe::SplitSizes(sizes), torchmoe::GemmBackend::kAuto);
  CHECK(mixed[0].backend == torchmoe::GemmBackend::kSm90);
  CHECK(mixed[1].backend == torchmoe::GemmBackend::kCublasLt);
  CHECK(mixed[0].m_splits.device().data_ptr() == sizes.data_ptr());  // not copied
  CHECK(mixed[1].m_splits.host().vec() == std::vector<int64_t>{2, 3});
  // Device sizes alone for an sm90 layer: nothing crosses to the host (no sum check either).
  const ops::GemmPlan device_only = plan_for(x, 64, 64, torchmoe::SplitSizes(sizes));
  CHECK_FALSE(device_only.m_splits.has_host());
  // Host sizes for an sm90 layer: checked, then uploaded once.
  const ops::GemmPlan uploaded = plan_for(x, 64, 64, std::vector<int64_t>{1, 4});
  CHECK(torch::equal(uploaded.m_splits.device().cpu(), torch::tensor({1, 4}, torch::kLong)));
  // Device sizes must be on the input's device.
  REQUIRE_THROWS_WITH(plan_for(x.cpu(), 64, 64, torchmoe::SplitSizes(sizes)),
                      Contains("test: m_splits must be on cpu like the input, or on the host"));
}

TEST_CASE("grouped GEMM ops reject bad operands", "[ops][errors]") {
  const auto w = make_weights(2, 4, 6, torch::kFloat32);
  const torch::Tensor x = torch::randn({5, 6});
  const ops::GemmPlan plan = plan_for(x, 4, 6, std::vector<int64_t>{2, 3});
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, torch::randn({6, 5}).t(), w, {}),
                      Contains("grouped_linear_forward: input must be contiguous"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, x.unsqueeze(0), w, {}),
                      Contains("input must be a 2-D [rows, features] tensor, got 3-D"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, x.to(torch::kLong), w, {}),
                      Contains("input must be a Float tensor on cpu like the planned input, got "
                               "Long on cpu"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, torch::randn({4, 6}), w, {}),
                      Contains("input must have the plan's 5 rows, got 4"));
  const std::vector<torch::Tensor> w_double = {w[0], w[1].to(torch::kFloat64)};
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, x, w_double, {}),
                      Contains("weights[1] must have the input's dtype Float, got Double"));
  const std::vector<torch::Tensor> w_shape = {w[0], torch::randn({4, 5})};
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, x, w_shape, {}),
                      Contains("weights[1] must have shape [4, 6], got [4, 5]"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(
                          plan, x, ops::GroupedTensors::stacked(torch::randn({2, 4, 5})), {}),
                      Contains("weights[0] must have shape [2, 4, 6], got [2, 4, 5]"));
  const std::vector<torch::Tensor> one_bias = {torch::zeros({4})};
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, x, w, one_bias),
                      Contains("biases must hold one tensor per group (2), got 1"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad(plan, torch::randn({5, 3}), w),
                      Contains("grad_output must have 4 features"));
  const std::vector<torch::Tensor> dw = {torch::zeros({4, 6}, torch::kFloat16),
                                         torch::zeros({4, 6}, torch::kFloat16)};
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_wgrad(plan, x, torch::randn({5, 4}), dw, false, {}),
      Contains("weight_grads_out must have the input's dtype Float or float32, got Half"));
  const torch::Tensor x16 = x.to(torch::kBFloat16);
  const std::vector<torch::Tensor> dw16 = {torch::zeros({4, 6}, torch::kBFloat16),
                                           torch::zeros({4, 6}, torch::kBFloat16)};
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_wgrad(plan_for(x16, 4, 6, std::vector<int64_t>{2, 3}), x16,
                                torch::randn({5, 4}, torch::kBFloat16), dw16, true, {}),
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
  const ops::GemmPlan plan = plan_for(x, 5, 7, splits);
  // Both parameter layouts: G tensors and one stacked [G, ...] tensor.
  const bool stacked = GENERATE(false, true);
  INFO("stacked=" << stacked);
  const torch::Tensor w_all = torch::stack(w), b_all = torch::stack(b);
  const ops::GroupedTensors weights =
      stacked ? ops::GroupedTensors::stacked(w_all) : ops::GroupedTensors(w);
  const ops::GroupedTensors biases =
      stacked ? ops::GroupedTensors::stacked(b_all) : ops::GroupedTensors(b);
  const torch::Tensor y = ops::grouped_linear_forward(plan, x, weights, biases);
  const torch::Tensor dx = ops::grouped_linear_dgrad(plan, dy, weights);
  int64_t offset = 0;
  for (int g = 0; g < 4; ++g) {
    check_close(y.narrow(0, offset, splits[g]),
                torch::linear(x.narrow(0, offset, splits[g]), w[g], b[g]), {1e-12, 1e-12}, "y");
    check_close(dx.narrow(0, offset, splits[g]), dy.narrow(0, offset, splits[g]).mm(w[g]),
                {1e-12, 1e-12}, "dx");
    offset += splits[g];
  }
}

TEST_CASE("grouped GEMM reads a gathered input as its gathered copy", "[ops]") {
  // Backends other than sm90 gather the copy themselves: the products equal those on the copy.
  torch::manual_seed(5);
  const std::vector<int64_t> splits = {3, 0, 8, 1};
  const auto w = make_weights(4, 5, 7, torch::kFloat64);
  const torch::Tensor x = torch::randn({6, 7}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({12, 5}, torch::kFloat64);
  const auto map_dtype = GENERATE(torch::kInt, torch::kLong);
  INFO("map dtype " << map_dtype);
  // Every token twice, in random order (top-2 routing), but for two padding rows (-1: zero rows).
  const torch::Tensor map = (torch::randperm(12, torch::kLong) % 6).to(map_dtype);
  map.narrow(0, 2, 1).fill_(-1);
  map.narrow(0, 9, 1).fill_(-1);
  const torch::Tensor x_rows =
      x.index_select(0, map.clamp_min(0)) * (map >= 0).unsqueeze(1).to(torch::kFloat64);
  const ops::GemmPlan plan = ops::plan_grouped_gemms("test", x, {ops::GemmShape{5, 7, 4}}, splits,
                                                     torchmoe::GemmBackend::kAuto, map)
                                 .front();
  CHECK(plan.rows == 12);
  CHECK(torch::equal(ops::grouped_linear_forward(plan, x, w, {}, map),
                     ops::grouped_linear_forward(plan, x_rows, w, {})));
  const std::vector<torch::Tensor> dw = {
      torch::zeros({5, 7}, torch::kFloat64), torch::zeros({5, 7}, torch::kFloat64),
      torch::zeros({5, 7}, torch::kFloat64), torch::zeros({5, 7}, torch::kFloat64)};
  ops::grouped_linear_wgrad(plan, x, dy, dw, /*accumulate=*/false, {}, map);
  int64_t offset = 0;
  for (int g = 0; g < 4; ++g) {
    check_close(dw[g], dy.narrow(0, offset, splits[g]).t().mm(x_rows.narrow(0, offset, splits[g])),
                {1e-12, 1e-12}, "dW");
    offset += splits[g];
  }
}

// Scattered output: each product row added into the output row its map names, -1 into none; the
// reference backend computes the rows and adds them with index_add_.
TEST_CASE("grouped GEMM adds scattered rows into their output rows", "[ops]") {
  torch::manual_seed(6);
  const std::vector<int64_t> splits = {3, 0, 8, 1};
  const auto w = make_weights(4, 5, 7, torch::kFloat64);
  const auto b = make_weights(4, 1, 5, torch::kFloat64);
  std::vector<torch::Tensor> biases;
  for (const torch::Tensor& t : b) biases.push_back(t.view({5}));
  const torch::Tensor x = torch::randn({12, 7}, torch::kFloat64);
  const torch::Tensor dy = torch::randn({12, 5}, torch::kFloat64);
  const auto map_dtype = GENERATE(torch::kInt, torch::kLong);
  INFO("map dtype " << map_dtype);
  // Twelve rows into seven output rows: twice each (top-2) for five of them, once for row 5, none
  // for row 6, and one row into none (-1).
  const torch::Tensor map =
      torch::tensor({3, 0, 4, -1, 1, 2, 0, 3, 5, 1, 4, 2}, torch::kLong).to(map_dtype);
  const ops::GemmPlan plan = plan_for(x, 5, 7, splits);
  const torch::Tensor y_rows = ops::grouped_linear_forward(plan, x, w, biases);
  const torch::Tensor dx_rows = ops::grouped_linear_dgrad(plan, dy, w);
  auto summed = [&](const torch::Tensor& rows) {
    torch::Tensor out = torch::zeros({7, rows.size(1)}, torch::kFloat64);
    for (int64_t i = 0; i < 12; ++i) {
      const int64_t t = map[i].item<int64_t>();
      if (t >= 0) out[t] += rows[i];
    }
    return out;
  };
  const ops::RowScatter scatter{map, 7};
  check_close(ops::grouped_linear_forward(plan, x, w, biases, {}, scatter), summed(y_rows),
              {1e-12, 1e-12}, "y");
  check_close(ops::grouped_linear_dgrad(plan, dy, w, scatter), summed(dx_rows), {1e-12, 1e-12},
              "dx");
  // Rows read through a gather map and added through a scatter map.
  const torch::Tensor gather = torch::randperm(12, torch::kLong);
  const ops::GemmPlan gathered_plan =
      ops::plan_grouped_gemms("test", x, {ops::GemmShape{5, 7, 4}}, splits,
                              torchmoe::GemmBackend::kAuto, gather)
          .front();
  check_close(ops::grouped_linear_forward(gathered_plan, x, w, biases, gather, scatter),
              summed(ops::grouped_linear_forward(plan, x.index_select(0, gather), w, biases)),
              {1e-12, 1e-12}, "y of gathered rows");
}

TEST_CASE("grouped GEMM ops reject bad scatter maps", "[ops][errors]") {
  const auto w = make_weights(2, 4, 6, torch::kFloat32);
  const torch::Tensor x = torch::randn({5, 6});
  const torch::Tensor dy = torch::randn({5, 4});
  const torch::Tensor map = torch::tensor({0, 1, 2, 2, 1}, torch::kLong);
  const ops::GemmPlan plan = plan_for(x, 4, 6, std::vector<int64_t>{2, 3});
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_forward(plan, x, w, {}, {}, {map.narrow(0, 0, 4), 3}),
      Contains("grouped_linear_forward: scatter.rows must be a 1-D tensor of the plan's 5 rows, "
               "got [4]"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad(plan, dy, w, {map.to(torch::kFloat), 3}),
                      Contains("grouped_linear_dgrad: scatter.rows must be int32 or int64, got "
                               "Float"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_dgrad(plan, dy, w, {map, -1}),
                      Contains("grouped_linear_dgrad: scatter.target_rows must be >= 0, got -1"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(
                          plan, x, w, {}, {},
                          {torch::tensor({0, 1, 2, 2, 1, 0, 1, 2, 2, 1}).slice(0, 0, 10, 2), 3}),
                      Contains("grouped_linear_forward: scatter.rows must be contiguous"));
}

TEST_CASE("grouped GEMM ops reject bad row maps", "[ops][errors]") {
  const auto w = make_weights(2, 4, 6, torch::kFloat32);
  const torch::Tensor x = torch::randn({3, 6});
  const torch::Tensor map = torch::tensor({0, 1, 2, 2, 1}, torch::kLong);
  const torchmoe::SplitSizes splits(std::vector<int64_t>{2, 3});
  const ops::GemmShape shape{4, 6, 2};
  REQUIRE_THROWS_WITH(ops::plan_grouped_gemms("test", x, {shape}, splits,
                                              torchmoe::GemmBackend::kAuto, map.view({5, 1})),
                      Contains("test: gather_rows must be a 1-D tensor, got 2-D"));
  REQUIRE_THROWS_WITH(ops::plan_grouped_gemms("test", x, {shape}, splits,
                                              torchmoe::GemmBackend::kAuto, map.to(torch::kFloat)),
                      Contains("test: gather_rows must be int32 or int64, got Float"));
  REQUIRE_THROWS_WITH(ops::plan_grouped_gemms("test", x, {shape}, splits,
                                              torchmoe::GemmBackend::kAuto, map.narrow(0, 0, 4)),
                      Contains("test: m_splits must sum to the number of rows (4)"));
  const ops::GemmPlan plan =
      ops::plan_grouped_gemms("test", x, {shape}, splits, torchmoe::GemmBackend::kAuto, map)
          .front();
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, x, w, {}, map.narrow(0, 0, 4)),
                      Contains("grouped_linear_forward: gather_rows must have the plan's 5 rows, "
                               "got 4"));
  REQUIRE_THROWS_WITH(ops::grouped_linear_forward(plan, torch::randn({0, 6}), w, {}, map),
                      Contains("gather_rows names 5 rows of an input that has none"));
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_wgrad(plan, x, torch::randn({5, 4}), w, false, {},
                                torch::tensor({0, 1, 2, 2, 1, 0, 1, 2, 2, 1}).slice(0, 0, 10, 2)),
      Contains("grouped_linear_wgrad: gather_rows must be contiguous"));
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
              tolerance_for(dtype), torchmoe::GemmBackend::kCublasLt);
}

TEST_CASE("grouped GEMM on CUDA rejects float64 as not implemented", "[ops][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const auto cuda64 = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat64);
  REQUIRE_THROWS_AS(plan_for(torch::randn({2, 4}, cuda64), 3, 4, std::vector<int64_t>{2}),
                    c10::NotImplementedError);
}

TEST_CASE("SplitSizes reads CPU tensors at once", "[ops]") {
  const torchmoe::SplitSizes cpu(torch::tensor({3, 0, 5}, torch::kInt16));
  CHECK_FALSE(cpu.has_device());
  CHECK(cpu.host().vec() == std::vector<int64_t>{3, 0, 5});
  REQUIRE_THROWS_WITH(torchmoe::SplitSizes(torch::ones({2, 2}, torch::kLong)),
                      Contains("m_splits must be a 1-D tensor, got 2-D"));
  REQUIRE_THROWS_WITH(torchmoe::SplitSizes(torch::ones({2}, torch::kFloat32)),
                      Contains("m_splits must have an integer dtype, got Float"));
}

TEST_CASE("SplitSizes keeps CUDA tensors on the device, and both copies when given both",
          "[ops][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const torch::Tensor sizes =
      torch::tensor({3, 0, 5}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kInt32));
  const torchmoe::SplitSizes cuda(sizes);
  CHECK(cuda.has_device());
  CHECK_FALSE(cuda.has_host());
  CHECK(cuda.size() == 3);
  const torchmoe::SplitSizes both(std::vector<int64_t>{3, 0, 5}, sizes);
  CHECK(both.has_host());
  CHECK(both.device().data_ptr() == sizes.data_ptr());
  REQUIRE_THROWS_WITH(torchmoe::SplitSizes(std::vector<int64_t>{3, 0}, sizes),
                      Contains("as many entries as the host sizes (2)"));
}
