// ops::new_empty (ops/empty.h) against at::empty: the same sizes, strides, dtype, device and
// autograd state, on the CPU and on CUDA (where it skips the dispatcher), empty sizes included;
// under InferenceMode both give inference tensors; options it would ignore are refused.
// ops::new_empty_packed: tensors like at::empty's on ordered, disjoint, aligned pieces inside one
// allocation, each with its own version counter; ops::alias_storage: the asked sizes, strides and
// offset, base's keys under InferenceMode, and its refusal of a window past the storage.

#include <torchmoe/ops/empty.h>

#include <cstdint>
#include <optional>
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

void check_packed(const torch::Device& device) {
  using torchmoe::ops::EmptySpec;
  for (const bool inference : {false, true}) {
    CAPTURE(inference);
    std::optional<c10::InferenceMode> mode;
    if (inference) mode.emplace();
    // Edge shapes: a scalar, empty tensors between non-empty ones, a piece that is not a multiple
    // of the alignment, 1-byte and 8-byte elements next to each other.
    const std::vector<at::Tensor> t = torchmoe::ops::new_empty_packed({{{7, 3}, at::kLong},
                                                                       {{}, at::kFloat},
                                                                       {{0}, at::kFloat},
                                                                       {{5}, at::kByte},
                                                                       {{2, 0, 4}, at::kBFloat16},
                                                                       {{100}, at::kFloat8_e4m3fn},
                                                                       {{33}, at::kDouble}},
                                                                      device);
    const std::vector<std::vector<int64_t>> shapes = {{7, 3}, {}, {0}, {5}, {2, 0, 4}, {100}, {33}};
    const std::vector<at::ScalarType> dtypes = {at::kLong,  at::kFloat,    at::kFloat,
                                                at::kByte,  at::kBFloat16, at::kFloat8_e4m3fn,
                                                at::kDouble};
    REQUIRE(t.size() == shapes.size());
    // Where a tensor starts in memory (data_ptr() is null for an empty one).
    const auto address = [](const at::Tensor& x) {
      return reinterpret_cast<uintptr_t>(x.storage().data()) +
             static_cast<uintptr_t>(x.storage_offset() * x.itemsize());
    };
    const uintptr_t base = address(t[0]);
    uintptr_t end = base;  // where the pieces so far end
    for (size_t i = 0; i < t.size(); ++i) {
      CAPTURE(i);
      const auto options = at::TensorOptions(dtypes[i]).device(device);
      require_like_at_empty(t[i], at::empty(shapes[i], options));
      REQUIRE(t[i].storage().is_alias_of(t[0].storage()));
      // In order, after the piece before, aligned, and inside the allocation.
      const uintptr_t start = address(t[i]);
      REQUIRE(start >= end);
      REQUIRE((start - base) % torchmoe::ops::kPackedAlignment == 0);
      if (device.is_cuda()) REQUIRE(start % torchmoe::ops::kPackedAlignment == 0);
      end = start + t[i].nbytes();
      REQUIRE((t[i].storage_offset() + t[i].numel()) * t[i].itemsize() <= t[i].storage().nbytes());
    }
    // Disjoint pieces: each keeps the value written into it after all the others are written.
    const std::vector<size_t> filled = {0, 1, 3, 5, 6};
    for (const size_t i : filled) t[i].fill_(static_cast<double>(i + 1));
    for (const size_t i : filled) {
      CAPTURE(i);
      REQUIRE(
          at::equal(t[i].to(at::kFloat), at::full(shapes[i], static_cast<double>(i + 1),
                                                  at::TensorOptions(at::kFloat).device(device))));
    }
    if (!inference) {  // a version counter each: an in-place write bumps only its tensor's
      const int64_t before = t[1]._version();
      t[0].add_(1);
      REQUIRE(t[1]._version() == before);
    }
  }
}

void check_alias(const torch::Device& device) {
  const at::Tensor base = at::arange(24, at::TensorOptions(at::kFloat).device(device));
  // A column-major [2, 3] window from element 5: elements 5 to 10.
  const at::Tensor alias = torchmoe::ops::alias_storage(base, at::kFloat, {2, 3}, {1, 2}, 5);
  REQUIRE(alias.sizes() == at::IntArrayRef({2, 3}));
  REQUIRE(alias.strides() == at::IntArrayRef({1, 2}));
  REQUIRE(alias.storage_offset() == 5);
  REQUIRE(alias.key_set() == base.key_set());
  REQUIRE(at::equal(alias, base.as_strided({2, 3}, {1, 2}, 5)));
  const int64_t base_version = base._version();
  alias.zero_();  // writes land in base; the version bumped is the alias's own
  REQUIRE(base._version() == base_version);
  REQUIRE(base.narrow(0, 5, 6).abs().sum().item<float>() == 0);
  REQUIRE(base.sum().item<float>() == 276 - (5 + 6 + 7 + 8 + 9 + 10));
  {
    // Made under InferenceMode from a normal tensor (a backward run inside one), the alias keeps
    // base's keys: not an inference tensor that a later in-place update would refuse.
    c10::InferenceMode inference;
    const at::Tensor inside = torchmoe::ops::alias_storage(base, at::kFloat, {4}, {1}, 0);
    REQUIRE(inside.key_set() == base.key_set());
    REQUIRE_FALSE(inside.is_inference());
  }
  // Past the storage's end: the last element, the offset, an empty tensor's offset is not read.
  CHECK_THROWS_WITH(torchmoe::ops::alias_storage(base, at::kFloat, {2, 10}, {10, 1}, 5),
                    Catch::Matchers::Contains("reach past the storage's 96 bytes"));
  CHECK_THROWS_WITH(torchmoe::ops::alias_storage(base, at::kDouble, {13}, {1}, 0),
                    Catch::Matchers::Contains("reach past the storage's 96 bytes"));
  CHECK_THROWS_WITH(torchmoe::ops::alias_storage(base, at::kFloat, {2}, {1}, -1),
                    Catch::Matchers::Contains("reach past the storage"));
  CHECK(torchmoe::ops::alias_storage(base, at::kFloat, {0, 3}, {3, 1}, 24).numel() == 0);
}

}  // namespace

TEST_CASE("new_empty_packed: tensors as at::empty's on disjoint aligned pieces, CPU and CUDA",
          "[ops][empty]") {
  check_packed(torch::kCPU);
  check_alias(torch::kCPU);
  TORCHMOE_RETURN_IF_NO_GPU_FOR(true);
  check_packed(torch::kCUDA);
  check_alias(torch::kCUDA);
}

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
