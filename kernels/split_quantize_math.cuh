#pragma once
// Split-quantize's element maths: amax, amax → scale (TE's compute_scale_from_amax), and the
// saturating e4m3/e5m2 cast, on a thread's 16-byte pieces held as four 32-bit words. Kept apart
// from the kernel so that the numerics (split_quantize.h's contract) sit in one place, apart
// from where the data goes. Included by split_quantize.cu and quantize_delayed_update.cu.
//
// 16-bit types hold elements 2w and 2w + 1 in word w (the first in the low half), fp32 one
// element per word. The arithmetic works on whole words: the amaxes of 16-bit inputs stay packed
// (two elements per instruction) and the casts produce four FP8 bytes per word.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/fp8_cast.cuh"
#include "torchmoe/kernels/split_quantize_layout.cuh"

namespace torchmoe::kernels::split_quantize {

// The input type's largest finite value: the block scalings' scale for an infinite fp8_max / amax
// (TE's value_for_inf).
template <typename T>
struct InputLimits;
template <>
struct InputLimits<float> {
  static constexpr float kMax = FLT_MAX;
};
template <>
struct InputLimits<__half> {
  static constexpr float kMax = 65504.0f;
};
template <>
struct InputLimits<__nv_bfloat16> {
  static constexpr float kMax = 3.38953139e38f;  // 0x7f7f
};

// TE's compute_scale_from_amax (recipe/recipe_common.cuh).
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max, bool pow2,
                                                 float epsilon, float value_for_inf) {
  if (amax < epsilon) amax = epsilon;
  if (isinf(amax) || amax == 0.0f || isnan(amax)) return 1.0f;
  float scale = __fdiv_rn(fp8_max, amax);
  if (isinf(scale)) scale = value_for_inf;
  if (pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xff800000u);
  return scale;
}

// Max over the block; every thread gets it. `scratch`: kWarps floats. Ends with the block
// synchronized, so scratch may be reused at once.
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  if (threadIdx.x % kWarpSize == 0) scratch[threadIdx.x / kWarpSize] = v;
  __syncthreads();
  float m = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();
  return m;
}

// ---- a thread's 16-byte piece of a row (V elements) as four 32-bit words ----

// A 16-byte piece as the four words the kernel works on, and back.
__device__ __forceinline__ void set_words(uint32_t (&w)[4], const uint4& u) {
  w[0] = u.x;
  w[1] = u.y;
  w[2] = u.z;
  w[3] = u.w;
}
__device__ __forceinline__ uint4 pack_words(const uint32_t (&w)[4]) {
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// The words of a 16-byte vector.
template <typename T, int V>
__device__ __forceinline__ void to_words(const Vec<T, V>& v, uint32_t (&w)[4]) {
  set_words(w, *reinterpret_cast<const uint4*>(&v));
}

template <typename T>
struct PackedPair {  // 16-bit types
  using Type = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
};

// Running max |x| over words (NaN ignored, as abs_max).
template <typename T>
struct AbsMax {
  using T2 = typename PackedPair<T>::Type;
  T2 m = as_pair(0u);
  __device__ __forceinline__ void add(uint32_t w) { m = __hmax2(m, __habs2(as_pair(w))); }
  __device__ __forceinline__ float value() const {
    const float2 f = to_float2(m);
    return fmaxf(f.x, f.y);
  }
  __device__ __forceinline__ float lo() const { return to_float2(m).x; }
  __device__ __forceinline__ float hi() const { return to_float2(m).y; }

 private:
  __device__ __forceinline__ static T2 as_pair(uint32_t w) { return *reinterpret_cast<T2*>(&w); }
  __device__ __forceinline__ static float2 to_float2(__nv_bfloat162 v) {
    return __bfloat1622float2(v);
  }
  __device__ __forceinline__ static float2 to_float2(__half2 v) { return __half22float2(v); }
};
template <>
struct AbsMax<float> {
  float m = 0.0f;
  __device__ __forceinline__ void add(uint32_t w) { m = abs_max(m, __uint_as_float(w)); }
  __device__ __forceinline__ float value() const { return m; }
};

// Max |x| over this thread's P pieces.
template <typename T, int P>
__device__ __forceinline__ float pieces_amax(const uint32_t (&x)[P][4]) {
  AbsMax<T> a;
#pragma unroll
  for (int i = 0; i < P; ++i) {
#pragma unroll
    for (int w = 0; w < 4; ++w) a.add(x[i][w]);
  }
  return a.value();
}

// kBlock1x128: the amax of row lane_col / 2 of this thread's row group, from the P rows' pieces
// of its 2P lanes (lanes 2i and 2i + 1 end with row i's). Halving exchanges: at each step a lane
// keeps half of its rows and sends the other half to the partner that keeps those, P shuffles
// instead of P·log2(2P); the caller turns the result into a scale (one division per lane, not P).
// `v`: P floats of scratch, the kernel's (fp32's P = 16 leave them in local memory, and an array
// of this function's own let the compiler drop a store that the kernel's keeps: not the same code).
template <typename T, int P>
__device__ __forceinline__ float own_row_amax(const uint32_t (&x)[P][4], int lane_col,
                                              float (&v)[P]) {
  constexpr int kRowThreads = PieceShape<T>::kRowThreads;
  static_assert(kRowThreads == 2 * P, "two lanes per row after the exchanges");
#pragma unroll
  for (int i = 0; i < P; ++i) {
    AbsMax<T> a;
#pragma unroll
    for (int w = 0; w < 4; ++w) a.add(x[i][w]);
    v[i] = a.value();
  }
  // The lane with bit `offset` set keeps rows [half, 2·half) of its current ones: after the
  // steps, row lane_col / 2 of the group.
#pragma unroll
  for (int half = P / 2, offset = kRowThreads / 2; half > 0; half /= 2, offset /= 2) {
    const bool upper = (lane_col & offset) != 0;
#pragma unroll
    for (int j = 0; j < half; ++j) {
      const float send = upper ? v[j] : v[j + half];
      const float keep = upper ? v[j + half] : v[j];
      v[j] = fmaxf(keep, __shfl_xor_sync(kFullMask, send, offset));
    }
  }
  return fmaxf(v[0], __shfl_xor_sync(kFullMask, v[0], 1));
}

// Element j of a piece, as fp32.
template <typename T>
__device__ __forceinline__ float element_at(const uint32_t (&w)[4], int j) {
  if constexpr (std::is_same_v<T, float>) {
    return __uint_as_float(w[j]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    // A bf16 is the upper half of the fp32 of the same value.
    return __uint_as_float(j % 2 == 0 ? w[j / 2] << 16 : w[j / 2] & 0xffff0000u);
  } else {
    const __half2 h = *reinterpret_cast<const __half2*>(&w[j / 2]);
    return __half2float(j % 2 == 0 ? __low2half(h) : __high2half(h));
  }
}

// The piece cast with `scale`: V FP8 bytes, four per word, in element order.
template <typename T, __nv_fp8_interpretation_t F>
__device__ __forceinline__ void cast_piece(const uint32_t (&w)[4], float scale,
                                           uint32_t (&out)[16 / sizeof(T) / 4]) {
#pragma unroll
  for (int o = 0; o < 16 / static_cast<int>(sizeof(T)) / 4; ++o) {
    const int j = 4 * o;
    const uint32_t lo = cast2<F>(element_at<T>(w, j) * scale, element_at<T>(w, j + 1) * scale);
    const uint32_t hi = cast2<F>(element_at<T>(w, j + 2) * scale, element_at<T>(w, j + 3) * scale);
    out[o] = __byte_perm(lo, hi, 0x5410);
  }
}

// Column j of rows i .. i + 3 of this thread's pieces cast with `scale`: four FP8 bytes of the
// transposed copy, row i in the low byte.
template <typename T, __nv_fp8_interpretation_t F, int P>
__device__ __forceinline__ uint32_t cast_column_word(const uint32_t (&x)[P][4], int i, int j,
                                                     float scale) {
  const uint32_t lo = cast2<F>(element_at<T>(x[i], j) * scale, element_at<T>(x[i + 1], j) * scale);
  const uint32_t hi =
      cast2<F>(element_at<T>(x[i + 2], j) * scale, element_at<T>(x[i + 3], j) * scale);
  return __byte_perm(lo, hi, 0x5410);
}

}  // namespace torchmoe::kernels::split_quantize
