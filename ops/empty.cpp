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
    int64_t piece = static_cast<int64_t>(c10::elementSize(spec.dtype));
    bool overflow = false;
    for (const int64_t size : spec.sizes) {
      TORCH_INTERNAL_ASSERT(size >= 0, "new_empty_packed: negative size in ", spec.sizes);
      overflow |= c10::mul_overflows(piece, size, &piece);
    }
    offsets.push_back(bytes);
    const int64_t padded = (piece + kPackedAlignment - 1) / kPackedAlignment * kPackedAlignment;
    overflow |= padded < piece || c10::add_overflows(bytes, padded, &bytes);
    TORCH_INTERNAL_ASSERT(!overflow, "new_empty_packed: the pieces' bytes overflow int64");
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
  TORCH_INTERNAL_ASSERT(sizes.size() == strides.size(), "alias_storage: sizes ", sizes,
                        " and strides ", strides, " differ in length");
  // Inside the storage: the last element's end at most its bytes (none to check when empty).
  int64_t last = offset;
  bool empty = false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    empty |= sizes[d] == 0;
    last += (sizes[d] - 1) * strides[d];
  }
  const auto item = static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_INTERNAL_ASSERT(
      offset >= 0 && (empty || (last + 1) * item <= static_cast<int64_t>(base.storage().nbytes())),
      "alias_storage: sizes ", sizes, ", strides ", strides, " and offset ", offset,
      " reach past the storage's ", base.storage().nbytes(), " bytes");
  // The VIEW constructor keeps base's dispatch keys as they are (the other one recomputes them
  // from the current InferenceMode), and gives the alias a version counter of its own.
  at::Tensor alias =
      at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(base.storage()),
                                               base.key_set(), c10::scalarTypeToTypeMeta(dtype));
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return alias;
}

}  // namespace torchmoe::ops
