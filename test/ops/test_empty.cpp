// ops::new_empty (ops/empty.h) against at::empty: the same sizes, strides, dtype, device and
// autograd state, on the CPU and on CUDA (where it skips the dispatcher), empty sizes included;
// under InferenceMode both give inference tensors; options it would ignore are refused.

#include <torchmoe/ops/empty.h>

#include <vector>

#include "test_utils.h"

using namespace torchmoe::test;

namespace {

void require_like_at_empty(const at::Tensor& ours, const at::Tensor& aten) {
  REQUIRE(ours.sizes() == aten.sizes());
  REQUIRE(ours.strides() == aten.strides());
  REQUIRE(ours.scalar_type() == aten.scalar_type());
  REQUIRE(ours.device() == aten.device());
  REQUIRE(ours.is_contiguous());
  REQUIRE(ours.requires_grad() == aten.requires_grad());
  REQUIRE(ours.is_inference() == aten.is_inference());
  REQUIRE(ours.key_set() == aten.key_set());
}

void check_device(const torch::Device& device) {
  const std::vector<std::vector<int64_t>> shapes = {{7, 3}, {0, 5}, {}, {2, 0, 4}, {1 << 20}};
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kLong, at::kFloat8_e4m3fn, at::kByte}) {
    for (const auto& shape : shapes) {
      const auto options = at::TensorOptions(dtype).device(device);
      CAPTURE(dtype, shape);
      require_like_at_empty(torchmoe::ops::new_empty(shape, options), at::empty(shape, options));
      c10::InferenceMode inference;
      require_like_at_empty(torchmoe::ops::new_empty(shape, options), at::empty(shape, options));
    }
  }
  // Options taken from a tensor, as the ops pass them: writable memory of the asked size.
  const at::Tensor like = at::ones({4, 6}, at::TensorOptions(at::kBFloat16).device(device));
  at::Tensor t = torchmoe::ops::new_empty({4, 6}, like.options());
  t.fill_(2);
  REQUIRE(at::equal(t, like * 2));
}

}  // namespace

TEST_CASE("new_empty allocates as at::empty does on the CPU", "[ops][empty]") {
  check_device(torch::kCPU);
}

TEST_CASE("new_empty allocates as at::empty does on CUDA", "[ops][empty][cuda]") {
  TORCHMOE_REQUIRE_CUDA();
  check_device(torch::kCUDA);
  check_device(torch::Device(torch::kCUDA, 0));
}

TEST_CASE("new_empty refuses options it would not honour", "[ops][empty]") {
  for (const bool cuda : {false, true}) {
    TORCHMOE_RETURN_IF_NO_GPU_FOR(cuda);
    const auto base = at::TensorOptions(at::kFloat).device(cuda ? at::kCUDA : at::kCPU);
    CHECK_THROWS_WITH(torchmoe::ops::new_empty({2}, base.requires_grad(true)),
                      Catch::Matchers::Contains("new_empty: options beyond dtype and device"));
    CHECK_THROWS_WITH(
        torchmoe::ops::new_empty({2}, base.memory_format(at::MemoryFormat::Contiguous)),
        Catch::Matchers::Contains("new_empty: options beyond dtype and device"));
  }
}
