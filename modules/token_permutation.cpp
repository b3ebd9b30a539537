#include "torchmoe/modules/token_permutation.h"

#include "torchmoe/autograd/token_permutation_function.h"

namespace torchmoe::functional {
namespace {

std::optional<torch::Tensor> optional(const torch::Tensor& t) {
  return t.defined() ? std::optional(t) : std::nullopt;
}

}  // namespace

PermutedTokens permute_tokens(const torch::Tensor& tokens, const torch::Tensor& indices,
                              int64_t num_experts, const torch::Tensor& probs) {
  return autograd::permute_tokens(tokens, indices, num_experts, optional(probs));
}

torch::Tensor unpermute_tokens(const torch::Tensor& permuted, const PermutedTokens& routed,
                               const torch::Tensor& probs) {
  return autograd::unpermute_tokens(permuted, routed, optional(probs));
}

torch::Tensor unpermute_tokens(const torch::Tensor& permuted, const torch::Tensor& row_map,
                               const torch::Tensor& probs) {
  return autograd::unpermute_tokens(permuted, row_map, optional(probs));
}

}  // namespace torchmoe::functional
