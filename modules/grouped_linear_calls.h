#pragma once
// What the modules built on GroupedLinear (GroupedMLP, and through it MoELayer) reach inside it:
// its GEMM shape for planning, and its call with what those modules fuse into it (a gathered
// input, a scattered output, an input activation, the FP8 gradient links). Internal, not
// installed: these name autograd and ops types, which no installed header does.

#include <torch/types.h>

#include <memory>
#include <optional>

#include "torchmoe/autograd/grouped_linear_function.h"
#include "torchmoe/modules/grouped_linear.h"
#include "torchmoe/ops/glu.h"
#include "torchmoe/ops/grouped_gemm.h"

namespace torchmoe::detail {

// A GroupedLinear's state shared with its calls' autograd configs.
struct GroupedLinearState {
  // delay_wgrad_compute: the weight-gradient GEMMs that backward queued for backward_dw().
  std::shared_ptr<autograd::WgradQueue> wgrad_queue = std::make_shared<autograd::WgradQueue>();
  // The FP8 weights of the last is_first_microbatch=true call, for the calls with false, and the
  // copies an optimizer writes.
  std::shared_ptr<autograd::Fp8WeightCache> fp8_weight_cache =
      std::make_shared<autograd::Fp8WeightCache>();
  // Its calls' autograd edges to the weights and biases, kept across calls.
  autograd::GroupedLinearEdges edges;
  // Whether the layer has offered its FP8 weights to the optimizers, or found it cannot
  // (fp8_weights_from_optimizer).
  bool fp8_weights_offered = false;
};

struct GroupedLinearCalls {
  // The layer's GEMM shape for planning: sizes, groups and the alignment of its own tensors.
  static ops::GemmShape gemm_shape(const GroupedLinearImpl& layer);
  // The body of every forward: `input` [rows, width] with width = in_features, or 2·in_features
  // with an `activation` (then input is its pre-activation and `scales` its per-row scales: the
  // layer saves those and recomputes the activation in backward), or read through `gather`'s row
  // map (then input has any row count; the plan's rows are the map's). FP8 GroupedMLP links its
  // two layers' backward (autograd::Fp8GradLink): fc1 takes its output gradient from
  // `grad_output_link`, fc2 gives its input gradient to `grad_input_link` (and in an FP8 MoE
  // layer takes its own output gradient from the unpermute through `grad_output_link`). With
  // `scatter` the output rows are summed per token inside the GEMM (MoE's unpermute in fc2).
  static torch::Tensor run(GroupedLinearImpl& layer, const torch::Tensor& input,
                           const ops::GemmPlan& plan, std::optional<bool> is_first_microbatch,
                           const torch::Tensor& scales = {},
                           const ops::GluOptions* activation = nullptr,
                           const autograd::RowGather* gather = nullptr,
                           std::shared_ptr<autograd::Fp8GradLink> grad_output_link = nullptr,
                           std::shared_ptr<autograd::Fp8GradLink> grad_input_link = nullptr,
                           const autograd::OutputScatter* scatter = nullptr);
  // The FP8 part of a call's config: the layer's state (checked against fp8::current()'s recipe)
  // and weight cache, and whether the optimizer's copies stand in for the weights.
  static autograd::Fp8Config fp8_config(const GroupedLinearImpl& layer,
                                        const ops::Fp8GemmOptions& planned,
                                        std::optional<bool> is_first_microbatch);
};

}  // namespace torchmoe::detail
