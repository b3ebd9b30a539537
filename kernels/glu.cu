// Fused (scaled) SwiGLU / ClampedSwiGLU forward and backward. Layout and math: glu.h.
//
// A warp's lanes stride over a row in vectors of V elements: 16-byte loads and stores when H, G
// and the pointers allow, else V = 1. In the backward one warp walks whole rows (grid-stride over
// rows, a one-wave grid: one_wave_grid) so that the scale gradient, a sum over the row, is a
// shuffle reduction in the same pass: no second kernel and no block barrier. (A block per row with
// a block reduction was measured at 73-81% of copy bandwidth in backward on the H100; see
// docs/experiments.md.) The forward has no row sum, so its work item is one chunk (32·V elements
// of a row), a grid of one block per eight chunks, one per warp: two loads per lane, the math, a
// store. Measured on the H100 with a standalone copy of the kernel, taking turns (% of a copy of
// the same bytes on the five benchmark shapes): the full grid 101.8-103.1; the kernel it replaced,
// a one-wave grid looping over the chunks, 90.1-99.1 (bench_glu in the same lease: 89-94% of its
// copy); that loop with the next chunk loaded before the math and store 93.4-98.1; two chunks per
// warp loaded before the math 90.0-98.5. Earlier, on the one-wave grid: two, three or four chunks
// per item 74-80, 59-63 and 31-37; segments of two to eight chunks per warp 78-93.

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/glu.h"
#include "torchmoe/kernels/glu_math.cuh"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = kWarpSize;
constexpr int kWarpsPerBlock = kThreads / kWarp;

template <typename T, typename S, GluActivation K, int V>
__global__ void glu_forward_kernel(const T* __restrict__ input, const S* __restrict__ scales,
                                   T* __restrict__ output, int64_t rows, int64_t hidden,
                                   int64_t interleave, ActParams p) {
  const int64_t gate_offset = interleave ? interleave : hidden;
  const int64_t chunks = chunk_count<V>(hidden);
  const int lane = threadIdx.x % kWarp;
  // One pass for grids of every item's block; a loop only past kMaxGridX blocks.
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       item < rows * chunks; item += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t row = item / chunks;
    const int64_t j = (item - row * chunks) * kWarp * V + lane * V;
    if (j >= hidden) continue;
    const T* in = input + row * 2 * hidden + a_index(j, interleave);
    const Vec<T, V> a = load<T, V>(in), b = load<T, V>(in + gate_offset);
    const float scale = scales ? to_float(scales[row]) : 1.0f;
    Vec<T, V> y;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      y.v[i] = glu_output<T, K>(to_float(a.v[i]), to_float(b.v[i]), scale, p);
    }
    store<T, V>(output + row * hidden + j, y);
  }
}

template <typename T, typename S, GluActivation K, int V>
__global__ void glu_backward_kernel(const T* __restrict__ input, const S* __restrict__ scales,
                                    const T* __restrict__ grad_output, T* __restrict__ grad_input,
                                    S* __restrict__ grad_scales, int64_t rows, int64_t hidden,
                                    int64_t interleave, ActParams p) {
  const int64_t gate_offset = interleave ? interleave : hidden;
  const int64_t chunks = chunk_count<V>(hidden);
  const int lane = threadIdx.x % kWarp;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       row < rows; row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const T* in = input + row * 2 * hidden;
    const T* dy = grad_output + row * hidden;
    T* dx = grad_input + row * 2 * hidden;
    const float scale = scales ? to_float(scales[row]) : 1.0f;
    float scale_grad = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t j = chunk_start<V>(c, row, chunks) + lane * V;
      if (j >= hidden) continue;
      const int64_t ai = a_index(j, interleave);
      const Vec<T, V> a = load<T, V>(in + ai), b = load<T, V>(in + ai + gate_offset);
      const Vec<T, V> g = load<T, V>(dy + j);
      Vec<T, V> da, db;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const GluTerms t = glu_terms<K>(to_float(a.v[i]), to_float(b.v[i]), p);
        const float dyi = to_float(g.v[i]);
        da.v[i] = from_float<T>(dyi * scale * t.d_a);
        db.v[i] = from_float<T>(dyi * scale * t.d_b);
        scale_grad += dyi * t.value;
      }
      store<T, V>(dx + ai, da);
      store<T, V>(dx + ai + gate_offset, db);
    }
    if (grad_scales != nullptr) {  // uniform across the warp: every lane joins the shuffles
      const float total = warp_sum(scale_grad);
      if (lane == 0) grad_scales[row] = from_float<S>(total);
    }
  }
}

// Calls fn(T{}, S{}) with the device types of the data and scale types.
template <typename Fn>
void dispatch_types(const GluParams& params, Fn&& fn) {
  dispatch_type(params.data_type, [&](auto data_tag) {
    dispatch_type(params.scale_type, [&](auto scale_tag) { fn(data_tag, scale_tag); });
  });
}

// 16-byte vectors when the sizes and every pointer allow.
bool vectorizable(const GluParams& params, int vector,
                  std::initializer_list<const void*> pointers) {
  return params.hidden % vector == 0 && params.interleave % vector == 0 && aligned16(pointers);
}

// The one place that turns runtime parameters into a kernel instantiation: resolves the data
// type T, scale type S, activation K and vector width V (16 bytes when `pointers` and the sizes
// allow), then calls launch(T{}, S{}, K tag, V tag) and checks the launch.
template <typename Launch>
void dispatch(const GluParams& params, std::initializer_list<const void*> pointers,
              Launch&& launch) {
  dispatch_types(params, [&](auto data_tag, auto scale_tag) {
    constexpr int kVec = 16 / sizeof(decltype(data_tag));
    const bool vectorized = vectorizable(params, kVec, pointers);
    auto with_kind = [&](auto kind_tag) {
      if (vectorized) {
        launch(data_tag, scale_tag, kind_tag, std::integral_constant<int, kVec>{});
      } else {
        launch(data_tag, scale_tag, kind_tag, std::integral_constant<int, 1>{});
      }
    };
    if (params.activation == GluActivation::kSwiGLU) {
      with_kind(std::integral_constant<GluActivation, GluActivation::kSwiGLU>{});
    } else {
      with_kind(std::integral_constant<GluActivation, GluActivation::kClampedSwiGLU>{});
    }
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_glu_forward(const GluParams& params, cudaStream_t stream) {
  if (params.rows == 0 || params.hidden == 0) return;  // a grid of no blocks is not a launch
  const ActParams act{params.limit, params.alpha, params.offset};
  dispatch(params, {params.input, params.output},
           [&](auto data_tag, auto scale_tag, auto kind, auto vec) {
             using T = decltype(data_tag);
             using S = decltype(scale_tag);
             constexpr int kVec = decltype(vec)::value;
             auto* kernel = glu_forward_kernel<T, S, decltype(kind)::value, kVec>;
             const int64_t items = params.rows * chunk_count<kVec>(params.hidden);
             kernel<<<full_grid(items, kWarpsPerBlock), kThreads, 0, stream>>>(
                 static_cast<const T*>(params.input), static_cast<const S*>(params.scales),
                 static_cast<T*>(params.output), params.rows, params.hidden, params.interleave,
                 act);
           });
}

void launch_glu_backward(const GluParams& params, cudaStream_t stream) {
  if (params.rows == 0) return;
  const ActParams act{params.limit, params.alpha, params.offset};
  dispatch(params, {params.input, params.grad_output, params.grad_input},
           [&](auto data_tag, auto scale_tag, auto kind, auto vec) {
             using T = decltype(data_tag);
             using S = decltype(scale_tag);
             auto* kernel = glu_backward_kernel<T, S, decltype(kind)::value, decltype(vec)::value>;
             const unsigned grid = one_wave_grid(
                 kernel, kThreads, 0, (params.rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
             kernel<<<grid, kThreads, 0, stream>>>(
                 static_cast<const T*>(params.input), static_cast<const S*>(params.scales),
                 static_cast<const T*>(params.grad_output), static_cast<T*>(params.grad_input),
                 static_cast<S*>(params.grad_scales), params.rows, params.hidden, params.interleave,
                 act);
           });
}

}  // namespace torchmoe::kernels
