#pragma once
// The kernel layer's vocabulary, named without ATen (kernels never see at::Tensor): element types,
// the gated activations, the three products of a grouped linear layer, where a group's tensor
// lives and the FP8 formats and scalings. The upper layers use these enums too, so each has one
// definition; the ones a user names (GluActivation, AmaxComputeAlgo, LoadedCublasLt) are in
// namespace torchmoe, so that no public header names a type of the kernel layer's namespace.
// Installed: no CUDA or cuBLAS headers here.

#include <cstddef>
#include <cstdint>
#include <string>

namespace torchmoe {

/// The nonlinearity of a gated activation (GLU family; kernels/glu.h has the math): SwiGLU, or
/// ClampedSwiGLU (GPT-OSS).
enum class GluActivation { kSwiGLU, kClampedSwiGLU };

/// Which amax of a delayed-scaling history sets the next scale (fp8::DelayedScaling): the largest
/// of the history, or the most recent.
enum class AmaxComputeAlgo { kMax, kMostRecent };

/// The cuBLASLt this process loaded and whether GemmBackend::kCublasLtGrouped can use it (it needs
/// 13.8 or newer): what to print when that backend is refused. torchmoe::loaded_cublaslt()
/// (ops/types.h) returns it; kernels/grouped_gemm_cublaslt_grouped.h looks it up.
struct LoadedCublasLt {
  size_t version = 0;    ///< cublasLtGetVersion(): major·10000 + minor·100 + patch
  std::string library;   ///< the shared object's path
  bool grouped = false;  ///< the grouped matmul is usable (>= 13.8, its entry point found)
};

}  // namespace torchmoe

namespace torchmoe::kernels {

using torchmoe::AmaxComputeAlgo;
using torchmoe::GluActivation;
using torchmoe::LoadedCublasLt;

enum class ScalarType { kFloat32, kFloat16, kBFloat16 };

inline size_t element_size(ScalarType type) { return type == ScalarType::kFloat32 ? 4 : 2; }

// The three products of a grouped linear layer, row-major, group g owning rows of x and dy:
//   kFprop  y  = x · Wᵀ (+ b)     kDgrad  dx = dy · W     kWgrad  dW = dyᵀ · x (+= dW)
enum class GemmKind { kFprop, kDgrad, kWgrad };

// FP8 training (split_quantize.h): the two FP8 formats and how a tensor's scales are chosen.
enum class Fp8Format { kE4M3, kE5M2 };
enum class QuantizeScaling { kCurrent, kDelayed, kBlock1x128, kBlock128x128 };

// Where group g's matrix or vector lives: base + g · group_stride elements, or, when `table` is
// set, table[g] (a device array of G pointers, for tensors that are not equally spaced).
struct GroupAddress {
  const void* base = nullptr;
  int64_t group_stride = 0;  // elements
  const void* const* table = nullptr;

  bool empty() const { return base == nullptr && table == nullptr; }
};

}  // namespace torchmoe::kernels
