#pragma once
// MoELayer: a dropless (or capacity-limited) Mixture-of-Experts FFN.
//
//   x [.., hidden] -> TopKRouter -> permute_tokens (rows grouped by expert)
//     -> GroupedMLP (fc1 -> ScaledSwiGLU with each row's routing probability -> fc2)
//     -> unpermute_tokens (a plain sum over each token's k expert outputs) -> [.., hidden]
//
// By default in 16 bits (GroupedMLP::forward_combined), with top-1 or top-2 routing on the sm90
// backend, the unpermute is done inside fc2's GEMM (each row added into its token's output row in
// L2) and the permutation's backward inside fc1's dgrad, bit for bit the separate steps. With
// options fuse_permutation (by default in FP8), the permutation is fused into fc1, which reads the
// tokens through the routing map (GroupedMLP::forward_routed): its GEMMs on the sm90 backend, in
// FP8 the quantize of its input.
//
// The probabilities are applied inside the scaled activation (Megatron's memory-efficient
// permutation), so unpermute needs no weights and no copy of the expert outputs is kept for the
// probabilities' gradient.
//
// With expert_parallel set (EP over a c10d process group of ep ranks), each rank holds E/ep
// experts (rank r: global experts [r·E/ep, (r+1)·E/ep)) and the permuted rows travel to them and
// back between permute and unpermute:
//
//   permute (rows by global expert = by destination rank) -> exchange the split sizes (all-to-all,
//   the one host sync) -> all-to-all of the rows and of their probabilities -> GroupedMLP over
//   the received rows grouped by local expert, its output rows back in received order -> all-to-all
//   back -> unpermute
//
// Backward runs the reverse exchanges. docs/moe.md, "Expert parallelism".

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include <optional>
#include <ostream>

#include "torchmoe/modules/grouped_mlp.h"
#include "torchmoe/modules/router.h"
#include "torchmoe/distributed/process_group.h"

namespace torchmoe {

/// A shared expert (DeepSeek-V3, Qwen2-MoE, Llama-4): a dense SwiGLU MLP hidden -> ffn_hidden ->
/// hidden that every token goes through, its output added to the routed experts'. It is built as
/// a GroupedMLP of one expert (module `shared_expert`) with the experts' linear() settings
/// (dtype, device, init_method, FP8, fused and delayed weight gradients), so it runs wherever they
/// run; with
/// expert parallelism it is replicated on every rank (its gradients summed by the trainer, as
/// the router's).
struct SharedExpertOptions {
  explicit SharedExpertOptions(int64_t ffn_hidden) : ffn_hidden_(ffn_hidden) {}
  TORCH_ARG(int64_t, ffn_hidden);
  /// Multiply the shared expert's output per token by sigmoid(x · gᵀ), g [1, hidden] the layer's
  /// parameter `shared_expert_gate` (Qwen2-MoE's shared_expert_gate).
  TORCH_ARG(bool, gate) = false;
};

/// Options for `MoELayer`: the router's and the experts' options, composed.
///
/// Example:
/// ```
/// torchmoe::MoELayerOptions options(/*hidden=*/1024, /*ffn_hidden=*/1024, /*num_experts=*/32,
///                                   /*topk=*/2);
/// options.router().aux_loss_coeff(1e-2);
/// options.params_dtype(torch::kBFloat16).device(torch::kCUDA);
/// torchmoe::MoELayer moe(options);
/// torchmoe::MoEOutput out = moe(x);  // x [B, S, 1024]
/// loss = task_loss(out.output) + out.aux_loss;
/// ```
struct MoELayerOptions {
  /// The router (hidden -> num_experts, top-k) and the experts (num_experts GroupedMLPs of
  /// hidden -> ffn_hidden -> hidden, without biases unless experts().linear().bias(true)).
  MoELayerOptions(int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t topk);

  /// Shorthands that set both the router's and the experts' dtype or device.
  MoELayerOptions& params_dtype(torch::Dtype dtype);
  MoELayerOptions& device(torch::Device device);

  int64_t hidden() const { return router_.hidden(); }
  int64_t num_experts() const { return router_.num_experts(); }

  TORCH_ARG(TopKRouterOptions, router);
  /// num_experts here is the global E; with expert_parallel the layer builds E/ep of them.
  TORCH_ARG(GroupedMLPOptions, experts);
  /// Expert parallelism over this group's ep ranks (E divisible by ep): this rank holds the global
  /// experts [rank·E/ep, (rank+1)·E/ep) as experts 0..E/ep-1, the router is replicated (the same
  /// weights on every rank: the trainer sums its gradients over the group, as for any dense
  /// parameter), and the router's losses are over the group's batch (router().process_group,
  /// when not set otherwise). Every rank of the group must call forward and backward together.
  TORCH_ARG(std::optional<ProcessGroupOptions>, expert_parallel) = std::nullopt;
  /// Capacity mode of expert parallelism (Megatron's pad-to-capacity): each rank sends every
  /// expert exactly expert_capacity(T, router()) rows, padded with zero rows, so the all-to-alls
  /// have fixed sizes, no split sizes are exchanged and the layer makes no host sync (CUDA-graph
  /// capturable). Needs expert_parallel and router().capacity_factor, and the same token count T
  /// on every rank: checked by one all-reduce and host sync the first time the layer sees a T
  /// (none in the steady state; a new T during a CUDA graph capture is refused).
  TORCH_ARG(bool, pad_to_capacity) = false;
  /// Without expert_parallel, on the sm90 grouped GEMM backend or in FP8: fc1 reads the tokens
  /// through the routing map instead of a permuted copy (GroupedMLP::forward_routed), which is
  /// neither written nor kept for backward: T·k·hidden elements less activation memory per layer.
  /// In FP8 the quantize of fc1's input gathers the rows (one launch for both), and the
  /// unpermute's backward quantizes fc2's output gradient likewise. Unset: on in FP8
  /// (fp8::Autocast), where it saves time on the H100 except on host-bound layers, and off in
  /// bf16, where the layer's fwd+bwd measured 1.1-1.5x the copying path's (docs/experiments.md).
  /// Other backends in bf16 and expert parallelism always make the copy.
  TORCH_ARG(std::optional<bool>, fuse_permutation) = std::nullopt;
  /// A shared expert beside the routed ones (SharedExpertOptions). nullopt: none.
  TORCH_ARG(std::optional<SharedExpertOptions>, shared_expert) = std::nullopt;
  /// Multiply each routed row by its probability before fc1 instead of after the activation
  /// (Llama-4): expert e computes f_e(p · x), not p · f_e(x). At top-1 each token is scaled by its
  /// one probability before the permutation, and the experts run on their usual paths; with more
  /// choices the permuted rows are copied and scaled. The probabilities' gradient comes through
  /// that product. Not with pad_to_capacity.
  TORCH_ARG(bool, scale_expert_input) = false;
};

struct MoEOutput {
  torch::Tensor output;  // x's shape and dtype
  // Router load-balancing loss + z-loss, scalar float32. With expert parallelism, this rank's
  // share: the ranks' aux losses sum to the loss of the group's whole batch.
  torch::Tensor aux_loss;
  // [E] int64 over all E experts, before capacity dropping (with expert parallelism, the group's)
  torch::Tensor tokens_per_expert;
};

class MoELayerImpl : public torch::nn::Cloneable<MoELayerImpl> {
 public:
  MoELayerImpl(int64_t hidden, int64_t ffn_hidden, int64_t num_experts, int64_t topk)
      : MoELayerImpl(MoELayerOptions(hidden, ffn_hidden, num_experts, topk)) {}
  explicit MoELayerImpl(MoELayerOptions options);

  void reset() override;
  void pretty_print(std::ostream& stream) const override;

  /// x [..., hidden] in params_dtype. is_first_microbatch as in GroupedLinear (main-grad
  /// overwrite).
  MoEOutput forward(const torch::Tensor& x, std::optional<bool> is_first_microbatch = std::nullopt);

  /// Runs the oldest delayed weight-gradient computation of the experts (and the shared expert).
  void backward_dw();
  /// GroupedMLP::check_no_queued_wgrad of the experts and the shared expert.
  void check_no_queued_wgrad(const char* where) const;

  /// As torch::nn::Module's, refused before anything moves (the router included) while the
  /// experts have queued delayed weight-gradient work.
  using torch::nn::Module::to;
  void to(torch::Device device, torch::Dtype dtype, bool non_blocking = false) override;
  void to(torch::Device device, bool non_blocking = false) override;
  void to(torch::Dtype dtype, bool non_blocking = false) override;
  /// torch::load, all or nothing: the router's and the experts' entries are each checked before
  /// they are copied, and a refusal of the experts' restores what the router loaded.
  void load(torch::serialize::InputArchive& archive) override;

  MoELayerOptions options;
  TopKRouter router{nullptr};
  /// This rank's experts: all E, or with expert_parallel the E/ep of its shard.
  GroupedMLP experts{nullptr};
  /// With options.shared_expert: the shared expert (one group), and with its gate g [1, hidden].
  GroupedMLP shared_expert{nullptr};
  torch::Tensor shared_expert_gate;

 private:
  // routed rows (grouped by global expert) -> the experts' outputs in the same rows, through
  // the experts of all ranks.
  torch::Tensor run_experts_parallel(const PermutedTokens& routed,
                                     std::optional<bool> is_first_microbatch);
  // tokens [T, hidden] -> the shared expert's output [T, hidden], gated when asked.
  torch::Tensor run_shared_expert(const torch::Tensor& tokens,
                                  std::optional<bool> is_first_microbatch);
  // tokens [T, hidden] and their routing -> the layer's output [T, hidden], in capacity mode.
  torch::Tensor run_padded(const torch::Tensor& tokens, const RouterOutput& routing,
                           std::optional<bool> is_first_microbatch);
  // The last token count capacity mode found equal on every rank of this group (-1: none yet).
  int64_t capacity_tokens_checked_ = -1;
  const c10d::ProcessGroup* capacity_group_checked_ = nullptr;
};

TORCH_MODULE(MoELayer);

}  // namespace torchmoe
