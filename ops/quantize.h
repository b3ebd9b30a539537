#pragma once
// FP8 quantization ops: the split-quantize of a grouped layer's rows (one launch for all splits)
// and the delayed-scaling update. Validation, allocation and dispatch; the layouts, scalings and
// numerics are kernels/split_quantize.h's (docs/fp8.md). CUDA only: a CPU tensor is a
// NotImplementedError (the tests keep their own CPU reference).

#include <ATen/core/Tensor.h>

#include "torchmoe/ops/fp8_options.h"
#include "torchmoe/ops/glu.h"
#include "torchmoe/ops/grouped_gemm.h"
#include "torchmoe/ops/types.h"

namespace torchmoe::ops {

struct SplitQuantized {
  at::Tensor data;  // [M, K] float8 (e4m3fn or e5m2); undefined without rowwise
  // float8: split g's transpose [K, r16(m_g)] at element K·Σ_{h<g} r16(m_h), its columns past m_g
  // zero (r16: rounded up to a multiple of 16); K·Σ_g r16(m_g) elements with host sizes, the
  // bound K·(M + 15·G) with device sizes; undefined without columnwise
  at::Tensor columnwise_data;
  // float32. kCurrent, kDelayed: [G], shared by both copies. Block scalings: the rowwise copy's
  // block scales, flat (layout in kernels/split_quantize.h; padding entries 0); undefined without
  // rowwise.
  at::Tensor scale_inv;
  at::Tensor columnwise_scale_inv;      // block scalings: the columnwise copy's block scales, flat
  at::Tensor amax;                      // [G] float32: max |x| per split (NaN ignored)
  Fp8Format format = Fp8Format::kE4M3;  // of both copies
  QuantizeScaling scaling = QuantizeScaling::kCurrent;
};

// input: [M, K] contiguous CUDA float32/float16/bfloat16 with K a multiple of 16. m_splits: G
// sizes (1 <= G <= 4096) on the host (non-negative, summing to at most M) or on the input's device
// (clamped as in the grouped GEMM, read without a host sync). scale: kDelayed only, [G] float32
// on the input's device. amax: kDelayed only, optional [G] float32 on the input's device that
// this call's amax is maxed into (a history row across micro-batches) and that is returned as
// .amax; without it a new tensor is returned.
SplitQuantized split_quantize(const at::Tensor& input, const SplitSizes& m_splits,
                              const SplitQuantizeOptions& options, const at::Tensor& scale = {},
                              const at::Tensor& amax = {});

// split_quantize of input.index_select(0, rows) in one launch that never writes the gathered
// rows: row r is quantized from input row rows[r], so the result is bit for bit that of the two
// ops (fc1's FP8 input in an MoE layer with fuse_permutation: the tokens in expert order without
// the permuted copy). An index outside [0, T) is not an error here (checking would cost a host
// sync): its row reads as zeros. input: [T, K] as split_quantize's; rows: [M] int64, contiguous,
// on the input's device; m_splits (summing to at most M), options, scale, amax: as
// split_quantize's.
SplitQuantized gather_split_quantize(const at::Tensor& input, const at::Tensor& rows,
                                     const SplitSizes& m_splits,
                                     const SplitQuantizeOptions& options,
                                     const at::Tensor& scale = {}, const at::Tensor& amax = {});

// split_quantize of glu_forward(input, scales, glu) in one launch that never writes the 16-bit
// activation: each tile computes its part of the activation from `input` (rounded to the input's
// dtype as glu_forward rounds it) and casts it, so the result is bit for bit that of the two ops
// (fc2's FP8 input in GroupedMLP). input: [M, 2K] contiguous CUDA float32/float16/bfloat16 in
// glu_forward's layout (halves or GLU-interleaved), K a multiple of 16; scales: undefined or [M],
// float32 or the input's dtype; m_splits, options, scale, amax: as split_quantize's.
SplitQuantized glu_split_quantize(const at::Tensor& input, const at::Tensor& scales,
                                  const GluOptions& glu, const SplitSizes& m_splits,
                                  const SplitQuantizeOptions& options, const at::Tensor& scale = {},
                                  const at::Tensor& amax = {});

struct GluGradsQuantized {
  SplitQuantized grad_input;  // the gradient of the GLU input [M, 2K], quantized
  at::Tensor grad_scales;     // as glu_backward's; undefined unless asked for
};

// glu_backward(grad_output, input, scales, glu, grad_scales) followed by split_quantize of its
// grad_input, in one launch that never writes the 16-bit gradient (except under current scaling
// and for small gradients, below): each tile computes its part of the gradient (rounded to the
// input's dtype as glu_backward rounds it) and casts it, so the FP8 bytes, scales and amax are bit
// for bit those of the two ops (fc1's FP8 output gradient in GroupedMLP's backward). grad_scales is
// glu_backward's up to the order of its fp32 sum, and 0 for rows past the splits. input, scales: as
// glu_split_quantize's, with K a multiple of 8 (the quantized width 2K a multiple of 16);
// grad_output: [M, K] contiguous, of the input's dtype and device; m_splits, options, scale, amax:
// as split_quantize's. Under current scaling it is the two ops (glu_backward writes the 16-bit
// gradient, split_quantize casts it): the one launch has to compute and load each pair of tiles
// twice, for its split's amax and for its cast, and took 1.2-1.7x as long on the H100
// (docs/experiments.md). So it is for a gradient of fewer than 8 waves of 128x128 tiles, where
// the fused launch's heavier units left its last wave idle longer (ops/quantize.cpp).
GluGradsQuantized glu_backward_split_quantize(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& scales,
    const GluOptions& glu, bool grad_scales, const SplitSizes& m_splits,
    const SplitQuantizeOptions& options, const at::Tensor& scale = {}, const at::Tensor& amax = {});

namespace detail {

// glu_backward_split_quantize with the fused launch from `fused_min_waves` waves of tiles (0:
// wherever the kernel has a fused source), for tests of that launch at any size.
GluGradsQuantized glu_backward_split_quantize(const at::Tensor& grad_output,
                                              const at::Tensor& input, const at::Tensor& scales,
                                              const GluOptions& glu, bool grad_scales,
                                              const SplitSizes& m_splits,
                                              const SplitQuantizeOptions& options,
                                              const at::Tensor& scale, const at::Tensor& amax,
                                              double fused_min_waves);

}  // namespace detail

// A layer's G weights [n, k] (n a multiple of 16), quantized in one launch as the [G·n, k] tensor
// of G splits of n rows that stacking them would give, without stacking them: split g is read
// from weight g where it lies. The rowwise copy is fprop's operand, the columnwise one (W_gᵀ
// [k, n] at element k·n·g) dgrad's. scale, amax: as split_quantize's, one entry per weight.
SplitQuantized quantize_weights(const GroupedTensors& weights, const SplitQuantizeOptions& options,
                                const at::Tensor& scale = {}, const at::Tensor& amax = {});

struct DelayedScalingUpdateOptions {
  Fp8Format format = Fp8Format::kE4M3;  // sets fp8_max: 448 (e4m3) or 57344 (e5m2)
  double margin = 0.0;                  // scale = fp8_max · 2^-margin / amax
  AmaxComputeAlgo algo = AmaxComputeAlgo::kMax;
};

// In place, one launch, TE's update (kernels/split_quantize.h): amax [G] (this step's; may be row
// 0 of the history) enters amax_history [H, G], the history rolls, and scale and scale_inv [G]
// get the next step's values; a non-finite or zero amax keeps the old scale. All float32,
// contiguous, on one CUDA device.
void update_delayed_scaling(const at::Tensor& amax_history, const at::Tensor& amax,
                            const at::Tensor& scale, const at::Tensor& scale_inv,
                            const DelayedScalingUpdateOptions& options);

}  // namespace torchmoe::ops
