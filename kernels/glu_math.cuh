#pragma once
// The gated activations' math (glu.h), shared by the GLU kernels and by split-quantize's GLU
// source (split_quantize.h), so that a fused cast rounds exactly what glu_forward would have
// written. Included by .cu files only.

#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

struct ActParams {
  float limit, alpha, offset;  // ClampedSwiGLU only
};

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// act(a)·gate(b) and its partial derivatives with respect to a and b.
struct GluTerms {
  float value, d_a, d_b;
};

template <GluActivation K>
__device__ __forceinline__ GluTerms glu_terms(float a, float b, const ActParams& p) {
  if constexpr (K == GluActivation::kSwiGLU) {
    const float s = sigmoid(a);
    const float act = a * s;
    return {act * b, (s + act * (1.0f - s)) * b, act};
  } else {
    const float ac = fminf(a, p.limit);
    const float s = sigmoid(p.alpha * ac);
    const float act = ac * s;
    const float gate = fminf(fmaxf(b, -p.limit), p.limit) + p.offset;
    const float d_act = a <= p.limit ? s + p.alpha * act * (1.0f - s) : 0.0f;
    const float d_gate = (b >= -p.limit && b <= p.limit) ? 1.0f : 0.0f;
    return {act * gate, d_act * gate, act * d_gate};
  }
}

// One output element, y = s·act(a)·gate(b) rounded once to T: what glu_forward stores, and what a
// fused cast reads in its place.
template <typename T, GluActivation K>
__device__ __forceinline__ T glu_output(float a, float b, float scale, const ActParams& p) {
  return from_float<T>(scale * glu_terms<K>(a, b, p).value);
}

// Position of a_j within a row; b_j sits `gate_offset` after it (interleave, or H for halves).
__device__ __forceinline__ int64_t a_index(int64_t j, int64_t interleave) {
  return interleave ? (j / interleave) * 2 * interleave + j % interleave : j;
}

}  // namespace torchmoe::kernels
