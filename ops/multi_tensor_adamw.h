#pragma once
// Multi-tensor AdamW and global gradient norm: the ops behind torchmoe::optim::FusedAdamW.
// CPU: per-tensor ATen ops in torch::optim::AdamW's order (any floating dtype; the reference).
// CUDA: kernels/multi_tensor_adamw.cu, fp32 state, a few launches for all tensors, no host sync.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace torchmoe::ops {

// One step's hyperparameters, shared by the tensors of one call.
struct AdamWHyperparameters {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;  // the step this update makes (1 for the first): bias corrections 1 − β^step
};

// The FP8 (e4m3) copies of a weight that its step writes with delayed scaling, from the new fp32
// values, as ops::quantize_weights would make them from those values with `scale`
// (kernels/multi_tensor_adamw.h has the layouts): the weight is `experts` matrices [rows, cols]
// (its last two dimensions; experts = its first with three dimensions, else 1), rows and cols
// multiples of 16. The step overwrites rowwise, columnwise and scale_inv, and maxes each expert's
// new max |p| (NaN ignored) into amax.
struct AdamWFp8Copy {
  at::Tensor rowwise;     // [experts·rows, cols] float8_e4m3fn
  at::Tensor columnwise;  // [experts·rows·cols] float8_e4m3fn: expert g's transpose at g·rows·cols
  at::Tensor scale;       // [experts] float32: what the cast multiplies by
  at::Tensor scale_inv;  // [experts] float32: gets 1 / scale
  at::Tensor amax;       // [experts] float32
};

// Parallel lists, one entry per parameter. params, exp_avgs and exp_avg_sqs are updated in place;
// models[i], when defined, receives params[i] rounded to its dtype (the 16-bit compute copy of an
// fp32 master weight); fp8_copies is empty or has an entry per parameter: an entry with any of
// its tensors defined must have all of them and is written as AdamWFp8Copy says (params[i]
// float32); an all-undefined entry means no copy. On CUDA every tensor is contiguous,
// params/grads/state are float32, models float32/float16/bfloat16.
struct AdamWTensors {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, models;
  std::vector<AdamWFp8Copy> fp8_copies;
};

// A tensor of entry i that the CUDA kernel cannot read with an FP8 copy (it reads 16-byte vectors
// of the float32 arrays and of the columnwise copy, 4-byte words of the rowwise copy and 4
// elements of the model at a time): its name, the boundary it must start on and its address; no
// name when entry i has none or no copy (check_adamw_step refuses the step otherwise).
struct Fp8CopyMisalignment {
  const char* name = nullptr;
  size_t bytes = 0;
  const void* address = nullptr;
};
Fp8CopyMisalignment fp8_copy_misalignment(const AdamWTensors& tensors, size_t i);

// One AdamW step (decoupled weight decay) on every tensor. grad_scale: undefined, or a 0-d float32
// tensor on the tensors' device that every gradient is multiplied by as it is read (the clip
// coefficient from grad_norm).
void adamw_step(const AdamWTensors& tensors, const AdamWHyperparameters& hyper,
                const at::Tensor& grad_scale);

// adamw_step is these two: its checks, and the step on tensors that passed them. A caller whose
// step is several of them checks them all before it runs the first (FusedAdamW::step).
void check_adamw_step(const AdamWTensors& tensors, const AdamWHyperparameters& hyper,
                      const at::Tensor& grad_scale);
void run_adamw_step(const AdamWTensors& tensors, const AdamWHyperparameters& hyper,
                    const at::Tensor& grad_scale);

struct GradNorm {
  at::Tensor norm;         // 0-d float32: the L2 norm of all gradients together
  at::Tensor coefficient;  // 0-d float32: min(1, max_norm / (norm + 1e-6)), NaN if that is NaN
};

// The global L2 norm of `grads` (all on one device) and the clip coefficient for max_norm, as
// torch::nn::utils::clip_grad_norm_ computes them, without modifying the gradients and without a
// host sync. CUDA: fp32 sums per 16K-element chunk, added in a fixed order (deterministic).
GradNorm grad_norm(at::TensorList grads, double max_norm);

}  // namespace torchmoe::ops
