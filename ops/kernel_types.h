#pragma once
// ATen dtype <-> kernel-layer element types, for the ops that launch torchmoe's kernels.

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

// The ATen dtype of an FP8 format's tensors.
inline c10::ScalarType fp8_dtype(kernels::Fp8Format format) {
  return format == kernels::Fp8Format::kE4M3 ? c10::kFloat8_e4m3fn : c10::kFloat8_e5m2;
}

// Names for error messages.
inline const char* format_name(kernels::Fp8Format format) {
  return format == kernels::Fp8Format::kE4M3 ? "e4m3" : "e5m2";
}
inline const char* scaling_name(kernels::QuantizeScaling scaling) {
  switch (scaling) {
    case kernels::QuantizeScaling::kCurrent:
      return "current scaling";
    case kernels::QuantizeScaling::kDelayed:
      return "delayed scaling";
    case kernels::QuantizeScaling::kBlock1x128:
      return "1x128 block scaling";
    case kernels::QuantizeScaling::kBlock128x128:
      return "128x128 block scaling";
  }
  return "?";
}

}  // namespace torchmoe::ops
