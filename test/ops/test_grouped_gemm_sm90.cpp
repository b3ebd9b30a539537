// The device-split grouped GEMM backends (forced: the sm90 kernel, and the cuBLASLt grouped
// matmul where the process loaded cuBLASLt >= 13.8) against float64 per-group products: fprop with
// bias, dgrad, wgrad (input-dtype and fp32 output, fp32 accumulation) and the bias gradients; on
// sm90, fprop and wgrad with x gathered through a row map, also against the gathered copy, and
// fprop and dgrad with their rows added per token through a scatter map, against the unpermute.
//
// Axes: backend × the cases below × dtype {bf16, fp16} × splits {host, device (int32 or int64)} ×
// weights and their gradients {views of one buffer: one 3-D tensor map each; separate tensors: a
// table of per-group maps for the weights, gradients stored from registers}. Padded rows (device
// splits only; the sizes then sum to less than the buffer) hold NaN, so any read of them into a
// valid result shows up.

#include <torchmoe/ops/grouped_gemm.h>
#include <torchmoe/ops/token_permutation.h>

#include <limits>
#include <string>
#include <thread>

#include "test_utils.h"

using namespace torchmoe::test;
namespace ops = torchmoe::ops;

namespace {

constexpr auto kSm90 = torchmoe::GemmBackend::kSm90;
constexpr auto kGrouped = torchmoe::GemmBackend::kCublasLtGrouped;

// The plan of one [n, k] layer over `input` on a forced backend.
ops::GemmPlan forced_plan(const torch::Tensor& input, int64_t n, int64_t k,
                          const torchmoe::SplitSizes& splits,
                          torchmoe::GemmBackend backend = kSm90) {
  return ops::plan_grouped_gemms("test", input, {ops::GemmShape{n, k, splits.size()}}, splits,
                                 backend)
      .front();
}

// One output rounding (rtol) plus fp32 accumulation-order differences on entries that cancel
// (atol, scaled to the result's magnitude).
Tolerance gemm_tolerance(torch::Dtype dtype, const torch::Tensor& expected) {
  const double scale = expected.numel() ? expected.abs().max().item<double>() : 1.0;
  return {dtype == torch::kBFloat16 ? 1e-2 : 1e-3, std::max(1e-6, 1e-4 * scale)};
}

struct Case {
  const char* name;
  std::vector<int64_t> splits;
  int64_t k, n;
  int64_t padding = 0;  // rows past the last group (device splits only)
};

std::vector<Case> cases() {
  auto repeat = [](int64_t groups, int64_t rows) { return std::vector<int64_t>(groups, rows); };
  return {
      {"one group of 127 rows", repeat(1, 127), 128, 512},
      {"8 groups of 15 rows", repeat(8, 15), 128, 512},
      {"8 groups of 1027 rows", repeat(8, 1027), 128, 512},
      {"16 groups of 10027 rows", repeat(16, 10027), 128, 512},
      {"random splits with an empty group", random_splits(8, 3000, 3, 7), 256, 384},
      {"one group holds every row", {0, 0, 777, 0}, 128, 256},
      {"splits of 1 and 7 rows", {1, 7, 1, 7, 7, 1}, 64, 128},
      {"features not multiples of the tile", {5, 130, 0, 64}, 72, 200},
      {"capacity padding", {100, 0, 37}, 128, 136, 51},
      {"all splits zero, padded buffer", {0, 0, 0, 0}, 128, 128, 40},
  };
}

// The sizes on the host, or on the device as int64 (or int32) entries.
torchmoe::SplitSizes split_sizes(const std::vector<int64_t>& sizes, bool on_device,
                                 bool int32 = false) {
  if (!on_device) return torchmoe::SplitSizes(sizes);
  return torchmoe::SplitSizes(
      torch::tensor(sizes, torch::kLong).to(torch::kCUDA, int32 ? torch::kInt : torch::kLong));
}

std::vector<torch::Tensor> group_tensors(int64_t groups, at::IntArrayRef shape, bool one_buffer,
                                         const torch::TensorOptions& options, double scale) {
  if (one_buffer) {
    std::vector<int64_t> sizes{groups};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    return (torch::randn(sizes, options) * scale).unbind(0);
  }
  std::vector<torch::Tensor> out;
  for (int64_t g = 0; g < groups; ++g) out.push_back(torch::randn(shape, options) * scale);
  return out;
}

// Weight gradients filled with `fill`: views of one [G, n, k] buffer (one 3-D tensor map, stored
// through TMA), or views at unequal distances in one flat buffer (no common stride: stored from
// registers).
std::vector<torch::Tensor> grad_tensors(int64_t groups, int64_t n, int64_t k, bool one_buffer,
                                        const torch::TensorOptions& options, double fill) {
  if (one_buffer) return torch::full({groups, n, k}, fill, options).unbind(0);
  const torch::Tensor flat = torch::full({groups * n * k + 8 * groups * groups}, fill, options);
  std::vector<torch::Tensor> out;
  for (int64_t g = 0; g < groups; ++g)
    out.push_back(flat.narrow(0, g * n * k + 8 * g * g, n * k).view({n, k}));
  return out;
}

void run_case(const Case& c, torch::Dtype dtype, bool device_splits, bool one_buffer,
              bool int32_splits, torchmoe::GemmBackend backend = kSm90) {
  if (c.padding > 0 && !device_splits) return;  // host sizes must sum to the rows
  INFO(c.name << ": dtype " << dtype << ", splits on " << (device_splits ? "device" : "host")
              << ", weights " << (one_buffer ? "in one buffer" : "separate"));
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
  const auto groups = static_cast<int64_t>(c.splits.size());
  int64_t valid = 0;
  for (int64_t s : c.splits) valid += s;
  const int64_t rows = valid + c.padding;

  torch::Tensor x = torch::randn({rows, c.k}, cuda);
  torch::Tensor dy = torch::randn({rows, c.n}, cuda) / std::sqrt(std::max<int64_t>(valid, 1));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  x.narrow(0, valid, c.padding).fill_(nan);
  dy.narrow(0, valid, c.padding).fill_(nan);
  const auto weights = group_tensors(groups, {c.n, c.k}, one_buffer, cuda, 0.1);
  const auto biases = group_tensors(groups, {c.n}, one_buffer, cuda, 1.0);
  const torchmoe::SplitSizes splits = split_sizes(c.splits, device_splits, int32_splits);
  const ops::GemmPlan plan = forced_plan(x, c.n, c.k, splits, backend);

  const torch::Tensor y = ops::grouped_linear_forward(plan, x, weights, biases);
  const torch::Tensor dx = ops::grouped_linear_dgrad(plan, dy, weights);
  auto fp32 = cuda.dtype(torch::kFloat32);
  const auto dw32 = grad_tensors(groups, c.n, c.k, one_buffer, fp32, nan);
  const auto dw_acc = grad_tensors(groups, c.n, c.k, one_buffer, fp32, 0.25);
  const auto dw16 = grad_tensors(groups, c.n, c.k, one_buffer, cuda, nan);
  std::vector<torch::Tensor> db;
  for (int64_t g = 0; g < groups; ++g) db.push_back(torch::full({c.n}, nan, cuda));
  ops::grouped_linear_wgrad(plan, x, dy, dw32, /*accumulate=*/false, db);
  ops::grouped_linear_wgrad(plan, x, dy, dw_acc, /*accumulate=*/true, {});
  ops::grouped_linear_wgrad(plan, x, dy, dw16, /*accumulate=*/false, {});

  int64_t offset = 0;
  for (int64_t g = 0; g < groups; ++g) {
    INFO("group " << g << " (" << c.splits[g] << " rows)");
    const torch::Tensor x_g = x.narrow(0, offset, c.splits[g]).to(torch::kFloat64);
    const torch::Tensor dy_g = dy.narrow(0, offset, c.splits[g]).to(torch::kFloat64);
    const torch::Tensor w_g = weights[g].to(torch::kFloat64);
    const torch::Tensor y_ref = x_g.mm(w_g.t()) + biases[g].to(torch::kFloat64);
    const torch::Tensor dx_ref = dy_g.mm(w_g);
    const torch::Tensor dw_ref = dy_g.t().mm(x_g);
    check_close(y.narrow(0, offset, c.splits[g]), y_ref, gemm_tolerance(dtype, y_ref), "y");
    check_close(dx.narrow(0, offset, c.splits[g]), dx_ref, gemm_tolerance(dtype, dx_ref), "dx");
    check_close(dw32[g], dw_ref, gemm_tolerance(torch::kFloat32, dw_ref), "dW fp32");
    check_close(dw_acc[g], dw_ref + 0.25, gemm_tolerance(torch::kFloat32, dw_ref + 0.25),
                "dW accumulated");
    check_close(dw16[g], dw_ref, gemm_tolerance(dtype, dw_ref), "dW in the input dtype");
    check_close(db[g], dy_g.sum(0), gemm_tolerance(dtype, dy_g.sum(0)), "db");
    offset += c.splits[g];
  }
}

// Gathered input: x is [tokens, k] and the kernel reads row i of the grouped operand from
// x[gather_rows[i]], as an MoE layer's fc1 reads its tokens through the routing map.
struct GatherCase {
  const char* name;
  std::vector<int64_t> splits;
  int64_t tokens, k, n;
  int64_t padding = 0;  // map rows past the last group (device splits only)
};

std::vector<GatherCase> gather_cases() {
  return {
      {"empty groups, sizes not multiples of 8 or 128",
       {0, 5, 130, 0, 64, 1027, 0, 3},
       700,
       128,
       512},
      {"top-2 of 1500 tokens, random splits", random_splits(8, 3000, 3, 5), 1500, 256, 384},
      {"features not multiples of the tile", {5, 130, 0, 64, 259}, 300, 72, 200},
      {"one group over several reduction blocks", {777}, 260, 200, 136},
      {"more rows than tokens, one token", {9, 0, 23}, 1, 64, 128},
      {"capacity padding", {100, 0, 37}, 60, 128, 136, 51},
  };
}

// The gathered forward and wgrad against the same products on the gathered copy (the reference
// path: the same kernel on the same shared-memory contents, so equal bit for bit) and against
// float64 per-group products.
void run_gather_case(const GatherCase& c, torch::Dtype dtype, bool device_splits,
                     torch::Dtype map_dtype) {
  if (c.padding > 0 && !device_splits) return;  // host sizes must sum to the rows
  INFO(c.name << ": dtype " << dtype << ", splits on " << (device_splits ? "device" : "host")
              << ", row map " << map_dtype);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
  const auto groups = static_cast<int64_t>(c.splits.size());
  int64_t valid = 0;
  for (int64_t s : c.splits) valid += s;
  const int64_t rows = valid + c.padding;
  const double nan = std::numeric_limits<double>::quiet_NaN();

  // One token past the real ones is NaN and the padding rows name it: a read of a padding row
  // into a valid result shows up.
  torch::Tensor x = torch::randn({c.tokens + 1, c.k}, cuda);
  x[c.tokens].fill_(nan);
  // Each token named about rows / tokens times, in random order (top-k names each k times).
  const torch::Tensor map = torch::cat({torch::randperm(valid, torch::kLong) % c.tokens,
                                        torch::full({c.padding}, c.tokens, torch::kLong)})
                                .to(torch::kCUDA, map_dtype);
  const torch::Tensor x_rows = x.index_select(0, map);  // the permuted copy the map saves
  torch::Tensor dy = torch::randn({rows, c.n}, cuda) / std::sqrt(std::max<int64_t>(valid, 1));
  dy.narrow(0, valid, c.padding).fill_(nan);
  const auto weights = group_tensors(groups, {c.n, c.k}, true, cuda, 0.1);
  const auto biases = group_tensors(groups, {c.n}, true, cuda, 1.0);
  const torchmoe::SplitSizes splits = split_sizes(c.splits, device_splits);
  const ops::GemmPlan plan =
      ops::plan_grouped_gemms("test", x, {ops::GemmShape{c.n, c.k, splits.size()}}, splits, kSm90,
                              map)
          .front();
  REQUIRE(plan.backend == torchmoe::GemmBackend::kSm90);
  REQUIRE(plan.rows == rows);
  const ops::GemmPlan copy_plan = forced_plan(x_rows, c.n, c.k, splits);

  const torch::Tensor y = ops::grouped_linear_forward(plan, x, weights, biases, map);
  const torch::Tensor y_copy = ops::grouped_linear_forward(copy_plan, x_rows, weights, biases);
  const auto fp32 = cuda.dtype(torch::kFloat32);
  struct Grads {
    std::vector<torch::Tensor> dw32, dw_acc, dw16;
  };
  auto wgrads = [&](const ops::GemmPlan& p, const torch::Tensor& input, const torch::Tensor& m) {
    Grads g{grad_tensors(groups, c.n, c.k, true, fp32, nan),
            grad_tensors(groups, c.n, c.k, true, fp32, 0.25),
            grad_tensors(groups, c.n, c.k, true, cuda, nan)};
    ops::grouped_linear_wgrad(p, input, dy, g.dw32, /*accumulate=*/false, {}, m);
    ops::grouped_linear_wgrad(p, input, dy, g.dw_acc, /*accumulate=*/true, {}, m);
    ops::grouped_linear_wgrad(p, input, dy, g.dw16, /*accumulate=*/false, {}, m);
    return g;
  };
  const Grads fused = wgrads(plan, x, map);
  const Grads copied = wgrads(copy_plan, x_rows, torch::Tensor());

  CHECK(torch::equal(y.narrow(0, 0, valid), y_copy.narrow(0, 0, valid)));
  int64_t offset = 0;
  for (int64_t g = 0; g < groups; ++g) {
    INFO("group " << g << " (" << c.splits[g] << " rows)");
    CHECK(torch::equal(fused.dw32[g], copied.dw32[g]));
    CHECK(torch::equal(fused.dw_acc[g], copied.dw_acc[g]));
    CHECK(torch::equal(fused.dw16[g], copied.dw16[g]));
    const torch::Tensor x_g = x_rows.narrow(0, offset, c.splits[g]).to(torch::kFloat64);
    const torch::Tensor dy_g = dy.narrow(0, offset, c.splits[g]).to(torch::kFloat64);
    const torch::Tensor y_ref =
        x_g.mm(weights[g].to(torch::kFloat64).t()) + biases[g].to(torch::kFloat64);
    const torch::Tensor dw_ref = dy_g.t().mm(x_g);
    check_close(y.narrow(0, offset, c.splits[g]), y_ref, gemm_tolerance(dtype, y_ref), "y");
    check_close(fused.dw32[g], dw_ref, gemm_tolerance(torch::kFloat32, dw_ref), "dW fp32");
    check_close(fused.dw_acc[g], dw_ref + 0.25, gemm_tolerance(torch::kFloat32, dw_ref + 0.25),
                "dW accumulated");
    check_close(fused.dw16[g], dw_ref, gemm_tolerance(dtype, dw_ref), "dW in the input dtype");
    offset += c.splits[g];
  }
}

// Scattered output: row i of fprop (with bias) or dgrad added into row map[i] of a [tokens, ·]
// output, as an MoE layer's fc2 sums each token's expert rows (the unpermute) and fc1's dgrad its
// input-gradient rows (the permutation's backward), for top-1 and top-2 routing.
struct ScatterCase {
  const char* name;
  std::vector<int64_t> splits;  // summing to a multiple of topk
  int64_t topk, k, n;
  int64_t padding = 0;  // rows past the last group (device splits only)
};

std::vector<ScatterCase> scatter_cases() {
  return {
      {"top-2, empty groups, sizes not multiples of 8 or 128",
       {0, 5, 130, 0, 64, 1027, 0, 4},
       2,
       128,
       512},
      {"top-1, random splits", random_splits(8, 3000, 3, 5), 1, 256, 384},
      {"top-2, features not multiples of the tile", {5, 130, 0, 64, 259}, 2, 72, 200},
      {"top-2, one group over several reduction blocks", {778}, 2, 200, 136},
      {"top-2, capacity padding", {100, 0, 38}, 2, 128, 136, 51},
  };
}

// Against the unscattered rows summed per token by ops::unpermute_rows (each token's fp32 sum of
// its rows, rounded once): equal bit for bit, as two adds from zero in either order round to that.
// Every seventh row is dropped (-1 in both maps); padding rows (NaN inputs) name token 0, and a
// read of one into the sums shows up.
void run_scatter_case(const ScatterCase& c, torch::Dtype dtype, bool device_splits,
                      torch::Dtype map_dtype) {
  if (c.padding > 0 && !device_splits) return;  // host sizes must sum to the rows
  INFO(c.name << ": dtype " << dtype << ", splits on " << (device_splits ? "device" : "host")
              << ", row map " << map_dtype);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
  const auto groups = static_cast<int64_t>(c.splits.size());
  int64_t valid = 0;
  for (int64_t s : c.splits) valid += s;
  REQUIRE(valid % c.topk == 0);
  const int64_t rows = valid + c.padding, tokens = valid / c.topk;
  const double nan = std::numeric_limits<double>::quiet_NaN();

  // Slot t·k + j of token t sits at row perm[t·k + j].
  const torch::Tensor perm = torch::randperm(valid, torch::kLong);
  const torch::Tensor dropped = perm % 7 == 3;
  const torch::Tensor row_map = perm.masked_fill(dropped, -1).view({tokens, c.topk});
  torch::Tensor token_of_row = torch::zeros({rows}, torch::kLong);
  token_of_row.index_put_(
      {perm}, torch::arange(valid, torch::kLong).floor_divide(c.topk).masked_fill(dropped, -1));
  const torch::Tensor map = token_of_row.to(torch::kCUDA, map_dtype);
  const torch::Tensor reference_map = row_map.to(torch::kCUDA);

  torch::Tensor x = torch::randn({rows, c.k}, cuda);
  x.narrow(0, valid, c.padding).fill_(nan);
  torch::Tensor dy = torch::randn({rows, c.n}, cuda);
  dy.narrow(0, valid, c.padding).fill_(nan);
  const auto weights = group_tensors(groups, {c.n, c.k}, true, cuda, 0.1);
  const auto biases = group_tensors(groups, {c.n}, true, cuda, 1.0);
  const torchmoe::SplitSizes splits = split_sizes(c.splits, device_splits);
  const ops::GemmPlan plan = forced_plan(x, c.n, c.k, splits);
  const ops::RowScatter scatter{map, tokens};

  const torch::Tensor y = ops::grouped_linear_forward(plan, x, weights, biases, {}, scatter);
  const torch::Tensor y_rows = ops::grouped_linear_forward(plan, x, weights, biases);
  CHECK(y.sizes() == torch::IntArrayRef{tokens, c.n});
  CHECK(torch::equal(y, ops::unpermute_rows(y_rows, reference_map, torch::Tensor())));
  const torch::Tensor dx = ops::grouped_linear_dgrad(plan, dy, weights, scatter);
  const torch::Tensor dx_rows = ops::grouped_linear_dgrad(plan, dy, weights);
  CHECK(dx.sizes() == torch::IntArrayRef{tokens, c.k});
  CHECK(torch::equal(dx, ops::unpermute_rows(dx_rows, reference_map, torch::Tensor())));
  // The same again: the adds' order changes from run to run, their results do not.
  CHECK(torch::equal(y, ops::grouped_linear_forward(plan, x, weights, biases, {}, scatter)));
}

}  // namespace

TEST_CASE("sm90 grouped GEMM adds scattered rows per token, bit for bit their unpermute",
          "[ops][cuda][sm90][scatter]") {
  TORCHMOE_REQUIRE_SM90();
  torch::manual_seed(17);
  const auto dtype = GENERATE(torch::kBFloat16, torch::kFloat16);
  const bool device_splits = GENERATE(true, false);
  const auto map_dtype = GENERATE(torch::kInt, torch::kLong);
  for (const ScatterCase& c : scatter_cases()) run_scatter_case(c, dtype, device_splits, map_dtype);
}

TEST_CASE("sm90 grouped GEMM reads gathered rows through a row map", "[ops][cuda][sm90][gather]") {
  TORCHMOE_REQUIRE_SM90();
  torch::manual_seed(13);
  const auto dtype = GENERATE(torch::kBFloat16, torch::kFloat16);
  const bool device_splits = GENERATE(true, false);
  const auto map_dtype = GENERATE(torch::kInt, torch::kLong);
  for (const GatherCase& c : gather_cases()) run_gather_case(c, dtype, device_splits, map_dtype);
}

TEST_CASE("sm90 grouped GEMM vs float64 per-group products", "[ops][cuda][sm90]") {
  TORCHMOE_REQUIRE_SM90();
  torch::manual_seed(11);
  const auto dtype = GENERATE(torch::kBFloat16, torch::kFloat16);
  const bool device_splits = GENERATE(true, false);
  const bool one_buffer = GENERATE(true, false);
  for (const Case& c : cases()) run_case(c, dtype, device_splits, one_buffer, !one_buffer);
}

// The cases above minus the two largest, for compute-sanitizer's racecheck (which runs the full
// set for longer than one device call allows): every kernel path (fprop/dgrad/wgrad, TMA and
// register epilogues, masked wgrad tails, padding, empty groups, gathered and scattered rows) is
// still taken.
TEST_CASE("sm90 grouped GEMM, small cases (for racecheck)", "[.][sm90-small]") {
  TORCHMOE_REQUIRE_SM90();
  torch::manual_seed(11);
  const bool device_splits = GENERATE(true, false);
  const bool one_buffer = GENERATE(true, false);
  for (const Case& c : cases()) {
    int64_t rows = 0;
    for (int64_t s : c.splits) rows += s;
    if (rows <= 8 * 1027) run_case(c, torch::kBFloat16, device_splits, one_buffer, !one_buffer);
  }
  for (const GatherCase& c : gather_cases()) {
    if (one_buffer && c.tokens <= 700) {
      run_gather_case(c, torch::kBFloat16, device_splits, torch::kLong);
    }
  }
  if (one_buffer) {
    for (const ScatterCase& c : scatter_cases()) {
      run_scatter_case(c, torch::kBFloat16, device_splits, torch::kLong);
    }
  }
}

TEST_CASE("sm90 grouped GEMM clamps device splits to the buffer", "[ops][cuda][sm90]") {
  TORCHMOE_REQUIRE_SM90();
  // Sizes summing past the rows (unchecked on the device): the last groups are truncated to the
  // buffer, and nothing past it is read or written (compute-sanitizer runs this case too).
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({50, 64}, cuda);
  const std::vector<torch::Tensor> w = torch::randn({3, 64, 64}, cuda).unbind(0);
  const torchmoe::SplitSizes too_many(torch::tensor({30, -5, 40}, torch::kLong).to(torch::kCUDA));
  const torch::Tensor y = ops::grouped_linear_forward(forced_plan(x, 64, 64, too_many), x, w, {});
  const torch::Tensor expected =
      torch::cat({x.narrow(0, 0, 30).mm(w[0].t()), x.narrow(0, 30, 20).mm(w[2].t())});
  check_close(y, expected, {1e-2, 1e-2}, "truncated groups");
  // Sizes whose sum wraps around int64: each is clamped to the rows first, so the first group
  // takes the buffer and the others are empty.
  const torch::Tensor huge =
      torch::tensor({INT64_MAX, INT64_MAX, int64_t{40}}, torch::kLong).to(torch::kCUDA);
  const torch::Tensor all_first =
      ops::grouped_linear_forward(forced_plan(x, 64, 64, torchmoe::SplitSizes(huge)), x, w, {});
  check_close(all_first, x.mm(w[0].t()), {1e-2, 1e-2}, "sizes past int64");
}

TEST_CASE("sm90 bias gradients are written at any address", "[ops][cuda][sm90]") {
  TORCHMOE_REQUIRE_SM90();
  // Bias gradients in a view at an odd element offset: each group's pair stores would be
  // misaligned, so the kernel stores those elements one at a time.
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({50, 64}, cuda);
  const torch::Tensor dy = torch::randn({50, 64}, cuda);
  const std::vector<int64_t> sizes = {20, 0, 30};
  const ops::GemmPlan plan = forced_plan(
      x, 64, 64, torchmoe::SplitSizes(torch::tensor(sizes, torch::kLong).to(torch::kCUDA)));
  const torch::Tensor buffer = torch::zeros({3 * 64 + 1}, cuda);
  const torch::Tensor db = buffer.narrow(0, 1, 3 * 64).view({3, 64});
  ops::grouped_bias_grad(plan, dy, ops::GroupedTensors::stacked(db));
  const torch::Tensor dy32 = dy.to(torch::kFloat);
  const torch::Tensor expected =
      torch::stack({dy32.narrow(0, 0, 20).sum(0), torch::zeros({64}, dy32.options()),
                    dy32.narrow(0, 20, 30).sum(0)});
  check_close(db.to(torch::kFloat), expected, {2e-2, 2e-2}, "bias gradients");
  CHECK(buffer[0].item<float>() == 0.0f);
}

TEST_CASE("sm90 grouped GEMM runs on a thread that has made no CUDA call", "[ops][cuda][sm90]") {
  TORCHMOE_REQUIRE_SM90();
  // The tensor maps come from a driver call, which needs a current context. A new thread has none
  // until a runtime call binds one, and here none does: the first call below has configured the
  // kernel, and the worker's tensors come from the caching allocator.
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({64, 64}, cuda);
  const std::vector<torch::Tensor> w = torch::randn({2, 64, 64}, cuda).unbind(0);
  const ops::GemmPlan plan =
      forced_plan(x, 64, 64, torchmoe::SplitSizes(torch::tensor({40, 24}).to(torch::kCUDA)));
  const torch::Tensor expected = ops::grouped_linear_forward(plan, x, w, {});
  torch::Tensor y;
  std::string error;
  std::thread worker([&] {
    try {
      y = ops::grouped_linear_forward(plan, x, w, {});
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  worker.join();
  INFO(error);
  REQUIRE(error.empty());
  CHECK(torch::equal(y, expected));
}

TEST_CASE("sm90 grouped GEMM rejects splits and shapes it cannot use",
          "[ops][cuda][sm90][errors]") {
  TORCHMOE_REQUIRE_SM90();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({8, 64}, cuda);
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_WITH(ops::plan_grouped_gemms(
                          "test", x, {ops::GemmShape{64, 64, 2}},
                          torchmoe::SplitSizes(torch::tensor({4, 2, 2}).to(torch::kCUDA)), kSm90),
                      Contains("test: m_splits must have num_gemms=2 entries, got 3"));
  REQUIRE_THROWS_WITH(forced_plan(x, 64, 64, std::vector<int64_t>{4, 2}),
                      Contains("test: m_splits must sum to the number of rows (8)"));
  REQUIRE_THROWS_AS(forced_plan(torch::randn({8, 60}, cuda), 64, 60, std::vector<int64_t>{4, 4}),
                    c10::NotImplementedError);
}

TEST_CASE("sm90 grouped GEMM copies an unaligned activation instead of refusing it",
          "[ops][cuda][sm90]") {
  TORCHMOE_REQUIRE_SM90();
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  // Rows that start 2 bytes into a buffer: TMA cannot read them in place.
  const torch::Tensor x = torch::randn({8 * 64 + 1}, cuda).narrow(0, 1, 8 * 64).view({8, 64});
  REQUIRE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0);
  const torch::Tensor w = torch::randn({2, 64, 64}, cuda);
  const ops::GemmPlan plan = forced_plan(x, 64, 64, std::vector<int64_t>{5, 3});
  REQUIRE(plan.backend == torchmoe::GemmBackend::kSm90);
  const torch::Tensor y = ops::grouped_linear_forward(plan, x, ops::GroupedTensors::stacked(w), {});
  const torch::Tensor expected =
      torch::cat({x.narrow(0, 0, 5).mm(w[0].t()), x.narrow(0, 5, 3).mm(w[1].t())});
  check_close(y, expected, {1e-2, 1e-2}, "unaligned input");
}

// ---- the cuBLASLt grouped backend ---------------------------------------------------------------

TEST_CASE("cuBLASLt grouped GEMM vs float64 per-group products", "[ops][cuda][cublaslt_grouped]") {
  TORCHMOE_REQUIRE_GEMM_BACKEND(kGrouped);
  torch::manual_seed(12);
  const auto dtype = GENERATE(torch::kBFloat16, torch::kFloat16);
  const bool device_splits = GENERATE(true, false);
  const bool one_buffer = GENERATE(true, false);
  for (const Case& c : cases()) {
    run_case(c, dtype, device_splits, one_buffer, !one_buffer, kGrouped);
  }
}

TEST_CASE("cuBLASLt grouped GEMM with more than 1024 groups", "[ops][cuda][cublaslt_grouped]") {
  TORCHMOE_REQUIRE_GEMM_BACKEND(kGrouped);
  torch::manual_seed(13);
  // 1500 groups of 0 to 9 rows (about a tenth empty): more groups than the sm90 kernel takes and
  // than one chunk of the setup kernel's scan.
  const Case c{"1500 small groups", random_splits(1500, 6750, 0, 14), 64, 128};
  const bool device_splits = GENERATE(true, false);
  run_case(c, torch::kBFloat16, device_splits, /*one_buffer=*/true, false, kGrouped);
}

TEST_CASE("cuBLASLt grouped GEMM clamps device splits to the buffer",
          "[ops][cuda][cublaslt_grouped]") {
  TORCHMOE_REQUIRE_GEMM_BACKEND(kGrouped);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({50, 64}, cuda);
  const std::vector<torch::Tensor> w = torch::randn({3, 64, 64}, cuda).unbind(0);
  const torchmoe::SplitSizes too_many(torch::tensor({30, -5, 40}, torch::kLong).to(torch::kCUDA));
  const torch::Tensor y =
      ops::grouped_linear_forward(forced_plan(x, 64, 64, too_many, kGrouped), x, w, {});
  const torch::Tensor expected =
      torch::cat({x.narrow(0, 0, 30).mm(w[0].t()), x.narrow(0, 30, 20).mm(w[2].t())});
  check_close(y, expected, {1e-2, 1e-2}, "truncated groups");
  // Sizes whose sum wraps around int64 (each clamped to the rows first).
  const torch::Tensor huge =
      torch::tensor({INT64_MAX, INT64_MAX, int64_t{40}}, torch::kLong).to(torch::kCUDA);
  const torch::Tensor all_first = ops::grouped_linear_forward(
      forced_plan(x, 64, 64, torchmoe::SplitSizes(huge), kGrouped), x, w, {});
  check_close(all_first, x.mm(w[0].t()), {1e-2, 1e-2}, "sizes past int64");
  // Weights at an odd address are refused, not handed to the grouped matmul.
  const torch::Tensor buffer = torch::randn({3 * 64 * 64 + 1}, cuda);
  const ops::GroupedTensors odd =
      ops::GroupedTensors::stacked(buffer.narrow(0, 1, 3 * 64 * 64).view({3, 64, 64}));
  const torchmoe::SplitSizes sizes(std::vector<int64_t>{20, 20, 10});
  REQUIRE_THROWS_WITH(
      ops::grouped_linear_forward(forced_plan(x, 64, 64, sizes, kGrouped), x, odd, {}),
      Catch::Matchers::Contains("needs weights that start on 16-byte boundaries"));
}

TEST_CASE("cuBLASLt grouped GEMM: float32 operands run or are refused with a reason",
          "[ops][cuda][cublaslt_grouped]") {
  TORCHMOE_REQUIRE_GEMM_BACKEND(kGrouped);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kFloat32);
  const torch::Tensor x = torch::randn({40, 64}, cuda);
  const std::vector<torch::Tensor> w = torch::randn({2, 32, 64}, cuda).unbind(0);
  const ops::GemmPlan plan = forced_plan(x, 32, 64, std::vector<int64_t>{25, 15}, kGrouped);
  try {
    const torch::Tensor y = ops::grouped_linear_forward(plan, x, w, {});
    const torch::Tensor expected =
        torch::cat({x.narrow(0, 0, 25).mm(w[0].t()), x.narrow(0, 25, 15).mm(w[1].t())});
    check_close(y, expected, {1e-5, 1e-5}, "fp32");
  } catch (const c10::NotImplementedError& e) {
    CHECK_THAT(e.what(), Catch::Matchers::Contains("has no grouped-matmul algorithm for fprop"));
  }
}

TEST_CASE(
    "cuBLASLt grouped GEMM is refused with the loaded version when cuBLASLt is older than "
    "13.8",
    "[ops][cuda][cublaslt_grouped][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  const torchmoe::LoadedCublasLt lt = torchmoe::loaded_cublaslt();
  if (lt.grouped) {
    WARN("SKIPPED: the loaded cuBLASLt " << lt.version << " has the grouped matmul");
    return;
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  const torch::Tensor x = torch::randn({8, 64}, cuda);
  using Catch::Matchers::Contains;
  REQUIRE_THROWS_AS(forced_plan(x, 64, 64, std::vector<int64_t>{4, 4}, kGrouped),
                    c10::NotImplementedError);
  REQUIRE_THROWS_WITH(
      forced_plan(x, 64, 64, std::vector<int64_t>{4, 4}, kGrouped),
      Contains("the cublaslt_grouped grouped GEMM backend cannot run this call: "
               "it needs cuBLASLt >= 13.8") &&
          Contains("this process loaded cuBLASLt " + std::to_string(lt.version / 10000) + "." +
                   std::to_string(lt.version / 100 % 100)));
}
