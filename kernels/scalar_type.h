#pragma once
// Element types the kernels take, named without ATen (the kernel layer never sees at::Tensor).

#include <cstddef>

namespace torchmoe::kernels {

enum class ScalarType { kFloat32, kFloat16, kBFloat16 };

inline size_t element_size(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

}  // namespace torchmoe::kernels
