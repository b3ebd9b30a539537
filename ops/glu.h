#pragma once
// Gated activations of MoE expert MLPs: SwiGLU and ClampedSwiGLU (GPT-OSS), each optionally scaled
// per row (ScaledSwiGLU: the routing probability), forward and backward with the scale gradient.
// Semantics follow TransformerEngine's ops/basic/swiglu.py; the math and the GLU-interleaved layout
// are described in kernels/glu.h. The nonlinearity is applied to the FIRST half (TE's
// convention; torch::nn::GLU gates with the second half instead).

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "torchmoe/kernels/glu.h"
#include "torchmoe/ops/types.h"

namespace torchmoe::ops {

struct GluOptions {
  GluActivation activation = GluActivation::kSwiGLU;
  double limit = 7.0;      // ClampedSwiGLU: a is clamped above, b to [-limit, limit]
  double alpha = 1.702;    // ClampedSwiGLU: act(a) = a·σ(alpha·a)
  double offset = 1.0;     // ClampedSwiGLU: gate(b) = clamp(b) + offset
  int64_t interleave = 0;  // GLU interleave block G (a multiple of 32 dividing H), 0 for halves
};

// input [..., 2H] contiguous; scales: undefined (unscaled) or input.shape[:-1], float32 or the
// input's dtype on CUDA. Returns y [..., H] in the input's dtype.
at::Tensor glu_forward(const at::Tensor& input, const at::Tensor& scales,
                       const GluOptions& options);

// `options` for a gated activation of width H (the input's last dimension is 2H): the interleave a
// multiple of 32 dividing H, and ClampedSwiGLU's limit finite and positive, its alpha and offset
// finite. `op` names the caller in errors. glu_forward and glu_backward check them too; a module
// checks them when it is built, before any GEMM of a layer that feeds the activation runs.
void check_glu_options(const char* op, const GluOptions& options, int64_t hidden);

struct GluGrads {
  at::Tensor grad_input;   // [..., 2H], in the input's (possibly interleaved) layout
  at::Tensor grad_scales;  // input.shape[:-1] in the scales' dtype; undefined unless requested
};

// Recomputes the activation from `input` (nothing from forward is kept besides it).
GluGrads glu_backward(const at::Tensor& grad_output, const at::Tensor& input,
                      const at::Tensor& scales, const GluOptions& options, bool grad_scales);

namespace detail {

// glu_forward's checks of `input` and `scales`, then the kernel parameters that read them (no
// output or gradient set): split-quantize's GLU source (ops/quantize.h). `scales` must be
// contiguous; the parameters hold the tensors' pointers.
kernels::GluParams glu_kernel_params(const at::Tensor& input, const at::Tensor& scales,
                                     const GluOptions& options);

}  // namespace detail

}  // namespace torchmoe::ops
