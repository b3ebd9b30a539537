#include "torchmoe/ops/empty.h"

#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/empty.h>

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

}  // namespace torchmoe::ops
