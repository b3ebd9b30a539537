#pragma once
// Token permutation for MoE layers, as differentiable functions: permute_tokens groups the rows of
// a top-k routing by expert (the input layout GroupedLinear/GroupedMLP expect) and
// unpermute_tokens sums each token's expert outputs back into token order.
//
// Example:
// ```
// auto routed = torchmoe::functional::permute_tokens(x, indices, /*num_experts=*/8, probs);
// torch::Tensor y = experts(routed.tokens, routed.m_splits, routed.probs);
// torch::Tensor out = torchmoe::functional::unpermute_tokens(y, routed);  // [T, H]
// ```

#include <torch/types.h>

#include <cstdint>

#include "torchmoe/ops/types.h"

namespace torchmoe::functional {

/// tokens [T, H]; indices [T, k] (int64 or int32) in [0, num_experts), or -1 for a slot dropped by
/// capacity; probs: undefined or [T, k], returned per permuted row. Rows are grouped by expert and
/// kept in token order within an expert. Gradients flow to tokens and probs. On CUDA the routing
/// map is built on the device (CUB radix sort); the host split sizes cost one device-to-host copy.
PermutedTokens permute_tokens(const torch::Tensor& tokens, const torch::Tensor& indices,
                              int64_t num_experts, const torch::Tensor& probs = {});

/// permuted [N, H] -> [T, H] through the map permute_tokens returned: out[t] = Σ_j probs[t, j] ·
/// permuted[routed.row_map[t, j]] (weights 1 when probs is undefined; dropped slots contribute
/// nothing), accumulated in fp32. permuted has routed.tokens' rows. No check of the map and no
/// host sync. Gradients flow to permuted and probs.
torch::Tensor unpermute_tokens(const torch::Tensor& permuted, const PermutedTokens& routed,
                               const torch::Tensor& probs = {});

/// The same through a row_map [T, k] (int64) the caller built. Its contract: each entry is -1 (a
/// dropped slot) or a row of permuted in [0, N), and no row is named twice; rows no entry names
/// (padding, e.g. capacity buffers) are ignored and get a zero gradient. The map is checked against
/// it first (on CUDA, one device-to-host copy).
torch::Tensor unpermute_tokens(const torch::Tensor& permuted, const torch::Tensor& row_map,
                               const torch::Tensor& probs = {});

}  // namespace torchmoe::functional
