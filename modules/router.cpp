#include "torchmoe/modules/router.h"

#include <torch/nn/init.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "torchmoe/autograd/router_function.h"
#include "torchmoe/distributed/collectives.h"
#include "torchmoe/modules/router_calls.h"

namespace torchmoe {
namespace {

constexpr const char* kModule = "TopKRouter";

// Per expert, keeps the `capacity` routed tokens with the highest probability.
torch::Tensor capacity_mask(const torch::Tensor& indices, const torch::Tensor& probs,
                            int64_t num_experts, int64_t capacity) {
  const int64_t tokens = indices.size(0);
  const torch::Tensor routed =
      torch::zeros({tokens, num_experts}, probs.options()).scatter(1, indices, probs.detach());
  const torch::Tensor chosen =
      torch::zeros({tokens, num_experts}, torch::TensorOptions(torch::kBool).device(probs.device()))
          .scatter(1, indices, true);
  const torch::Tensor top = std::get<1>(routed.topk(std::min(capacity, tokens), 0));
  const torch::Tensor keep = torch::zeros_like(chosen).scatter(0, top, true) & chosen;
  return keep.gather(1, indices);
}

}  // namespace

int64_t expert_capacity(int64_t tokens, const TopKRouterOptions& options) {
  TORCH_CHECK(options.capacity_factor(), "expert_capacity: options must have a capacity_factor");
  // Checked here as well as at construction: the options are public and may change since.
  const double factor = *options.capacity_factor();
  TORCH_CHECK(std::isfinite(factor) && factor > 0, "expert_capacity: capacity_factor must be ",
              "finite and positive, got ", factor);
  TORCH_CHECK(tokens >= 0 && options.num_experts() > 0, "expert_capacity: tokens must be >= 0 ",
              "and num_experts positive, got ", tokens, " and ", options.num_experts());
  TORCH_CHECK(options.topk() >= 1, "expert_capacity: topk must be >= 1, got ", options.topk());
  const double capacity =
      std::ceil(static_cast<double>(tokens) * static_cast<double>(options.topk()) /
                static_cast<double>(options.num_experts()) * factor);
  TORCH_CHECK(capacity < 0x1p62, "expert_capacity: ", tokens, " tokens at capacity_factor ", factor,
              " give a capacity of ", capacity, " rows per expert, past 2^62");
  return static_cast<int64_t>(capacity);
}

TopKRouterOptions::TopKRouterOptions(int64_t hidden, int64_t num_experts, int64_t topk)
    : hidden_(hidden), num_experts_(num_experts), topk_(topk) {}

TopKRouterImpl::TopKRouterImpl(TopKRouterOptions options_) : options(std::move(options_)) {
  reset();
}

namespace {

// The options forward reads, checked at construction and again at every forward (they are public
// and may change in between).
void check_routing_options(const TopKRouterOptions& o) {
  TORCH_CHECK(o.topk() >= 1 && o.topk() <= o.num_experts(), kModule,
              ": topk must be in [1, num_experts=", o.num_experts(), "], got ", o.topk());
  const int64_t groups = o.num_groups();
  TORCH_CHECK(groups >= 1 && o.num_experts() % groups == 0 &&
                  (groups == 1 || o.num_experts() / groups >= 2),
              kModule, ": num_groups must divide num_experts=", o.num_experts(),
              " into groups of at least 2 experts, got ", groups);
  TORCH_CHECK(o.topk_groups() >= 1 && o.topk_groups() <= groups, kModule,
              ": topk_groups must be in [1, num_groups=", groups, "], got ", o.topk_groups());
  TORCH_CHECK(o.topk() <= o.topk_groups() * (o.num_experts() / groups), kModule,
              ": topk=", o.topk(), " must be at most the ",
              o.topk_groups() * (o.num_experts() / groups),
              " experts of topk_groups=", o.topk_groups(), " groups");
  TORCH_CHECK(std::isfinite(o.routed_scaling_factor()) && o.routed_scaling_factor() > 0, kModule,
              ": routed_scaling_factor must be finite and positive, got ",
              o.routed_scaling_factor());
  TORCH_CHECK(std::isfinite(o.aux_loss_coeff()) && o.aux_loss_coeff() >= 0 &&
                  std::isfinite(o.z_loss_coeff()) && o.z_loss_coeff() >= 0,
              kModule, ": loss coefficients must be finite and >= 0, got aux ", o.aux_loss_coeff(),
              ", z ", o.z_loss_coeff());
}

// normalize_topk unset: on for k > 1 only (see router.h).
bool normalize_of(const TopKRouterOptions& o) { return o.normalize_topk().value_or(o.topk() > 1); }

}  // namespace

void TopKRouterImpl::reset() {
  const TopKRouterOptions& o = options;
  TORCH_CHECK(o.hidden() > 0, kModule, ": hidden must be positive, got ", o.hidden());
  TORCH_CHECK(o.num_experts() > 0, kModule, ": num_experts must be positive, got ",
              o.num_experts());
  check_routing_options(o);
  TORCH_CHECK(
      !o.capacity_factor() || (std::isfinite(*o.capacity_factor()) && *o.capacity_factor() > 0),
      kModule, ": capacity_factor must be finite and positive, got ",
      o.capacity_factor().value_or(0));
  TORCH_CHECK(std::isfinite(o.expert_bias_update_rate()) && o.expert_bias_update_rate() >= 0,
              kModule, ": expert_bias_update_rate must be finite and >= 0, got ",
              o.expert_bias_update_rate());
  TORCH_CHECK(torch::isFloatingType(o.params_dtype()), kModule,
              ": params_dtype must be floating, got ", o.params_dtype());
  const auto tensor_options = torch::TensorOptions(o.params_dtype()).device(o.device());
  weight =
      register_parameter("weight", torch::empty({o.num_experts(), o.hidden()}, tensor_options));
  bias = o.bias() ? register_parameter("bias", torch::empty({o.num_experts()}, tensor_options))
                  : torch::Tensor();
  const auto fp32 = torch::TensorOptions(torch::kFloat32).device(o.device());
  if (o.expert_bias()) {
    expert_bias = register_buffer("expert_bias", torch::zeros({o.num_experts()}, fp32));
    expert_load = register_buffer("expert_load", torch::zeros({o.num_experts()}, fp32));
  }
  reset_parameters();
}

void TopKRouterImpl::reset_parameters() {
  const torch::NoGradGuard no_grad;
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  // As torch::nn::Linear's bias: uniform in ±1/sqrt(fan_in).
  if (bias.defined())
    bias.uniform_(-1.0 / std::sqrt(options.hidden()), 1.0 / std::sqrt(options.hidden()));
  if (expert_bias.defined()) {
    expert_bias.zero_();
    expert_load.zero_();
  }
}

void TopKRouterImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "torchmoe::TopKRouter(hidden=" << options.hidden()
         << ", num_experts=" << options.num_experts() << ", topk=" << options.topk()
         << ", score_function="
         << (options.score_function() == RouterScore::kSoftmax ? "softmax" : "sigmoid")
         << ", normalize_topk=" << normalize_of(options);
  if (options.num_groups() > 1) {
    stream << ", num_groups=" << options.num_groups() << ", topk_groups=" << options.topk_groups();
  }
  if (options.routed_scaling_factor() != 1.0) {
    stream << ", routed_scaling_factor=" << options.routed_scaling_factor();
  }
  if (options.bias()) stream << ", bias=true";
  stream << ")";
}

RouterOutput TopKRouterImpl::forward(const torch::Tensor& x) {
  return detail::TopKRouterCalls::forward(*this, x, nullptr);
}

namespace detail {

RouterOutput TopKRouterCalls::forward(TopKRouterImpl& router, const torch::Tensor& x,
                                      const std::shared_ptr<autograd::RouterGradLink>& grad_link) {
  const TopKRouterOptions& o = router.options;
  const torch::Tensor& weight = router.weight;
  const torch::Tensor& bias = router.bias;
  const torch::Tensor& expert_bias = router.expert_bias;
  // Sizes and the expert bias are what the tensors were built with: changed later they would
  // scale the losses and the capacity for another expert count, or be ignored.
  TORCH_CHECK(weight.size(0) == o.num_experts() && weight.size(1) == o.hidden(), kModule,
              ": options num_experts=", o.num_experts(), " and hidden=", o.hidden(),
              " must be those the router was built with, its weight is ", weight.sizes());
  TORCH_CHECK(expert_bias.defined() == o.expert_bias(), kModule, ": expert_bias was ",
              expert_bias.defined() ? "on" : "off",
              " when the router was built; set it before construction, got ", o.expert_bias());
  TORCH_CHECK(bias.defined() == o.bias(), kModule, ": bias was ", bias.defined() ? "on" : "off",
              " when the router was built; set it before construction, got ", o.bias());
  check_routing_options(o);
  TORCH_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == o.hidden(), kModule,
              ": x must be [..., hidden=", o.hidden(), "], got ",
              x.defined() ? x.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(x.device() == weight.device(), kModule, ": x must be on ", weight.device(),
              " like the router, got ", x.device());
  TORCH_CHECK(torch::isFloatingType(x.scalar_type()), kModule,
              ": x must have a floating dtype, got ", x.scalar_type());
  const int64_t experts = o.num_experts(), topk = o.topk();
  // fp32 routing whatever the parameters' dtype (fp64 stays fp64); 16-bit operands are not cast
  // for it (ops/router.h).
  // A 2-D x is taken as it is: a reshape would add a view and its backward node per call.
  const torch::Tensor rows = x.dim() == 2 ? x : x.reshape({-1, o.hidden()});
  const torch::Tensor logits = autograd::RouterLogitsFunction::apply(
      rows.contiguous(), weight, bias.defined() ? std::optional(bias) : std::nullopt, grad_link);
  const auto compute = logits.scalar_type();
  const int64_t tokens = logits.size(0);
  const bool want_aux = o.aux_loss_coeff() > 0 && tokens > 0;
  // aux_loss = coeff · E / (k · T²) · Σ_e aux_sums[e] · counts[e]: in the router kernel when the
  // counts are this call's own (no process group); with a group after the counts' all-reduce.
  const bool aux_in_kernel = want_aux && !o.process_group();
  const double aux_scale =
      aux_in_kernel ? o.aux_loss_coeff() * experts /
                          (static_cast<double>(topk) * tokens * static_cast<double>(tokens))
                    : 0.0;
  // z_loss = coeff · mean_t lse_t²: in the router kernel without a process group (also its zero
  // without a z-loss, rather than a fill); with a group after the token count's all-reduce.
  const bool z_in_kernel = !o.process_group();
  const double z_scale =
      z_in_kernel && o.z_loss_coeff() > 0 && tokens > 0 ? o.z_loss_coeff() / tokens : 0.0;
  ops::RouterScoring scoring;
  scoring.topk = topk;
  scoring.sigmoid = o.score_function() == RouterScore::kSigmoid;
  scoring.normalize = normalize_of(o);
  scoring.num_groups = o.num_groups();
  scoring.topk_groups = o.topk_groups();
  scoring.scale = o.routed_scaling_factor();
  scoring.aux = want_aux;
  scoring.aux_loss_scale = aux_scale;
  scoring.z_loss = z_in_kernel;
  scoring.z_loss_scale = z_scale;
  const torch::autograd::variable_list scored = autograd::RouterTopKFunction::apply(
      logits, expert_bias.defined() ? std::optional(expert_bias) : std::nullopt, scoring,
      grad_link);

  RouterOutput out;
  out.indices = scored[0];
  out.probs = scored[1];
  out.tokens_per_expert = scored[4];

  // With a group, the losses average over the group's tokens: the counts and the token count are
  // summed in one all-reduce, and the count stays on the device (no host sync).
  torch::Tensor group_tokens;
  if (o.process_group()) {
    torch::Tensor counts =
        torch::cat({out.tokens_per_expert, torch::full({1}, tokens, out.indices.options())});
    distributed::all_reduce_sum_(counts, *o.process_group());
    out.tokens_per_expert = counts.narrow(0, 0, experts);
    group_tokens = counts.narrow(0, experts, 1).squeeze(0).to(compute);
  }

  const auto scalar = torch::TensorOptions(compute).device(x.device());
  if (aux_in_kernel) {
    out.aux_loss = scored[5];
  } else if (want_aux) {
    // scored[2]: the tokens' scores (sigmoid: over their row sum) summed per expert.
    const torch::Tensor weighted = torch::dot(scored[2], out.tokens_per_expert.to(compute));
    out.aux_loss = weighted * (o.aux_loss_coeff() * experts / topk) / group_tokens.square();
  } else {
    out.aux_loss = scored[5];  // the top-k's 0 without the loss
  }
  if (z_in_kernel) {
    out.z_loss = scored[6];
  } else if (o.z_loss_coeff() > 0 && tokens > 0) {
    const torch::Tensor z = scored[3].square();  // scored[3]: logsumexp per token
    out.z_loss = z.sum() * o.z_loss_coeff() / group_tokens;
  } else {
    out.z_loss = torch::zeros({}, scalar);
  }

  if (o.capacity_factor() && tokens > 0) {
    const torch::Tensor kept =
        capacity_mask(out.indices, out.probs, experts, expert_capacity(tokens, o));
    out.indices = torch::where(kept, out.indices, -1);
    out.probs = out.probs * kept;
  }
  if (expert_bias.defined() && router.is_training()) {
    const torch::NoGradGuard no_grad;
    router.expert_load += out.tokens_per_expert.to(torch::kFloat32);
  }
  return out;
}

}  // namespace detail

void TopKRouterImpl::load(torch::serialize::InputArchive& archive) {
  // Module::load would take any shape and dtype (set_data): each entry is checked against the
  // router's tensor first, then copied into it (keeping its dtype), all or nothing.
  std::vector<std::pair<torch::Tensor, torch::Tensor>> reads;  // (the router's, the archive's)
  const auto read_all = [&](const torch::OrderedDict<std::string, torch::Tensor>& tensors,
                            bool is_buffer) {
    for (const auto& item : tensors) {
      torch::Tensor saved;
      archive.read(item.key(), saved, is_buffer);
      TORCH_CHECK(saved.sizes() == item.value().sizes(), kModule, "::load: '", item.key(),
                  "' must have shape ", item.value().sizes(), ", got ", saved.sizes());
      // An integer or complex tensor would be converted without a word (complex losing its
      // imaginary part).
      TORCH_CHECK(torch::isFloatingType(saved.scalar_type()), kModule, "::load: '", item.key(),
                  "' must have a floating dtype, got ", saved.scalar_type());
      reads.emplace_back(item.value(), saved);
    }
  };
  read_all(named_parameters(/*recurse=*/false), false);
  read_all(named_buffers(/*recurse=*/false), true);
  const torch::NoGradGuard no_grad;
  for (auto& [mine, saved] : reads) mine.copy_(saved);
}

void TopKRouterImpl::update_expert_bias() {
  if (!expert_bias.defined()) return;
  const double rate = options.expert_bias_update_rate();
  TORCH_CHECK(std::isfinite(rate) && rate >= 0, kModule,
              ": expert_bias_update_rate must be finite and >= 0, got ", rate);
  const torch::NoGradGuard no_grad;
  expert_bias += rate * torch::sign(expert_load.mean() - expert_load);
  expert_load.zero_();
}

void TopKRouterImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  weight.set_data(weight.to(device, dtype, non_blocking));
  if (bias.defined()) bias.set_data(bias.to(device, dtype, non_blocking));
  for (torch::Tensor& buffer : buffers(/*recurse=*/false)) {
    buffer.set_data(buffer.to(device, non_blocking));
  }
}

void TopKRouterImpl::to(torch::Dtype dtype, bool non_blocking) {
  weight.set_data(weight.to(dtype, non_blocking));
  if (bias.defined()) bias.set_data(bias.to(dtype, non_blocking));
}

}  // namespace torchmoe
