#pragma once
// The kernel layer's vocabulary, named without ATen (kernels never see at::Tensor): element types,
// the gated activations, the three products of a grouped linear layer, where a group's tensor
// lives and the FP8 formats and scalings. The upper layers use these enums too (ops/types.h makes
// GluActivation public as torchmoe::GluActivation), so each has one definition.

#include <cstddef>
#include <cstdint>

namespace torchmoe::kernels {

enum class ScalarType { kFloat32, kFloat16, kBFloat16 };

inline size_t element_size(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

// The nonlinearity of a gated activation (GLU family); see glu.h for the math.
enum class GluActivation { kSwiGLU, kClampedSwiGLU };

// The three products of a grouped linear layer, row-major, group g owning rows of x and dy:
//   kFprop  y  = x · Wᵀ (+ b)     kDgrad  dx = dy · W     kWgrad  dW = dyᵀ · x (+= dW)
enum class GemmKind { kFprop, kDgrad, kWgrad };

// FP8 training (split_quantize.h): the two FP8 formats, how a tensor's scales are chosen, and
// which amax of a delayed-scaling history sets the next scale.
enum class Fp8Format { kE4M3, kE5M2 };
enum class QuantizeScaling { kCurrent, kDelayed, kBlock1x128, kBlock128x128 };
enum class AmaxComputeAlgo { kMax, kMostRecent };

// Where group g's matrix or vector lives: base + g · group_stride elements, or, when `table` is
// set, table[g] (a device array of G pointers, for tensors that are not equally spaced).
struct GroupAddress {
  const void* base = nullptr;
  int64_t group_stride = 0;  // elements
  const void* const* table = nullptr;

  bool empty() const { return base == nullptr && table == nullptr; }
};

}  // namespace torchmoe::kernels
