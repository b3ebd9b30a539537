#pragma once
// Fused (scaled) gated activations: SwiGLU and ClampedSwiGLU, optionally with a per-row scale,
// forward and backward (including the scale gradient) in one pass each.
//
// Kernel layer: raw pointers, sizes and a stream. Validation and dispatch: ops/glu.cpp.
//
// Row r of the input holds 2H values: `a` (through the nonlinearity) and `b` (the gate), either
// as halves [a_0..a_{H-1} | b_0..b_{H-1}] or interleaved in blocks of G:
//
//     [a_0..a_{G-1} | b_0..b_{G-1} | a_G..a_{2G-1} | b_G..b_{2G-1} | ...]
//
// (the layout a fused FC1 epilogue produces when gate and linear columns share a tile). The output
// row y[r, 0..H) is always in plain order; dx is written back in the input's layout.
//
//   y[r, j]  = s[r] · act(a_j) · gate(b_j)
//   da_j     = dy[r, j] · s[r] · act'(a_j) · gate(b_j)
//   db_j     = dy[r, j] · s[r] · act(a_j)  · gate'(b_j)
//   ds[r]    = Σ_j dy[r, j] · act(a_j) · gate(b_j)
//
// SwiGLU: act(a) = a·σ(a), gate(b) = b. ClampedSwiGLU: ac = min(a, limit), act = ac·σ(alpha·ac),
// gate = clamp(b, ±limit) + offset, with zero gradient where clamped. All math in fp32, one
// rounding at each store.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

struct GluParams {
  GluActivation activation = GluActivation::kSwiGLU;
  float limit = 7.0f, alpha = 1.702f, offset = 1.0f;  // ClampedSwiGLU only
  int64_t rows = 0;
  int64_t hidden = 0;                            // H: output width; the input is 2H wide
  int64_t interleave = 0;                        // G, or 0 for halves
  ScalarType data_type = ScalarType::kFloat32;   // input, output, grad_output, grad_input
  ScalarType scale_type = ScalarType::kFloat32;  // scales and grad_scales

  const void* input = nullptr;        // [rows, 2H]
  const void* scales = nullptr;       // [rows] or null (unscaled)
  void* output = nullptr;             // forward: [rows, H]
  const void* grad_output = nullptr;  // backward: [rows, H]
  void* grad_input = nullptr;         // backward: [rows, 2H]
  void* grad_scales = nullptr;        // backward: [rows] or null
};

void launch_glu_forward(const GluParams& params, cudaStream_t stream);
void launch_glu_backward(const GluParams& params, cudaStream_t stream);

}  // namespace torchmoe::kernels
