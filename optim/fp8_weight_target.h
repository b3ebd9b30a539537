#pragma once
// What a layer hands an optimizer so that every step writes the layer's FP8 weights
// (FusedAdamW::set_fp8_weights, GroupedLinearImpl::fp8_weight_target): the optimizer knows no
// module, only these tensors and two calls. Installed.

#include <torch/types.h>

#include <functional>
#include <vector>

namespace torchmoe::optim {

/// The delayed-scaling FP8 copies of a layer's G weights that a step writes, e4m3, with the
/// scales of the layer's FP8 state.
struct Fp8WeightCopies {
  torch::Tensor rowwise;  ///< [G·out, in] float8_e4m3fn: the copy fprop reads
  torch::Tensor
      columnwise;       ///< [G·out·in] float8_e4m3fn: each weight's [in, out] transpose (dgrad)
  torch::Tensor scale;  ///< [G] float32: the scales the step casts with
  torch::Tensor scale_inv;  ///< [G] float32: written, 1 / scale
  torch::Tensor amax;       ///< [G] float32: the amax-history row the step's amaxes are maxed into
};

/// A layer's side of FP8 weights written by the optimizer.
struct Fp8WeightTarget {
  /// Identifies the layer: an optimizer takes one target per layer.
  const void* layer = nullptr;
  /// The layer's weight parameters in order (G [out, in] tensors, or one [G, out, in]): the
  /// masters given with the target hold these, in this order.
  std::vector<torch::Tensor> weights;
  /// The copies to write now (the layer allocates them on the first call, and again after it
  /// moved to another device or dtype).
  std::function<Fp8WeightCopies()> copies;
  /// Called after a step that wrote every weight: the layer's forwards read the copies from then
  /// on, until a weight changes otherwise.
  std::function<void()> written;
};

}  // namespace torchmoe::optim
