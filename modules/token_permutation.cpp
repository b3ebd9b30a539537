#include "torchmoe/modules/token_permutation.h"

namespace torchmoe::functional {

PermutedTokens permute_tokens(const torch::Tensor& tokens, const torch::Tensor& indices,
                              int64_t num_experts, const torch::Tensor& probs) {
  return autograd::permute_tokens(tokens, indices, num_experts,
                                  probs.defined() ? std::optional(probs) : std::nullopt);
}

torch::Tensor unpermute_tokens(const torch::Tensor& permuted, const torch::Tensor& row_map,
                               const torch::Tensor& probs) {
  return autograd::UnpermuteFunction::apply(permuted, row_map,
                                            probs.defined() ? std::optional(probs) : std::nullopt);
}

}  // namespace torchmoe::functional
