#pragma once
// Multi-tensor AdamW and gradient norm: a few launches for all of a model's parameters instead of
// several per parameter.
//
// Kernel layer: raw pointers, sizes and a stream. Validation, grouping and dispatch:
// ops/multi_tensor_adamw.cpp.
//
// Work is cut into chunks of kAdamWChunk elements; a launch takes up to kAdamWTensorsPerLaunch
// tensors by value (no table to upload, so a launch can be captured in a CUDA graph) and one block
// per chunk, which finds its tensor in the launch's chunk prefix.
//
//   AdamW, per element (fp32 math; g = grad · grad_scale when grad_scale is given):
//     p   = p · (1 − lr · weight_decay)
//     m   = β1 · m + (1 − β1) · g
//     v   = β2 · v + (1 − β2) · g²
//     p   = p − (lr / bias_correction1) · m / (√v / √bias_correction2 + eps)
//     model = round(p)                       (when a 16-bit model copy is given)
//   which is torch::optim::AdamW's update (decoupled weight decay, then the Adam step).
//
//   Norm: partials[chunk] = Σ g² over each chunk (fp32); finish_norm sums the partials in a fixed
//   order (deterministic), writes ‖g‖ and the clip coefficient min(1, max_norm / (‖g‖ + 1e-6)).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

inline constexpr int kAdamWTensorsPerLaunch = 48;
inline constexpr int64_t kAdamWChunk = 16384;  // elements per block

// One parameter. fp32 throughout except the optional model copy.
struct AdamWTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  void* model = nullptr;  // bf16/fp16 copy written after the update, or null
  int64_t numel = 0;
};

struct AdamWBatch {
  AdamWTensor tensors[kAdamWTensorsPerLaunch];
  int num_tensors = 0;
  // chunk_prefix[i]: the launch's first chunk of tensor i; [num_tensors] = the launch's chunks.
  int chunk_prefix[kAdamWTensorsPerLaunch + 1] = {};
};

struct AdamWHyper {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 − β^step
  const float* grad_scale = nullptr;  // device scalar multiplying every gradient, or null
  ScalarType model_type = ScalarType::kBFloat16;
};

// Every tensor of `batch` (numel > 0) takes one step.
void launch_adamw(const AdamWBatch& batch, const AdamWHyper& hyper, cudaStream_t stream);

// A weight whose step also writes its FP8 (e4m3) copies, with delayed scaling: `t` holds
// `experts` matrices [rows, cols] one after another (a GroupedLinear's [G, out, in] weight, or
// one expert's [out, in] with experts = 1), and its copies are laid out as quantize_weights lays
// them out (split_quantize.h with G splits of `rows` rows):
//   rowwise     [experts·rows, cols]  q = satfinite_rn(p · scale[g]), the input's layout
//   columnwise  expert g's transpose [cols, rows] at element g·rows·cols
// amax[g] is maxed with max |p| of expert g's new values (NaN ignored) and scale_inv[g] gets
// 1 / scale[g], both as split-quantize's kDelayed. rows and cols are multiples of 16.
struct AdamWFp8Weight {
  AdamWTensor t;  // t.numel = experts · rows · cols
  uint8_t* rowwise = nullptr;
  uint8_t* columnwise = nullptr;
  const float* scale = nullptr;
  float* scale_inv = nullptr;
  float* amax = nullptr;
  int64_t experts = 0, rows = 0, cols = 0;
};

inline constexpr int kAdamWFp8WeightsPerLaunch = 16;
inline constexpr int kAdamWFp8Tile = 64;  // a block's tile: 64 rows × 64 columns of one expert

struct AdamWFp8Batch {
  AdamWFp8Weight weights[kAdamWFp8WeightsPerLaunch];
  int num_weights = 0;
  // tile_prefix[i]: the launch's first tile of weight i; [num_weights] = the launch's tiles.
  int tile_prefix[kAdamWFp8WeightsPerLaunch + 1] = {};
};

// Every weight of `batch` takes one step (AdamW as above) and writes its FP8 copies.
void launch_adamw_fp8(const AdamWFp8Batch& batch, const AdamWHyper& hyper, cudaStream_t stream);

// partials[first_chunk + c] = Σ grad² over chunk c of the batch (its `grad` pointers are read).
void launch_sum_of_squares(const AdamWBatch& batch, float* partials, int64_t first_chunk,
                           cudaStream_t stream);

// norm[0] = √Σ partials (summed in a fixed order), coefficient[0] = min(1, max_norm / (norm +
// 1e-6)) (coefficient may be null).
void launch_finish_norm(const float* partials, int64_t count, double max_norm, float* norm,
                        float* coefficient, cudaStream_t stream);

}  // namespace torchmoe::kernels
