#pragma once
// What MoELayer reaches inside a GroupedMLP, and the body of its forwards: the two layers planned
// together and run with what the MLP fuses between them. Internal, not installed: these name
// autograd and ops types, which no installed header does.

#include <torch/types.h>

#include <memory>
#include <optional>
#include <vector>

#include "torchmoe/autograd/grouped_linear_function.h"
#include "torchmoe/modules/grouped_mlp.h"
#include "torchmoe/ops/grouped_gemm.h"

namespace torchmoe::detail {

struct GroupedMLPCalls {
  // GroupedMLPImpl::forward_routed whose FP8 fc2 takes its output gradient from
  // `output_grad_link` (autograd::Fp8GradLink) when its output goes straight into the unpermute
  // that produces that gradient: MoELayer's FP8 path.
  static torch::Tensor forward_routed(GroupedMLPImpl& mlp, const torch::Tensor& tokens,
                                      const PermutedTokens& routed,
                                      std::optional<bool> is_first_microbatch,
                                      std::shared_ptr<autograd::Fp8GradLink> output_grad_link);
  // The plans of fc1 and fc2 together over x's rows (or gather_rows' when defined): their backends,
  // and split sizes that cross between host and device at most once.
  static std::vector<ops::GemmPlan> plan(const GroupedMLPImpl& mlp, const torch::Tensor& x,
                                         const SplitSizes& m_splits, const at::Tensor& gather_rows);
  // What both routed forwards start from, once `routed` is checked to route the T rows of x: the
  // token row of each GEMM row and the two layers' plans over those rows.
  struct RoutedPlans {
    torch::Tensor source_rows;
    std::vector<ops::GemmPlan> plans;
  };
  static RoutedPlans plan_routed(const GroupedMLPImpl& mlp, const torch::Tensor& x,
                                 const PermutedTokens& routed);
  // fc1 -> activation -> fc2 on fc1's input (read through `gather` when given), planned as `plans`;
  // output_grad_link: fc2's (FP8, without bias); scatter: fc2's output rows summed per token.
  static torch::Tensor run_layers(GroupedMLPImpl& mlp, const torch::Tensor& input,
                                  const autograd::RowGather* gather,
                                  const std::vector<ops::GemmPlan>& plans,
                                  const torch::Tensor& probs,
                                  std::optional<bool> is_first_microbatch,
                                  std::shared_ptr<autograd::Fp8GradLink> output_grad_link = nullptr,
                                  const autograd::OutputScatter* scatter = nullptr);
};

}  // namespace torchmoe::detail
