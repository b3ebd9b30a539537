#pragma once
// Device helpers of the kernels that write FP8 (split_quantize.cu, multi_tensor_adamw.cu): the
// saturating cast, the amax that ignores NaN, its order-free atomic max, and the 4×4 byte
// transpose that turns rowwise FP8 words into columnwise ones. Included by .cu files only.

#include <cuda_fp8.h>

#include <cstdint>

namespace torchmoe::kernels {

// max into a float holding a non-negative value: as integers, non-negative floats (inf
// included) order like their values, and the max of a set does not depend on the order.
__device__ __forceinline__ void atomic_max_nonnegative(float* address, float value) {
  if (value > 0.0f) atomicMax(reinterpret_cast<int*>(address), __float_as_int(value));
}

// fmaxf drops NaN: a NaN element never becomes the amax (TE's amax kernels do the same).
__device__ __forceinline__ float abs_max(float m, float x) { return fmaxf(m, fabsf(x)); }

// Two values cast to FP8 (round to nearest even, saturating to the largest finite value; NaN
// stays NaN), a in the low byte.
template <__nv_fp8_interpretation_t F>
__device__ __forceinline__ uint16_t cast2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, F);
}

// 4×4 byte transpose: r[i] holds bytes (row i, columns 0..3); c[j] gets (rows 0..3, column j).
__device__ __forceinline__ void transpose4x4(uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3,
                                             uint32_t (&c)[4]) {
  const uint32_t t0 = __byte_perm(r0, r1, 0x5140), t1 = __byte_perm(r0, r1, 0x7362);
  const uint32_t t2 = __byte_perm(r2, r3, 0x5140), t3 = __byte_perm(r2, r3, 0x7362);
  c[0] = __byte_perm(t0, t2, 0x5410);
  c[1] = __byte_perm(t0, t2, 0x7632);
  c[2] = __byte_perm(t1, t3, 0x5410);
  c[3] = __byte_perm(t1, t3, 0x7632);
}

}  // namespace torchmoe::kernels
