#pragma once
// What FP8 asks of the ops: how each tensor of a grouped linear layer is quantized, and how each
// of its three products accumulates. fp8::gemm_options makes these from a recipe, once per layer
// call; ops::plan_grouped_gemms keeps them in the plan, and chooses each product's backend from
// them, so that no op reads a recipe.

#include "torchmoe/kernels/types.h"

namespace torchmoe::ops {

using kernels::Fp8Format;
using kernels::QuantizeScaling;

// One tensor's split-quantize (ops/quantize.h).
struct SplitQuantizeOptions {
  Fp8Format format = Fp8Format::kE4M3;
  QuantizeScaling scaling = QuantizeScaling::kCurrent;
  bool rowwise = true;     // the [M, K] copy (fprop's operand)
  bool columnwise = true;  // the per-split transposed copies (dgrad's and wgrad's operands)
  // kCurrent and the block scalings: scales rounded down to powers of two, and the amax floor
  // (TE's force_pow_2_scales and amax_epsilon).
  bool power_of_2_scales = false;
  double amax_epsilon = 0.0;
};

// An FP8 layer call: its three tensors' quantize options (both copies asked for; a call drops the
// one its GEMMs do not read) and, per product, split accumulation (each 128-deep block of the
// reduction added to fp32 accumulators; off, the tensor cores accumulate the whole reduction:
// cuBLASLt's fast accumulation). Block-scaled products always split.
struct Fp8GemmOptions {
  SplitQuantizeOptions input;
  SplitQuantizeOptions weight;
  SplitQuantizeOptions grad_output;
  bool fprop_split_accumulator = false;
  bool dgrad_split_accumulator = true;
  bool wgrad_split_accumulator = true;
};

}  // namespace torchmoe::ops
