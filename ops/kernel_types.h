#pragma once
// ATen dtype -> kernel-layer element type, for the ops that launch torchmoe's kernels.

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "torchmoe/kernels/types.h"

namespace torchmoe::ops {

// Only called after a dispatch table admitted the dtype.
inline kernels::ScalarType kernel_type(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat:
      return kernels::ScalarType::kFloat32;
    case c10::kHalf:
      return kernels::ScalarType::kFloat16;
    case c10::kBFloat16:
      return kernels::ScalarType::kBFloat16;
    default:
      TORCH_INTERNAL_ASSERT(false, "kernel_type: dtype ", type, " has no kernel element type");
  }
}

}  // namespace torchmoe::ops
