#include "torchmoe/ops/empty.h"

#include <ATen/ops/empty.h>
#include <ATen/cuda/EmptyTensor.h>

namespace torchmoe::ops {

at::Tensor new_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (options.device().is_cuda()) {
    return at::Tensor(at::detail::empty_cuda(sizes, options.dtype().toScalarType(),
                                             options.device(), std::nullopt));
  }
  return at::empty(sizes, options);
}

}  // namespace torchmoe::ops
