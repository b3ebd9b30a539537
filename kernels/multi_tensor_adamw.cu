// Multi-tensor AdamW and gradient norm; the math and the batching are in multi_tensor_adamw.h.
//
// A block owns one chunk of one tensor and walks it with 16-byte vectors (4 fp32) when every
// pointer of the tensor allows, else element by element; with FP8 copies, one 64×64 tile of one
// expert (adamw_fp8_kernel), since the columnwise copy is a transpose. AdamW is memory-bound: per
// element it reads p, g, m, v (16 bytes) and writes p, m, v (12) plus a 16-bit copy (2), so the
// kernel is built to keep loads wide and independent, not to save arithmetic.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/fp8_cast.cuh"
#include "torchmoe/kernels/multi_tensor_adamw.h"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 512;

// The entry of this block: the last entry whose first block (prefix[i]) is at or before it.
__device__ __forceinline__ int entry_of_block(const int* prefix, int entries) {
  int lo = 0, hi = entries - 1;
  const int block = static_cast<int>(blockIdx.x);
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// What every element's update shares: the gradient's scale, the decay, the step size and
// sqrt(bias_correction2).
struct StepConstants {
  float grad_scale, decay, step_size, sqrt_bc2;
};

__device__ __forceinline__ StepConstants step_constants(const AdamWHyper& h) {
  return {h.grad_scale != nullptr ? *h.grad_scale : 1.0f, 1.0f - h.lr * h.weight_decay,
          h.lr / h.bias_correction1, sqrtf(h.bias_correction2)};
}

// The operations in torch::optim::AdamW's order, so that fp32 results match it to rounding.
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamWHyper& h, const StepConstants& c) {
  g *= c.grad_scale;
  p *= c.decay;
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
  p -= c.step_size * m / (sqrtf(v) / c.sqrt_bc2 + h.eps);
}

// Elements [i, i + 4) of `t` (16-byte aligned): loaded, stepped and stored with their model copy.
// Returns the new values.
template <typename ModelT>
__device__ __forceinline__ float4 adamw_vector(const AdamWTensor& t, int64_t i, const AdamWHyper& h,
                                               const StepConstants& c) {
  float4 p = *reinterpret_cast<const float4*>(t.param + i);
  const float4 g = *reinterpret_cast<const float4*>(t.grad + i);
  float4 m = *reinterpret_cast<const float4*>(t.exp_avg + i);
  float4 v = *reinterpret_cast<const float4*>(t.exp_avg_sq + i);
  adamw_element(p.x, g.x, m.x, v.x, h, c);
  adamw_element(p.y, g.y, m.y, v.y, h, c);
  adamw_element(p.z, g.z, m.z, v.z, h, c);
  adamw_element(p.w, g.w, m.w, v.w, h, c);
  *reinterpret_cast<float4*>(t.param + i) = p;
  *reinterpret_cast<float4*>(t.exp_avg + i) = m;
  *reinterpret_cast<float4*>(t.exp_avg_sq + i) = v;
  if (t.model != nullptr) {
    Vec<ModelT, 4> out;
    out.v[0] = from_float<ModelT>(p.x);
    out.v[1] = from_float<ModelT>(p.y);
    out.v[2] = from_float<ModelT>(p.z);
    out.v[3] = from_float<ModelT>(p.w);
    store<ModelT, 4>(static_cast<ModelT*>(t.model) + i, out);
  }
  return p;
}

template <typename ModelT>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const AdamWBatch batch, const AdamWHyper h) {
  const int index = entry_of_block(batch.chunk_prefix, batch.num_tensors);
  const AdamWTensor t = batch.tensors[index];
  const int64_t begin = (blockIdx.x - batch.chunk_prefix[index]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, t.numel);
  const StepConstants c = step_constants(h);
  ModelT* model = static_cast<ModelT*>(t.model);
  const bool vector = aligned16(t.param) && aligned16(t.grad) && aligned16(t.exp_avg) &&
                      aligned16(t.exp_avg_sq) && (model == nullptr || aligned16(model)) &&
                      begin % 4 == 0;
  if (vector) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * threadIdx.x; i < vector_end; i += 4 * kThreads) {
      adamw_vector<ModelT>(t, i, h, c);
    }
    if (threadIdx.x < end - vector_end) {  // at most 3 trailing elements
      const int64_t i = vector_end + threadIdx.x;
      adamw_element(t.param[i], t.grad[i], t.exp_avg[i], t.exp_avg_sq[i], h, c);
      if (model != nullptr) model[i] = from_float<ModelT>(t.param[i]);
    }
    return;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    adamw_element(t.param[i], t.grad[i], t.exp_avg[i], t.exp_avg_sq[i], h, c);
    if (model != nullptr) model[i] = from_float<ModelT>(t.param[i]);
  }
}

// The FP8 variant, a 64×64 tile of one expert per block (kFp8Threads threads). Thread t owns
// the 4×4 elements at rows 4·(t / 16) + i, columns 4·(t % 16) + j of the tile: per row i one
// 16-byte vector of each fp32 array (16 threads cover a 256-byte row segment) and one FP8 word of
// the rowwise copy. Its four words, transposed in registers, are four columns × 4 rows of the
// columnwise copy; they meet the other threads' in a shared [64 columns][64 rows] byte tile, whose
// rows are stored as 16-byte pieces of the transposed output. Rows of 68 bytes keep both the
// word writes and the row reads within two-way bank conflicts.
constexpr int kFp8Threads = 256;
constexpr int kFp8TileStride = kAdamWFp8Tile + 4;

template <typename ModelT>
__global__ void __launch_bounds__(kFp8Threads)
    adamw_fp8_kernel(const AdamWFp8Batch batch, const AdamWHyper h) {
  __shared__ __align__(16) uint8_t tile[kAdamWFp8Tile * kFp8TileStride];
  __shared__ float warp_amax[kFp8Threads / kWarpSize];
  const int index = entry_of_block(batch.tile_prefix, batch.num_weights);
  const AdamWFp8Weight w = batch.weights[index];
  const int64_t row_tiles = (w.rows + kAdamWFp8Tile - 1) / kAdamWFp8Tile;
  const int64_t col_tiles = (w.cols + kAdamWFp8Tile - 1) / kAdamWFp8Tile;
  const int64_t local = blockIdx.x - batch.tile_prefix[index];
  const int64_t g = local / (row_tiles * col_tiles);
  const int64_t r0 = local / col_tiles % row_tiles * kAdamWFp8Tile;
  const int64_t c0 = local % col_tiles * kAdamWFp8Tile;
  // rows and cols are multiples of 16: a thread's 4×4 block and a 16-row piece of an output row
  // are either wholly inside the matrix or wholly outside.
  const int64_t valid_rows = min(static_cast<int64_t>(kAdamWFp8Tile), w.rows - r0);
  const int64_t valid_cols = min(static_cast<int64_t>(kAdamWFp8Tile), w.cols - c0);
  const int own_row = 4 * (threadIdx.x / 16), own_col = 4 * (threadIdx.x % 16);
  const float scale = w.scale[g];
  const StepConstants c = step_constants(h);
  float amax = 0.0f;
  if (own_row < valid_rows && own_col < valid_cols) {
    uint32_t words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t at = (g * w.rows + r0 + own_row + i) * w.cols + c0 + own_col;
      const float4 p = adamw_vector<ModelT>(w.t, at, h, c);
      amax = abs_max(abs_max(abs_max(abs_max(amax, p.x), p.y), p.z), p.w);
      words[i] = __byte_perm(cast2<__NV_E4M3>(p.x * scale, p.y * scale),
                             cast2<__NV_E4M3>(p.z * scale, p.w * scale), 0x5410);
      *reinterpret_cast<uint32_t*>(w.rowwise + at) = words[i];
    }
    uint32_t columns[4];
    transpose4x4(words[0], words[1], words[2], words[3], columns);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      *reinterpret_cast<uint32_t*>(tile + (own_col + j) * kFp8TileStride + own_row) = columns[j];
    }
  }
  __syncthreads();
  // Output row `col` of the tile (column c0 + col), rows [16·q, 16·q + 16): one 16-byte store.
  const int col = threadIdx.x / 4, q = threadIdx.x % 4;
  if (col < valid_cols && 16 * q < valid_rows) {
    const uint32_t* src = reinterpret_cast<const uint32_t*>(tile + col * kFp8TileStride + 16 * q);
    *reinterpret_cast<uint4*>(w.columnwise + (g * w.cols + c0 + col) * w.rows + r0 + 16 * q) =
        make_uint4(src[0], src[1], src[2], src[3]);
  }
  amax = warp_max(amax);
  if (threadIdx.x % kWarpSize == 0) warp_amax[threadIdx.x / kWarpSize] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int i = 1; i < kFp8Threads / kWarpSize; ++i) amax = fmaxf(amax, warp_amax[i]);
    atomic_max_nonnegative(w.amax + g, amax);
    if (r0 == 0 && c0 == 0) w.scale_inv[g] = __frcp_rn(scale);
  }
}

__global__ void __launch_bounds__(kThreads)
    sum_of_squares_kernel(const AdamWBatch batch, float* partials, int64_t first_chunk) {
  const int index = entry_of_block(batch.chunk_prefix, batch.num_tensors);
  const AdamWTensor t = batch.tensors[index];
  const int64_t begin = (blockIdx.x - batch.chunk_prefix[index]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, t.numel);
  float sum = 0.0f;
  if (aligned16(t.grad) && begin % 4 == 0) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * threadIdx.x; i < vector_end; i += 4 * kThreads) {
      const float4 g = *reinterpret_cast<const float4*>(t.grad + i);
      sum += g.x * g.x + g.y * g.y + g.z * g.z + g.w * g.w;
    }
    if (threadIdx.x < end - vector_end) {
      const float g = t.grad[vector_end + threadIdx.x];
      sum += g * g;
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) sum += t.grad[i] * t.grad[i];
  }
  __shared__ float warp_sums[kThreads / kWarpSize];
  sum = warp_sum(sum);
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = sum;
  __syncthreads();
  if (threadIdx.x < kWarpSize) {
    sum = threadIdx.x < kThreads / kWarpSize ? warp_sums[threadIdx.x] : 0.0f;
    sum = warp_sum(sum);
    if (threadIdx.x == 0) partials[first_chunk + blockIdx.x] = sum;
  }
}

// One block; each thread sums a strided share of the partials in double, then a fixed-order tree.
__global__ void __launch_bounds__(kThreads)
    finish_norm_kernel(const float* partials, int64_t count, double max_norm, float* norm,
                       float* coefficient) {
  __shared__ double sums[kThreads];
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) sum += partials[i];
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) sums[threadIdx.x] += sums[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double total = sqrt(sums[0]);
    norm[0] = static_cast<float>(total);
    // NaN stays NaN (a NaN or inf / inf norm), as clip_grad_norm_'s clamp leaves it: fmin alone
    // would return 1 and step unclipped.
    const double ratio = max_norm / (total + 1e-6);
    if (coefficient != nullptr)
      coefficient[0] = static_cast<float>(isnan(ratio) ? ratio : fmin(1.0, ratio));
  }
}

}  // namespace

void launch_adamw(const AdamWBatch& batch, const AdamWHyper& hyper, cudaStream_t stream) {
  const int blocks = batch.chunk_prefix[batch.num_tensors];
  if (blocks == 0) return;
  dispatch_type(hyper.model_type, [&](auto tag) {
    using T = decltype(tag);
    adamw_kernel<T><<<blocks, kThreads, 0, stream>>>(batch, hyper);
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_adamw_fp8(const AdamWFp8Batch& batch, const AdamWHyper& hyper, cudaStream_t stream) {
  const int blocks = batch.tile_prefix[batch.num_weights];
  if (blocks == 0) return;
  dispatch_type(hyper.model_type, [&](auto tag) {
    using T = decltype(tag);
    adamw_fp8_kernel<T><<<blocks, kFp8Threads, 0, stream>>>(batch, hyper);
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_sum_of_squares(const AdamWBatch& batch, float* partials, int64_t first_chunk,
                           cudaStream_t stream) {
  const int blocks = batch.chunk_prefix[batch.num_tensors];
  if (blocks == 0) return;
  sum_of_squares_kernel<<<blocks, kThreads, 0, stream>>>(batch, partials, first_chunk);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_finish_norm(const float* partials, int64_t count, double max_norm, float* norm,
                        float* coefficient, cudaStream_t stream) {
  finish_norm_kernel<<<1, kThreads, 0, stream>>>(partials, count, max_norm, norm, coefficient);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
