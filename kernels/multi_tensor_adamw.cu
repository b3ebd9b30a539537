// Multi-tensor AdamW and gradient norm; the math and the batching are in multi_tensor_adamw.h.
//
// A block owns one chunk of one tensor and walks it with 16-byte vectors (4 fp32) when every
// pointer of the tensor allows, else element by element. AdamW is memory-bound: per element it
// reads p, g, m, v (16 bytes) and writes p, m, v (12) plus a 16-bit copy (2), so the kernel is
// built to keep loads wide and independent, not to save arithmetic.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/multi_tensor_adamw.h"

namespace torchmoe::kernels {
namespace {

constexpr int kThreads = 512;

// The tensor and chunk of this block: the last tensor whose first chunk is at or before it.
__device__ __forceinline__ int tensor_of_block(const AdamWBatch& batch) {
  int lo = 0, hi = batch.num_tensors - 1;
  const int block = static_cast<int>(blockIdx.x);
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.chunk_prefix[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The operations in torch::optim::AdamW's order, so that fp32 results match it to rounding.
__device__ __forceinline__ void adamw_element(float& p, float g, float& m, float& v,
                                              const AdamWHyper& h, float decay, float step_size,
                                              float sqrt_bc2) {
  p *= decay;
  m = h.beta1 * m + (1.0f - h.beta1) * g;
  v = h.beta2 * v + (1.0f - h.beta2) * g * g;
  p -= step_size * m / (sqrtf(v) / sqrt_bc2 + h.eps);
}

template <typename ModelT>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWBatch batch, const AdamWHyper h) {
  const int index = tensor_of_block(batch);
  const AdamWTensor t = batch.tensors[index];
  const int64_t begin = (blockIdx.x - batch.chunk_prefix[index]) * kAdamWChunk;
  const int64_t end = min(begin + kAdamWChunk, t.numel);
  const float scale = h.grad_scale != nullptr ? *h.grad_scale : 1.0f;
  const float decay = 1.0f - h.lr * h.weight_decay;
  const float step_size = h.lr / h.bias_correction1;
  const float sqrt_bc2 = sqrtf(h.bias_correction2);
  ModelT* model = static_cast<ModelT*>(t.model);
  const bool vector = aligned16(t.param) && aligned16(t.grad) && aligned16(t.exp_avg) &&
                      aligned16(t.exp_avg_sq) && (model == nullptr || aligned16(model)) &&
                      begin % 4 == 0;
  if (vector) {
    const int64_t vector_end = begin + (end - begin) / 4 * 4;
    for (int64_t i = begin + 4 * threadIdx.x; i < vector_end; i += 4 * kThreads) {
      float4 p = *reinterpret_cast<const float4*>(t.param + i);
      const float4 g = *reinterpret_cast<const float4*>(t.grad + i);
      float4 m = *reinterpret_cast<const float4*>(t.exp_avg + i);
      float4 v = *reinterpret_cast<const float4*>(t.exp_avg_sq + i);
      adamw_element(p.x, g.x * scale, m.x, v.x, h, decay, step_size, sqrt_bc2);
      adamw_element(p.y, g.y * scale, m.y, v.y, h, decay, step_size, sqrt_bc2);
      adamw_element(p.z, g.z * scale, m.z, v.z, h, decay, step_size, sqrt_bc2);
      adamw_element(p.w, g.w * scale, m.w, v.w, h, decay, step_size, sqrt_bc2);
      *reinterpret_cast<float4*>(t.param + i) = p;
      *reinterpret_cast<float4*>(t.exp_avg + i) = m;
      *reinterpret_cast<float4*>(t.exp_avg_sq + i) = v;
      if (model != nullptr) {
        Vec<ModelT, 4> out;
        out.v[0] = from_float<ModelT>(p.x);
        out.v[1] = from_float<ModelT>(p.y);
        out.v[2] = from_float<ModelT>(p.z);
        out.v[3] = from_float<ModelT>(p.w);
        store<ModelT, 4>(model + i, out);
      }
    }
    if (threadIdx.x < end - vector_end) {  // at most 3 trailing elements
      const int64_t i = vector_end + threadIdx.x;
      adamw_element(t.param[i], t.grad[i] * scale, t.exp_avg[i], t.exp_avg_sq[i], h, decay,
                    step_size, sqrt_bc2);
      if (model != nullptr) model[i] = from_float<ModelT>(t.param[i]);
    }
    return;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    adamw_element(t.param[i], t.grad[i] * scale, t.exp_avg[i], t.exp_avg_sq[i], h, decay,
                  step_size, sqrt_bc2);
    if (model != nullptr) model[i] = from_float<ModelT>(t.param[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    sum_of_squares_kernel(const AdamWBatch batch, float* partials, int64_t first_chunk) {
  const int index = tensor_of_block(batch);
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
    if (coefficient != nullptr) coefficient[0] = static_cast<float>(fmin(1.0, max_norm / (total + 1e-6)));
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
