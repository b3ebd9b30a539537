// Per-group column sums (the bias gradient of a grouped linear layer); contract in
// grouped_column_sum.h. One block per (group, chunk of 2·kSumColumnPairs columns): a warp's lanes
// take a column pair each, kSumRowSlices warps take interleaved rows, and the slices' partial sums
// are added in a fixed order. A file of its own: it shares only the group clamping (split_at) with
// the sm90 GEMM and uses none of its sm_90a machinery.

#include "torchmoe/kernels/grouped_column_sum.h"

#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"

namespace torchmoe::kernels {
namespace {

constexpr int kSumColumnPairs = 32, kSumRowSlices = 8;

template <typename T>
__global__ void grouped_column_sum_kernel(const GroupedColumnSumParams p) {
  __shared__ int64_t group_start;
  __shared__ float partial[kSumRowSlices][kSumColumnPairs][2];
  // Groups past gridDim.y (at most kMaxGridY) are taken in turn.
  for (int g = blockIdx.y; g < p.num_groups; g += gridDim.y) {
    if (threadIdx.y == 0) {
      int64_t sum = 0;
      for (int h = threadIdx.x; h < g; h += kWarpSize)
        sum += split_at(p.m_splits, p.splits_int32, h, p.rows);
      sum = warp_sum(sum);
      if (threadIdx.x == 0) group_start = sum;
    }
    __syncthreads();
    const int64_t begin = min(group_start, p.rows);
    const int64_t count = min(split_at(p.m_splits, p.splits_int32, g, p.rows), p.rows - begin);
    const int64_t col = (static_cast<int64_t>(blockIdx.x) * kSumColumnPairs + threadIdx.x) * 2;
    const T* dy = static_cast<const T*>(p.grad_output);
    float s0 = 0.0f, s1 = 0.0f;
    if (col < p.n) {
      for (int64_t r = threadIdx.y; r < count; r += kSumRowSlices) {
        const T* src = dy + (begin + r) * p.n + col;
        s0 += to_float(src[0]);
        s1 += to_float(src[1]);
      }
    }
    partial[threadIdx.y][threadIdx.x][0] = s0;
    partial[threadIdx.y][threadIdx.x][1] = s1;
    __syncthreads();
    if (threadIdx.y == 0 && col < p.n) {
      for (int s = 1; s < kSumRowSlices; ++s) {  // fixed order: deterministic
        s0 += partial[s][threadIdx.x][0];
        s1 += partial[s][threadIdx.x][1];
      }
      T* out = const_cast<T*>(group_ptr<T>(p.bias_grad, g)) + col;
      // A pair store where the gradient's address allows one (a view may start anywhere).
      if (reinterpret_cast<uintptr_t>(out) % (2 * sizeof(T)) == 0) {
        store2(out, s0, s1);
      } else {
        out[0] = from_float<T>(s0);
        out[1] = from_float<T>(s1);
      }
    }
    __syncthreads();  // group_start and partial are the next group's
  }
}

}  // namespace

void launch_grouped_column_sum(const GroupedColumnSumParams& p, cudaStream_t stream) {
  if (p.num_groups == 0 || p.n == 0) return;
  TORCH_INTERNAL_ASSERT(p.n % 2 == 0, "launch_grouped_column_sum: n must be even");
  const dim3 block(kSumColumnPairs, kSumRowSlices);
  const dim3 grid(static_cast<unsigned>((p.n + 2 * kSumColumnPairs - 1) / (2 * kSumColumnPairs)),
                  static_cast<unsigned>(std::min(p.num_groups, kMaxGridY)));
  dispatch_type(p.type, [&](auto tag) {
    using T = decltype(tag);
    grouped_column_sum_kernel<T><<<grid, block, 0, stream>>>(p);
  });
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
