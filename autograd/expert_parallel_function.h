#pragma once
// Autograd for expert parallelism: AllToAllFunction exchanges rows between the ranks of a c10d
// process group with variable splits; its backward sends the gradients back the reverse way (the
// same exchange with send and receive splits swapped). all_to_all_rows() applies it. The split-size
// exchange and the all-reduces carry counts, which have no gradient: callers use
// ops::exchange_split_sizes and distributed/collectives.h directly.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <vector>

#include "torchmoe/distributed/process_group.h"
#include "torchmoe/ops/expert_parallel.h"
#include "torchmoe/ops/types.h"

namespace torchmoe::autograd {

class AllToAllFunction : public torch::autograd::Function<AllToAllFunction> {
 public:
  // rows [N, ...] (N = Σ send_splits) -> [Σ recv_splits, ...], as distributed::all_to_all_rows.
  // Gradient: grad [Σ recv_splits, ...] exchanged with recv_splits as the send splits.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            const std::vector<int64_t>& send_splits,
                            const std::vector<int64_t>& recv_splits,
                            const ProcessGroupOptions& group);
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs);
};

// Differentiable in rows. Every rank of the group must call it (and, in backward, reach its
// gradient) in the same order as the others: the collectives pair up by order.
at::Tensor all_to_all_rows(const at::Tensor& rows, c10::IntArrayRef send_splits,
                           c10::IntArrayRef recv_splits, const ProcessGroupOptions& group);

// The routing that groups the rows an all-to-all delivered by local expert (see
// ops::received_routing_map; top-k 1, one slot per received row), without a host sync: row_map,
// sorted_slots, row_tokens (the same as sorted_slots), the rows per local expert, and `probs` [N],
// the rows' probabilities as delivered, in grouped order (differentiable). `tokens` stays
// undefined: GroupedMLP::forward_combined runs the received rows through the map and writes its
// output rows back in received order, so that (on the sm90 kernel in 16 bits) no grouped output
// is written and then ungrouped.
PermutedTokens route_received(const at::Tensor& probs, c10::IntArrayRef recv_per_expert,
                              int64_t num_local_experts);

// Capacity mode: tokens [T, H] -> [E·capacity, H], expert e's rows at [e·capacity, (e+1)·capacity),
// zero rows (probability 0) where an expert has fewer; slots beyond capacity are dropped (see
// ops::make_capacity_map). No host sync. Differentiable in tokens and probs ([T, k]); unpermute
// the experts' output with unpermute_tokens(y, returned) (padding rows are ignored).
PermutedTokens permute_to_capacity(const at::Tensor& tokens, const at::Tensor& indices,
                                   const at::Tensor& probs, int64_t num_experts, int64_t capacity);

}  // namespace torchmoe::autograd
