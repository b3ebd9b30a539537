// GroupedLinear on CUDA (cuBLASLt backend) against the float64 reference: TE's accuracy matrix at
// TE's shape, edge shapes, and CUDA-specific inputs. Every case skips visibly without a GPU.

#include "modules/grouped_linear_case.h"

using torchmoe::GroupedLinear;
using torchmoe::GroupedLinearOptions;
using namespace torchmoe::test;
using Catch::Matchers::Contains;

namespace {

// TF32 off, as TE's fp32 tolerance assumes (and as PyTorch defaults).
struct NoTF32 {
  bool saved = at::globalContext().allowTF32CuBLAS();
  NoTF32() { at::globalContext().setAllowTF32CuBLAS(false); }
  ~NoTF32() { at::globalContext().setAllowTF32CuBLAS(saved); }
};

}  // namespace

TEST_CASE("GroupedLinear CUDA accuracy matrix at TE's shape", "[modules][grouped_linear][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const NoTF32 no_tf32;
  // Port of TE's test_grouped_linear_accuracy at TE's shape: input (2048, 768) -> 3072.
  const auto dtype = GENERATE(torch::kFloat32, torch::kFloat16, torch::kBFloat16);
  const int64_t groups = GENERATE(1, 3, 6);
  const bool bias = GENERATE(false, true);
  const bool fuse = GENERATE(false, true);
  const bool delay = GENERATE(false, true);
  const auto layout =
      GENERATE(Layout::kDiscrete, Layout::kSingleWeight, Layout::kSingleWeightAndBias);
  ModuleCase c =
      matrix_case(dtype, torch::kCUDA, groups, bias, fuse, delay, layout, 2048, 100 + groups);
  c.in = 768;
  c.out = 3072;
  run_module_case(c);
}

TEST_CASE("GroupedLinear CUDA edge shapes", "[modules][grouped_linear][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const NoTF32 no_tf32;
  ModuleCase c;
  c.device = torch::kCUDA;
  c.dtype = GENERATE(torch::kFloat32, torch::kBFloat16);
  c.fuse = GENERATE(false, true);
  c.in = 768;
  c.out = 3072;
  SECTION("batch size 2 (4096 rows), six experts") { c.splits = random_splits(6, 4096, 2, 21); }
  SECTION("all splits zero") { c.splits = {0, 0, 0}; }
  SECTION("odd split sizes 1, 7, 127") { c.splits = {1, 7, 127}; }
  SECTION("one expert holds every row") { c.splits = {0, 0, 333, 0}; }
  SECTION("3-D input") {
    c.splits = {100, 0, 28};
    c.lead_shape = std::vector<int64_t>{2, 64};
  }
  SECTION("m_splits as a CUDA int tensor") {
    c.splits = {64, 31, 0, 33};
    c.splits_as_tensor = true;
  }
  SECTION("unaligned feature sizes (in 100, out 36) and odd rows") {
    c.in = 100;
    c.out = 36;
    c.splits = {13, 0, 7, 1};
  }
  SECTION("eight experts on several streams") { c.splits = random_splits(8, 3000, 5, 22); }
  run_module_case(c);
}

TEST_CASE("GroupedLinear CUDA rejects CPU input", "[modules][grouped_linear][cuda][errors]") {
  TORCHMOE_REQUIRE_CUDA();
  GroupedLinear m(GroupedLinearOptions(2, 8, 4).device(torch::kCUDA));
  REQUIRE_THROWS_WITH(m(torch::randn({3, 8}), std::vector<int64_t>{1, 2}),
                      Contains("input must be on the parameters' device cuda:0, got cpu"));
}

TEST_CASE("GroupedLinear ->to(kCUDA) moves fused main-grad buffers with the parameters",
          "[modules][grouped_linear][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool single = GENERATE(false, true);
  const auto dtype = GENERATE(torch::kFloat32, torch::kBFloat16);
  INFO("single=" << single << " dtype=" << dtype);
  GroupedLinear m(GroupedLinearOptions(2, 64, 32)
                      .bias(false)
                      .fuse_wgrad_accumulation(true)
                      .single_grouped_weight(single));
  m->to(torch::kCUDA, dtype);
  for (const torch::Tensor& mg : m->main_grads()) {
    CHECK(mg.device() == torch::Device(torch::kCUDA, 0));
    CHECK(mg.scalar_type() == torch::kFloat32);
  }
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(dtype);
  const torch::Tensor x = torch::randn({24, 64}, cuda);
  const torch::Tensor dy = torch::randn({24, 32}, cuda) / 5;
  const std::vector<int64_t> splits = {9, 15};
  m(x, splits, /*is_first_microbatch=*/true).backward(dy);
  const Reference ref = reference_grouped_linear(x, splits, m->expert_weights(), {}, dy);
  std::vector<torch::Tensor> main = m->main_grads();
  if (single) main = main[0].unbind(0);
  for (size_t g = 0; g < 2; ++g) {
    check_close(main[g], ref.grad_weights[g], tolerance_for(dtype), "main_grad");
  }
  // Back on the CPU, buffers handed in for one device must match the new one.
  m->to(torch::kCPU);
  CHECK(m->main_grads().front().is_cpu());
}

TEST_CASE("GroupedLinear clone() keeps the fused main grads beside the parameters",
          "[modules][grouped_linear][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  const bool single = GENERATE(false, true);
  INFO("single=" << single);
  const auto options = GroupedLinearOptions(2, 64, 32)
                           .bias(false)
                           .fuse_wgrad_accumulation(true)
                           .single_grouped_weight(single);
  GroupedLinear moved(options);
  moved->to(torch::kCUDA);
  GroupedLinear on_cpu(options);
  // A layer moved after construction, and a CPU layer cloned onto the GPU: either way the copy's
  // reset() made its main grads on options.device(), the CPU.
  for (const auto& copy : {std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(moved->clone()),
                           std::dynamic_pointer_cast<torchmoe::GroupedLinearImpl>(
                               on_cpu->clone(torch::Device(torch::kCUDA, 0)))}) {
    REQUIRE(copy);
    for (const torch::Tensor& mg : copy->main_grads()) CHECK(mg.is_cuda());
    const torch::Tensor x = torch::randn({24, 64}, torch::device(torch::kCUDA));
    const torch::Tensor dy = torch::randn({24, 32}, torch::device(torch::kCUDA)) / 5;
    const std::vector<int64_t> splits = {9, 15};
    copy->forward(x, splits, /*is_first_microbatch=*/true).backward(dy);
    const Reference ref = reference_grouped_linear(x, splits, copy->expert_weights(), {}, dy);
    std::vector<torch::Tensor> main = copy->main_grads();
    if (single) main = main[0].unbind(0);
    for (size_t g = 0; g < 2; ++g) {
      check_close(main[g], ref.grad_weights[g], tolerance_for(torch::kFloat32), "main_grad");
    }
  }
}
