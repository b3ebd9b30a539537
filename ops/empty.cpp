#include "torchmoe/ops/empty.h"

#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/safe_numerics.h>
#include <c10/util/strides.h>

namespace torchmoe::ops {

at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  // What empty_cuda does not take: no op asks for it, and at::empty would honour it.
  TORCH_INTERNAL_ASSERT(options.layout() == at::kStrided && !options.has_memory_format() &&
                            !options.requires_grad() && !options.pinned_memory(),
                        "new_empty: options beyond dtype and device: ", options);
  if (options.device().is_cuda()) {
    return at::Tensor(at::detail::empty_cuda(sizes, options.dtype().toScalarType(),
                                             options.device(), std::nullopt));
  }
  return at::empty(sizes, options);
}

std::vector<at::Tensor> new_empty_packed(std::initializer_list<EmptySpec> specs,
                                         at::Device device) {
  std::vector<int64_t> offsets;  // bytes
  offsets.reserve(specs.size());
  int64_t bytes = 0;
  for (const EmptySpec& spec : specs) {
    int64_t numel = 1;
    for (const int64_t size : spec.sizes) {
      TORCH_INTERNAL_ASSERT(size >= 0, "new_empty_packed: negative size in ", spec.sizes);
      TORCH_INTERNAL_ASSERT(!c10::mul_overflows(numel, size, &numel),
                            "new_empty_packed: sizes overflow: ", spec.sizes);
    }
    offsets.push_back(bytes);
    const int64_t piece = numel * static_cast<int64_t>(c10::elementSize(spec.dtype));
    bytes += (piece + kPackedAlignment - 1) / kPackedAlignment * kPackedAlignment;
  }
  const at::Tensor base = new_empty({bytes}, at::TensorOptions(at::kByte).device(device));
  std::vector<at::Tensor> tensors;
  tensors.reserve(specs.size());
  size_t i = 0;
  for (const EmptySpec& spec : specs) {
    const auto item = static_cast<int64_t>(c10::elementSize(spec.dtype));
    tensors.push_back(alias_storage(base, spec.dtype, spec.sizes,
                                    c10::contiguous_strides(spec.sizes), offsets[i++] / item));
  }
  return tensors;
}

at::Tensor alias_storage(const at::Tensor& base, at::ScalarType dtype, at::IntArrayRef sizes,
                         at::IntArrayRef strides, int64_t offset) {
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(base.storage()), base.key_set(), c10::scalarTypeToTypeMeta(dtype));
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return alias;
}

}  // namespace torchmoe::ops
