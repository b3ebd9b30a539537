// The delayed-scaling update (split_quantize.h, launch_update_delayed_scaling): each split's amax
// history rolled by one step and its next scale, TE's amax_and_scale_update
// (recipe/delayed_scaling.cu). Its own launch, after the steps' split-quantize calls have written
// their amaxes; kept apart from split_quantize.cu because it shares nothing with the cast but the
// amax → scale rule's spirit and the block reduction.

#include <cfloat>
#include <cstdint>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/kernels/split_quantize_layout.cuh"
#include "torchmoe/kernels/split_quantize_math.cuh"

namespace torchmoe::kernels {
namespace split_quantize {
namespace {

// One block per split, of split-quantize's block size (block_max reduces over its kWarps).
__global__ void __launch_bounds__(kThreads)
    update_delayed_scaling_kernel(const DelayedScalingUpdateParams p) {
  __shared__ float scratch[kWarps];
  const int g = blockIdx.x;
  const int64_t groups = p.num_groups, length = p.history_length;
  float* history = p.amax_history + g;
  const float newest = p.amax[g];  // read before row 0 is rewritten (it may alias it)
  float amax = 0.0f;
  // Row i takes row i + 1 (the last row takes the newest amax) and row 0 is cleared. Chunks of
  // kThreads rows: every read of a chunk precedes its writes, and row i + 1 of the last thread
  // is only written in the next chunk, after its read.
  for (int64_t offset = 0; offset < length; offset += kThreads) {
    const int64_t i = offset + threadIdx.x;
    float a = 0.0f;
    if (i < length) {
      a = i + 1 < length ? history[(i + 1) * groups] : newest;
      amax = fmaxf(amax, a);
    }
    __syncthreads();
    if (i < length) history[i * groups] = i > 0 ? a : 0.0f;
  }
  amax = block_max(amax, scratch);
  if (p.algo == AmaxComputeAlgo::kMostRecent) amax = newest;
  if (threadIdx.x == 0) {
    float scale = p.scale[g];
    if (isfinite(amax) && amax > 0.0f) scale = __fdiv_rn(p.scaled_max, amax);
    if (isinf(scale)) scale = FLT_MAX;
    p.scale[g] = scale;
    p.scale_inv[g] = __frcp_rn(scale);
  }
}

}  // namespace
}  // namespace split_quantize

void launch_update_delayed_scaling(const DelayedScalingUpdateParams& p, cudaStream_t stream) {
  if (p.num_groups == 0) return;
  TORCH_INTERNAL_ASSERT(p.history_length >= 1,
                        "launch_update_delayed_scaling: the history needs a row");
  constexpr int kThreads = split_quantize::kThreads;
  split_quantize::update_delayed_scaling_kernel<<<p.num_groups, kThreads, 0, stream>>>(p);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace torchmoe::kernels
