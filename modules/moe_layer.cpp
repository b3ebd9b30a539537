#include "torchmoe/modules/moe_layer.h"

#include <torch/nn/init.h>

#include <cmath>
#include <utility>

#include "torchmoe/autograd/expert_parallel_function.h"
#include "torchmoe/autograd/router_function.h"
#include "torchmoe/autograd/token_permutation_function.h"
#include "torchmoe/distributed/collectives.h"
#include "torchmoe/fp8/autocast.h"
#include "torchmoe/modules/grouped_mlp_calls.h"
#include "torchmoe/modules/module_load.h"
#include "torchmoe/modules/router_calls.h"
#include "torchmoe/modules/token_permutation.h"

namespace torchmoe {
namespace {

constexpr const char* kModule = "MoELayer";

// With expert parallelism the router's losses are over the group's batch unless the router has a
// group of its own.
TopKRouterOptions local_router_options(const MoELayerOptions& options) {
  TopKRouterOptions router = options.router();
  if (options.expert_parallel() && !router.process_group()) {
    router.process_group(*options.expert_parallel());
  }
  return router;
}

// The shared expert: one group of a SwiGLU MLP with the experts' linear settings.
GroupedMLPOptions shared_expert_options(const MoELayerOptions& options) {
  const GroupedMLPOptions& experts = options.experts();
  GroupedMLPOptions shared(1, experts.hidden(), options.shared_expert()->ffn_hidden());
  shared.linear(experts.linear());
  return shared;
}

// This rank's shard: E / ep experts with expert parallelism.
GroupedMLPOptions local_expert_options(const MoELayerOptions& options) {
  GroupedMLPOptions experts = options.experts();
  if (options.expert_parallel()) {
    experts.num_experts(experts.num_experts() / options.expert_parallel()->group()->getSize());
  }
  return experts;
}

// The expert-parallel and capacity options against the router's: reset() checks the layer's
// options.router(), forward the built router's options (public, like the layer's, so either may
// have changed since).
void check_parallel_options(const MoELayerOptions& options, const TopKRouterOptions& router) {
  if (options.expert_parallel()) {
    TORCH_CHECK(options.expert_parallel()->group(), kModule,
                ": expert_parallel must hold a process group, got a null one");
    const int64_t ep = options.expert_parallel()->group()->getSize();
    TORCH_CHECK(options.num_experts() % ep == 0, kModule,
                ": num_experts must be divisible by the expert-parallel size ", ep, ", got ",
                options.num_experts());
  }
  if (options.pad_to_capacity()) {
    TORCH_CHECK_NOT_IMPLEMENTED(options.expert_parallel(), kModule,
                                ": pad_to_capacity is implemented for expert_parallel only");
    TORCH_CHECK(router.capacity_factor(), kModule,
                ": pad_to_capacity needs router().capacity_factor, got none");
    TORCH_CHECK_NOT_IMPLEMENTED(!options.scale_expert_input(), kModule,
                                ": scale_expert_input is not implemented with pad_to_capacity");
  }
}

}  // namespace

MoELayerOptions::MoELayerOptions(int64_t hidden, int64_t ffn_hidden, int64_t num_experts,
                                 int64_t topk)
    : router_(hidden, num_experts, topk), experts_(num_experts, hidden, ffn_hidden) {
  // MoE experts carry no bias (Mixtral, DeepSeek-V3, Qwen3-MoE), unlike a GroupedLinear.
  experts_.linear().bias(false);
}

MoELayerOptions& MoELayerOptions::params_dtype(torch::Dtype dtype) {
  router_.params_dtype(dtype);
  experts_.params_dtype(dtype);
  return *this;
}

MoELayerOptions& MoELayerOptions::device(torch::Device device) {
  router_.device(device);
  experts_.device(device);
  return *this;
}

MoELayerImpl::MoELayerImpl(MoELayerOptions options_) : options(std::move(options_)) { reset(); }

void MoELayerImpl::reset() {
  const TopKRouterOptions& r = options.router();
  const GroupedMLPOptions& e = options.experts();
  TORCH_CHECK(r.hidden() == e.hidden() && r.num_experts() == e.num_experts(), kModule,
              ": the router and the experts must agree on hidden and num_experts, got router (",
              r.hidden(), ", ", r.num_experts(), ") and experts (", e.hidden(), ", ",
              e.num_experts(), ")");
  check_parallel_options(options, r);
  router = register_module("router", TopKRouter(local_router_options(options)));
  experts = register_module("experts", GroupedMLP(local_expert_options(options)));
  shared_expert = nullptr;
  shared_expert_gate = torch::Tensor();
  if (options.shared_expert()) {
    TORCH_CHECK(options.shared_expert()->ffn_hidden() > 0, kModule,
                ": shared_expert().ffn_hidden must be positive, got ",
                options.shared_expert()->ffn_hidden());
    shared_expert = register_module("shared_expert", GroupedMLP(shared_expert_options(options)));
    if (options.shared_expert()->gate()) {
      const GroupedLinearOptions& linear = options.experts().linear();
      shared_expert_gate = register_parameter(
          "shared_expert_gate",
          torch::empty({1, options.hidden()},
                       torch::TensorOptions(linear.params_dtype()).device(linear.device())));
      // As torch::nn::Linear(hidden, 1)'s weight.
      const torch::NoGradGuard no_grad;
      torch::nn::init::kaiming_uniform_(shared_expert_gate, std::sqrt(5.0));
    }
  }
}

// The submodules' options as built (options.router() and options.experts() are only what they
// were built from).
void MoELayerImpl::pretty_print(std::ostream& stream) const {
  stream << "torchmoe::MoELayer(hidden=" << options.hidden()
         << ", ffn_hidden=" << experts->options.ffn_hidden()
         << ", num_experts=" << options.num_experts() << ", topk=" << router->options.topk();
  if (options.expert_parallel()) {
    const auto& group = options.expert_parallel()->group();
    stream << ", expert_parallel=";
    if (group) {
      stream << group->getSize();
    } else {
      stream << "(no process group)";
    }
  }
  if (shared_expert) {
    stream << ", shared_expert=" << shared_expert->options.ffn_hidden();
    if (shared_expert_gate.defined()) stream << " (gated)";
  }
  if (options.scale_expert_input()) stream << ", scale_expert_input=true";
  stream << ")";
}

MoEOutput MoELayerImpl::forward(const torch::Tensor& x, std::optional<bool> is_first_microbatch) {
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == options.hidden(), kModule,
              ": x must be [..., hidden=", options.hidden(), "], got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  // The experts' dtype from their first weight parameter: expert_weights() would make a view per
  // expert and parameters() a vector of them (128 on qwen3), host time per call.
  const torch::ScalarType dtype = experts->fc1->weight_parameters().front().scalar_type();
  TORCH_CHECK(x.scalar_type() == dtype, kModule, ": x must have the experts' dtype ", dtype,
              ", got ", x.scalar_type());
  // Before the router runs: the experts' own refusal would name GroupedMLP.
  TORCH_CHECK_NOT_IMPLEMENTED(!fp8::enabled() || x.is_cuda(), kModule,
                              ": FP8 (fp8::Autocast) runs on CUDA tensors, got x on ", x.device());
  check_parallel_options(options, router->options);
  TORCH_CHECK(static_cast<bool>(shared_expert) == options.shared_expert().has_value() &&
                  shared_expert_gate.defined() ==
                      (options.shared_expert() && options.shared_expert()->gate()),
              kModule, ": shared_expert cannot change after construction: build a new layer");
  const int64_t ep =
      options.expert_parallel() ? options.expert_parallel()->group()->getSize() : int64_t{1};
  TORCH_CHECK(router->options.num_experts() == options.num_experts() &&
                  experts->options.num_experts() * ep == options.num_experts(),
              kModule, ": num_experts=", options.num_experts(), " over ", ep,
              " rank(s) does not match the router (", router->options.num_experts(),
              " experts) and the experts (", experts->options.num_experts(),
              " on this rank) the layer was built with; options.num_experts and expert_parallel ",
              "cannot change after construction: build a new layer");
  // A 2-D x is taken as it is (a reshape and the view back would add two backward nodes).
  const torch::Tensor flat = x.dim() == 2 ? x : x.reshape({-1, options.hidden()});
  MoEOutput out;
  RouterOutput routing;
  if (options.pad_to_capacity()) {
    routing = router(flat);
    out.output = run_padded(flat, routing, is_first_microbatch);
  } else {
    // The router's backward takes gradients from the functions around it through a link
    // (autograd::RouterGradLink). x forked between the router and the permutation: the router's
    // gradient of x is added to the permutation's by the router's own GEMM
    // (autograd::ForkFunction), not by autograd. No fork when x takes no gradient (its node would
    // be host time for nothing).
    std::shared_ptr<autograd::RouterGradLink> link;
    torch::Tensor tokens = flat;
    if (torch::GradMode::is_enabled()) link = std::make_shared<autograd::RouterGradLink>();
    if (link && flat.requires_grad()) {
      link->other_branch_exclusive = true;  // forked[1] goes to the permutation alone
      const torch::autograd::variable_list forked = autograd::ForkFunction::apply(flat, link);
      routing = detail::TopKRouterCalls::forward(*router, forked[0], link);
      tokens = forked[1];
    } else {
      routing = detail::TopKRouterCalls::forward(*router, flat, link);
    }
    // Without a capacity the router's top-k has no dropped slot, so the permuted row count is T·k
    // and the split sizes can stay on the device: no host sync in the layer when the experts'
    // GEMMs take device splits (sm90), which makes the step CUDA-graph capturable. With a
    // capacity the dropped count decides the row count, and the routing map copies the sizes to
    // the host.
    const ops::IndexTrust trust =
        router->options.capacity_factor() ? ops::IndexTrust::kChecked : ops::IndexTrust::kDropless;
    // The rows' probabilities' gradient to the router's top-k through the link, where the router
    // hands its probabilities over unchanged (a capacity masks them first).
    std::shared_ptr<autograd::RouterGradLink> probs_link =
        router->options.capacity_factor() ? nullptr : link;
    // Input-scaled experts (Llama-4) at top-1: each token's one probability scales the token
    // itself (the probability's gradient through that product), and the experts take the routed
    // rows on their usual paths with their activation scaled by 1. With more choices each row has
    // its own probability: the rows are scaled after a permuted copy (below).
    torch::Tensor probs = routing.probs;
    const bool scale_rows = options.scale_expert_input() && routing.indices.size(1) > 1;
    if (options.scale_expert_input() && !scale_rows) {
      tokens = tokens * probs.to(dtype);
      probs = torch::ones_like(probs);
      probs_link = nullptr;
    }
    if (scale_rows) {
      PermutedTokens routed =
          autograd::permute_tokens(tokens, routing.indices, options.num_experts(), probs, trust);
      routed.tokens = routed.tokens * routed.probs.to(dtype).unsqueeze(1);
      routed.probs = torch::ones_like(routed.probs);
      const torch::Tensor y =
          options.expert_parallel()
              ? run_experts_parallel(routed, is_first_microbatch)
              : experts->forward(routed.tokens, routed.m_splits, routed.probs, is_first_microbatch);
      out.output = autograd::unpermute_tokens(y, routed, std::nullopt);
    } else if (options.expert_parallel()) {
      const PermutedTokens routed =
          autograd::permute_tokens(tokens, routing.indices, options.num_experts(), probs, trust);
      out.output = autograd::unpermute_tokens(run_experts_parallel(routed, is_first_microbatch),
                                              routed, std::nullopt);
    } else if (options.fuse_permutation().value_or(fp8::enabled())) {
      const PermutedTokens routed = autograd::route_tokens(
          tokens, routing.indices, options.num_experts(), probs, trust, probs_link);
      // In FP8 the unpermute's backward quantizes fc2's output gradient from the rows of the
      // layer's, so the permuted 16-bit gradient is not written either.
      std::shared_ptr<autograd::Fp8GradLink> grad_link;
      if (fp8::enabled()) grad_link = std::make_shared<autograd::Fp8GradLink>();
      const torch::Tensor y = detail::GroupedMLPCalls::forward_routed(
          *experts, tokens, routed, is_first_microbatch, grad_link);
      out.output = autograd::unpermute_tokens(y, routed, std::nullopt, grad_link);
    } else {
      // Top-1 and top-2 routing on the sm90 kernel: the unpermute inside fc2's GEMM and the
      // permutation's backward inside fc1's dgrad (GroupedMLP::forward_combined).
      const PermutedTokens routed = autograd::route_tokens(
          tokens, routing.indices, options.num_experts(), probs, trust, probs_link);
      out.output = experts->forward_combined(tokens, routed, is_first_microbatch);
    }
  }
  if (shared_expert) out.output = out.output + run_shared_expert(flat, is_first_microbatch);
  if (x.dim() != 2) out.output = out.output.view(x.sizes());
  // Without a z-loss its term is a constant zero: no add (and no backward node) for it. Here and
  // for the capacity the router's own options decide, which may have changed since it was built.
  out.aux_loss =
      router->options.z_loss_coeff() > 0 ? routing.aux_loss + routing.z_loss : routing.aux_loss;
  out.tokens_per_expert = routing.tokens_per_expert;
  return out;
}

torch::Tensor MoELayerImpl::run_experts_parallel(const PermutedTokens& routed,
                                                 std::optional<bool> is_first_microbatch) {
  const ProcessGroupOptions& group = *options.expert_parallel();
  // Rows per global expert on the data's device (a CUDA permutation left them there).
  const torch::Tensor rows_per_expert =
      routed.m_splits.has_device()
          ? routed.m_splits.device()
          : torch::tensor(routed.m_splits.host(), torch::kLong).to(routed.tokens.device());
  // Experts are contiguous per rank, so rows grouped by expert are grouped by destination rank.
  const ops::ExpertParallelSplits splits = ops::exchange_split_sizes(rows_per_expert, group);
  const torch::Tensor rows =
      autograd::all_to_all_rows(routed.tokens, splits.send, splits.recv, group);
  const torch::Tensor probs =
      autograd::all_to_all_rows(routed.probs, splits.send, splits.recv, group);
  // The received rows come in blocks by source rank, each grouped by local expert: the experts
  // run them grouped by local expert through the map and write their output rows back in received
  // order (on the sm90 kernel in 16 bits, fc2's epilogue does, and fc1's dgrad for the rows'
  // gradient, so that no grouped output is written and then ungrouped).
  const PermutedTokens local =
      autograd::route_received(probs, splits.recv_per_expert, experts->options.num_experts());
  return autograd::all_to_all_rows(experts->forward_combined(rows, local, is_first_microbatch),
                                   splits.recv, splits.send, group);
}

torch::Tensor MoELayerImpl::run_shared_expert(const torch::Tensor& tokens,
                                              std::optional<bool> is_first_microbatch) {
  const int64_t rows = tokens.size(0);
  // The gate (Qwen2-MoE) is the scaled activation's row scale, which gives its gradient; without
  // one the rows are scaled by 1.
  const torch::Tensor scales =
      shared_expert_gate.defined()
          ? torch::sigmoid(torch::mm(tokens, shared_expert_gate.t())).view({rows})
          : torch::ones({rows}, tokens.options().dtype(torch::kFloat32));
  return shared_expert(tokens, SplitSizes::uniform(1, rows, tokens.device()), scales,
                       is_first_microbatch);
}

torch::Tensor MoELayerImpl::run_padded(const torch::Tensor& tokens, const RouterOutput& routing,
                                       std::optional<bool> is_first_microbatch) {
  const ProcessGroupOptions& group = *options.expert_parallel();
  const int64_t ep = group.group()->getSize(), all = options.num_experts(), local = all / ep;
  // C, and with it every all-to-all's size, follows from T: ranks with different T would pair
  // blocks of different lengths (garbage or a hang). Checked when the layer first sees a T on this
  // group, not every step (a new T during a capture is refused).
  if (tokens.size(0) != capacity_tokens_checked_ ||
      group.group().get() != capacity_group_checked_) {
    distributed::check_same_across_ranks("MoELayer (pad_to_capacity)", "token count",
                                         tokens.size(0), tokens.device(), group);
    capacity_tokens_checked_ = tokens.size(0);
    capacity_group_checked_ = group.group().get();
  }
  const int64_t capacity = expert_capacity(tokens.size(0), router->options);
  const PermutedTokens padded =
      autograd::permute_to_capacity(tokens, routing.indices, routing.probs, all, capacity);
  // local·capacity rows to and from every rank: sizes every rank knows, nothing to exchange.
  const std::vector<int64_t> splits(ep, local * capacity);
  // [first, second, capacity, width] -> [second, first, capacity, width]: the received blocks
  // (by source rank, then local expert) grouped by local expert, and back.
  const auto swap_blocks = [capacity](const torch::Tensor& t, int64_t first, int64_t second) {
    const int64_t width = t.size(1);
    return t.view({first, second, capacity, width})
        .transpose(0, 1)
        .reshape({first * second * capacity, width});
  };
  const torch::Tensor rows =
      swap_blocks(autograd::all_to_all_rows(padded.tokens, splits, splits, group), ep, local);
  const torch::Tensor probs = swap_blocks(
      autograd::all_to_all_rows(padded.probs.unsqueeze(1), splits, splits, group), ep, local);
  const torch::Tensor y = experts(rows, SplitSizes::uniform(local, ep * capacity, tokens.device()),
                                  probs.view(-1), is_first_microbatch);
  const torch::Tensor back =
      autograd::all_to_all_rows(swap_blocks(y, local, ep), splits, splits, group);
  return functional::unpermute_tokens(back, padded);
}

void MoELayerImpl::backward_dw() {
  experts->backward_dw();
  if (shared_expert) shared_expert->backward_dw();
}

void MoELayerImpl::check_no_queued_wgrad(const char* where) const {
  experts->check_no_queued_wgrad(where);
  if (shared_expert) shared_expert->check_no_queued_wgrad(where);
}

void MoELayerImpl::load(torch::serialize::InputArchive& archive) {
  detail::load_all_or_nothing(*this, [&] {
    // Module::load would take the gate in any shape and dtype (set_ on the parameter): it is read
    // apart, checked, and copied in after the children load.
    // The gate is the layer's one tensor of its own: any other would need reading here too.
    TORCH_INTERNAL_ASSERT(named_parameters(/*recurse=*/false).size() ==
                              (shared_expert_gate.defined() ? 1 : 0) &&
                          named_buffers(/*recurse=*/false).is_empty());
    torch::Tensor gate;
    if (shared_expert_gate.defined()) {
      archive.read("shared_expert_gate", gate);
      TORCH_CHECK(
          gate.sizes() == shared_expert_gate.sizes() && torch::isFloatingType(gate.scalar_type()),
          kModule, "::load: 'shared_expert_gate' must be a floating tensor of shape ",
          shared_expert_gate.sizes(), ", got ", gate.scalar_type(), " ", gate.sizes());
    }
    for (const auto& child : named_children()) {
      torch::serialize::InputArchive child_archive;
      archive.read(child.key(), child_archive);
      child.value()->load(child_archive);
    }
    const torch::NoGradGuard no_grad;
    if (gate.defined()) shared_expert_gate.copy_(gate);
  });
}

// The experts' checks before the router moves (Module::to moves the children in order).
void MoELayerImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  check_no_queued_wgrad("MoELayer::to");
  torch::nn::Module::to(device, dtype, non_blocking);
}

void MoELayerImpl::to(torch::Device device, bool non_blocking) {
  check_no_queued_wgrad("MoELayer::to");
  torch::nn::Module::to(device, non_blocking);
}

void MoELayerImpl::to(torch::Dtype dtype, bool non_blocking) {
  check_no_queued_wgrad("MoELayer::to");
  torch::nn::Module::to(dtype, non_blocking);
}

}  // namespace torchmoe
