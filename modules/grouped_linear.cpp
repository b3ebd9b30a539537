#include "torchmoe/modules/grouped_linear.h"

#include <torch/nn/init.h>
#include <torch/serialize/input-archive.h>
#include <torch/utils.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>
#include <variant>

#include "torchmoe/autograd/grouped_linear_function.h"
#include "torchmoe/fp8/autocast.h"
#include "torchmoe/fp8/quantize_options.h"
#include "torchmoe/modules/grouped_linear_calls.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/optim/fp8_weight_offers.h"

namespace torchmoe {
namespace {

// The discrete weights' layout: G tensors of their own (each its own version counter and autograd
// state) over one allocation, each slot rounded up to 16 bytes. Equally spaced, so a call reads
// one storage for all of them and the sm90 kernel addresses them with one tensor map instead of a
// table looked up by their G addresses (with 128 experts, 1-2 us of a GPU host's time per call).
// Rounded slots are zeros in between, so a saved storage holds no uninitialized bytes.
std::vector<torch::Tensor> packed_weights(int64_t groups, int64_t out, int64_t in,
                                          const torch::TensorOptions& options) {
  const at::ScalarType dtype = c10::typeMetaToScalarType(options.dtype());
  const int64_t per_16_bytes = std::max<int64_t>(1, 16 / c10::elementSize(dtype));
  const int64_t slot = (out * in + per_16_bytes - 1) / per_16_bytes * per_16_bytes;
  const torch::Tensor buffer = slot == out * in ? torch::empty({groups * slot}, options)
                                                : torch::zeros({groups * slot}, options);
  std::vector<torch::Tensor> weights;
  for (int64_t g = 0; g < groups; ++g) {
    weights.push_back(ops::alias_storage(buffer, dtype, {out, in}, {in, 1}, g * slot));
  }
  return weights;
}

constexpr const char* kModule = "GroupedLinear";
constexpr const char* kFp8State = "fp8_state";

}  // namespace

GroupedLinearOptions::GroupedLinearOptions(int64_t num_gemms, int64_t in_features,
                                           int64_t out_features)
    : num_gemms_(num_gemms), in_features_(in_features), out_features_(out_features) {}

GroupedLinearImpl::GroupedLinearImpl(GroupedLinearOptions options_) : options(std::move(options_)) {
  reset();
}

void GroupedLinearImpl::reset() {
  // Parameters cannot be registered twice (LibTorch's register_parameter refuses a name it has):
  // refused before anything changes. clone() empties the copy before it calls reset().
  TORCH_CHECK(named_parameters(/*recurse=*/false).is_empty() && named_children().is_empty(),
              kModule, "::reset: the layer is built already; build a new one or clone() it");
  const auto& o = options;
  TORCH_CHECK(o.num_gemms() > 0, kModule, ": num_gemms must be positive, got ", o.num_gemms());
  TORCH_CHECK(o.in_features() > 0, kModule, ": in_features must be positive, got ",
              o.in_features());
  TORCH_CHECK(o.out_features() > 0, kModule, ": out_features must be positive, got ",
              o.out_features());
  TORCH_CHECK(o.tp_size() >= 1, kModule, ": tp_size must be at least 1, got ", o.tp_size());
  TORCH_CHECK(o.fp8_amax_history_len() >= 0, kModule,
              ": fp8_amax_history_len must be >= 0 (0: no FP8 state), got ",
              o.fp8_amax_history_len());
  // FP8 weights are copies the layer makes (fp8::Autocast), not parameters it initializes.
  TORCH_CHECK(at::isFloatingType(o.params_dtype()) && !at::isFloat8Type(o.params_dtype()), kModule,
              ": params_dtype must be a floating dtype other than FP8, got ", o.params_dtype());
  // As in TransformerEngine: a bias would need a reduction across tensor-parallel ranks.
  TORCH_CHECK(!o.bias() || o.tp_size() == 1, kModule,
              ": bias is not supported with tensor parallelism (tp_size=", o.tp_size(), ")");
  in_features_per_partition = o.in_features();
  out_features_per_partition = o.out_features();
  if (o.parallel_mode() == ParallelMode::kRow) {
    TORCH_CHECK(o.in_features() % o.tp_size() == 0, kModule, ": tp_size=", o.tp_size(),
                " must divide in_features=", o.in_features(), " in row-parallel mode");
    in_features_per_partition /= o.tp_size();
  } else if (o.parallel_mode() == ParallelMode::kColumn) {
    TORCH_CHECK(o.out_features() % o.tp_size() == 0, kModule, ": tp_size=", o.tp_size(),
                " must divide out_features=", o.out_features(), " in column-parallel mode");
    out_features_per_partition /= o.tp_size();
  }

  const int64_t groups = o.num_gemms(), out = out_features_per_partition,
                in = in_features_per_partition;
  const auto tensor_options = torch::TensorOptions().dtype(o.params_dtype()).device(o.device());
  weight_params_.clear();
  bias_params_.clear();
  if (o.single_grouped_weight()) {
    weight_params_.push_back(
        register_parameter("weight", torch::empty({groups, out, in}, tensor_options)));
  } else {
    const std::vector<torch::Tensor> weights = packed_weights(groups, out, in, tensor_options);
    for (int64_t g = 0; g < groups; ++g) {
      weight_params_.push_back(register_parameter("weight" + std::to_string(g), weights[g]));
    }
  }
  if (o.bias() && o.single_grouped_bias()) {
    bias_params_.push_back(register_parameter("bias", torch::empty({groups, out}, tensor_options)));
  } else if (o.bias()) {
    for (int64_t g = 0; g < groups; ++g) {
      bias_params_.push_back(
          register_parameter("bias" + std::to_string(g), torch::empty({out}, tensor_options)));
    }
  }
  main_grads_.clear();
  if (o.fuse_wgrad_accumulation()) {
    const auto fp32 = tensor_options.dtype(torch::kFloat32);
    if (o.single_grouped_weight()) {
      main_grads_.push_back(torch::zeros({groups, out, in}, fp32));
    } else {
      // Views of one buffer: equally spaced, so the sm90 kernel addresses them without a table.
      main_grads_ = torch::zeros({groups, out, in}, fp32).unbind(0);
    }
  }
  calls_state_ = std::make_shared<detail::GroupedLinearState>();
  fp8_state_ = nullptr;
  if (o.fp8_amax_history_len() > 0) {
    fp8_state_ = register_module(
        kFp8State,
        fp8::Fp8State(fp8::Fp8StateOptions(groups, o.fp8_amax_history_len()).device(o.device())));
  }
  reset_parameters();
}

void GroupedLinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (torch::Tensor weight : expert_weights()) {
    if (options.init_method()) {
      options.init_method()(weight);
    } else {
      torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
    }
  }
  for (torch::Tensor& bias : bias_params_) bias.zero_();
}

void GroupedLinearImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "torchmoe::GroupedLinear(num_gemms=" << options.num_gemms()
         << ", in_features=" << options.in_features() << ", out_features=" << options.out_features()
         << ", bias=" << options.bias() << ")";
}

torch::Tensor GroupedLinearImpl::forward(const torch::Tensor& input, const SplitSizes& m_splits,
                                         std::optional<bool> is_first_microbatch) {
  const torch::Tensor rows = input_rows(input, in_features_per_partition);
  const ops::GemmShape shape = detail::GroupedLinearCalls::gemm_shape(*this);
  const std::vector<ops::GemmPlan> plans =
      ops::plan_grouped_gemms(kModule, rows, {shape}, m_splits, options.gemm_backend(),
                              torch::Tensor(), fp8::current_gemm_options());
  const torch::Tensor output =
      detail::GroupedLinearCalls::run(*this, rows, plans.front(), is_first_microbatch);
  if (input.dim() == 2) return output;  // a view would be one more autograd node per call
  std::vector<int64_t> shape_out = input.sizes().vec();
  shape_out.back() = out_features_per_partition;
  return output.view(shape_out);
}

torch::Tensor GroupedLinearImpl::input_rows(const torch::Tensor& input, int64_t width) const {
  TORCH_CHECK(input.defined(), kModule, ": input must be a defined tensor");
  TORCH_CHECK(input.dim() >= 1, kModule,
              ": input must have at least 1 dimension [..., in_features], got a 0-d tensor");
  TORCH_CHECK(input.size(-1) == width, kModule, ": input's last dimension must be ",
              width == in_features_per_partition ? "in_features=" : "2·in_features=", width,
              ", got input of shape ", input.sizes());
  // The parameters' dtype and device, not the options': ->to() may have changed them.
  const torch::Tensor& weight = weight_params_.front();
  TORCH_CHECK(input.scalar_type() == weight.scalar_type(), kModule,
              ": input must have the parameters' dtype ", weight.scalar_type(), ", got ",
              input.scalar_type());
  TORCH_CHECK(input.device() == weight.device(), kModule,
              ": input must be on the parameters' device ", weight.device(), ", got ",
              input.device());
  // A 2-D input is taken as it is: a reshape would be one more autograd node per call.
  return (input.dim() == 2 ? input : input.reshape({-1, width})).contiguous();
}

namespace detail {

ops::GemmShape GroupedLinearCalls::gemm_shape(const GroupedLinearImpl& layer) {
  auto aligned = [](const std::vector<torch::Tensor>& tensors) {
    for (const torch::Tensor& t : tensors) {
      if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
    }
    return true;
  };
  ops::GemmShape shape;
  shape.n = layer.out_features_per_partition;
  shape.k = layer.in_features_per_partition;
  shape.groups = static_cast<size_t>(layer.options.num_gemms());
  shape.aligned =
      aligned(layer.weight_params_) && aligned(layer.bias_params_) && aligned(layer.main_grads_);
  return shape;
}

torch::Tensor GroupedLinearCalls::run(GroupedLinearImpl& layer, const torch::Tensor& rows,
                                      const ops::GemmPlan& plan,
                                      std::optional<bool> is_first_microbatch,
                                      const torch::Tensor& scales,
                                      const ops::GluOptions* activation,
                                      const autograd::RowGather* gather,
                                      std::shared_ptr<autograd::Fp8GradLink> grad_output_link,
                                      std::shared_ptr<autograd::Fp8GradLink> grad_input_link,
                                      const autograd::OutputScatter* scatter) {
  const GroupedLinearOptions& options = layer.options;
  auto config = c10::make_intrusive<autograd::GroupedLinearConfig>();
  config->plan = plan;
  config->grouped_weight = options.single_grouped_weight();
  config->grouped_bias = options.bias() && options.single_grouped_bias();
  config->main_grads = layer.main_grads_;
  config->overwrite_main_grad = is_first_microbatch.value_or(false);
  if (options.delay_wgrad_compute()) config->wgrad_queue = layer.calls_state_->wgrad_queue;
  if (activation != nullptr) config->input_activation = *activation;
  if (gather != nullptr) config->input_gather = *gather;
  if (scatter != nullptr) config->output_scatter = *scatter;
  if (plan.fp8) config->fp8 = fp8_config(layer, *plan.fp8, is_first_microbatch);
  config->grad_output_link = std::move(grad_output_link);
  config->grad_input_link = std::move(grad_input_link);
  const std::optional<torch::Tensor> row_scales =
      activation != nullptr ? std::optional<torch::Tensor>(scales.reshape({-1})) : std::nullopt;
  return autograd::grouped_linear(rows, row_scales, at::TensorList(layer.weight_params_),
                                  at::TensorList(layer.bias_params_), config,
                                  &layer.calls_state_->edges);
}

autograd::Fp8Config GroupedLinearCalls::fp8_config(const GroupedLinearImpl& layer,
                                                   const ops::Fp8GemmOptions& planned,
                                                   std::optional<bool> is_first_microbatch) {
  const fp8::Fp8State& state = layer.fp8_state_;
  const std::optional<fp8::Recipe> recipe = fp8::current();
  TORCH_INTERNAL_ASSERT(recipe.has_value(), "GroupedLinear: an FP8 plan outside fp8::Autocast");
  if (const auto* delayed = std::get_if<fp8::DelayedScaling>(&*recipe)) {
    TORCH_CHECK(state, kModule, ": the DelayedScaling recipe keeps amax histories in the ",
                "layer; build it with fp8_amax_history_len(", delayed->amax_history_len(),
                ") (the recipe's amax_history_len)");
    TORCH_CHECK(state->options.amax_history_len() == delayed->amax_history_len(), kModule,
                ": the DelayedScaling recipe's amax_history_len (", delayed->amax_history_len(),
                ") must be the layer's fp8_amax_history_len (", state->options.amax_history_len(),
                ")");
  }
  autograd::Fp8Config config;
  config.state = state;
  config.is_first_microbatch = is_first_microbatch;
  config.weight_cache = layer.calls_state_->fp8_weight_cache;
  // The optimizer's copies stand in for delayed-scaling weights while they are current.
  config.optimizer_weights =
      planned.weight.scaling == ops::QuantizeScaling::kDelayed &&
      autograd::tensor_versions(layer.weight_params_) == config.weight_cache->versions;
  if (planned.weight.scaling == ops::QuantizeScaling::kDelayed && !config.optimizer_weights) {
    layer.offer_fp8_weights();
  }
  return config;
}

}  // namespace detail

std::string GroupedLinearImpl::fp8_weight_target_refusal() const {
  if (!fp8_state_) {
    return c10::str("the copies are scaled with the layer's delayed-scaling state, so the layer ",
                    "must be built with fp8_amax_history_len > 0, got ",
                    options.fp8_amax_history_len());
  }
  if (in_features_per_partition % 16 != 0 || out_features_per_partition % 16 != 0) {
    return c10::str("the layer's in and out features must be multiples of 16 (FP8 GEMM operands), ",
                    "got ", in_features_per_partition, " and ", out_features_per_partition);
  }
  if (weak_from_this().expired()) {
    return "the layer must be held by a GroupedLinear (a shared pointer), which the target keeps "
           "alive";
  }
  return {};
}

optim::Fp8WeightTarget GroupedLinearImpl::fp8_weight_target() const {
  const std::string refusal = fp8_weight_target_refusal();
  TORCH_CHECK(refusal.empty(), kModule, "::fp8_weight_target: ", refusal);
  // The target writes the layer's copies and state (shared with its calls), not its options or
  // parameters: a const layer hands it out too.
  const std::shared_ptr<GroupedLinearImpl> self = std::const_pointer_cast<GroupedLinearImpl>(
      std::dynamic_pointer_cast<const GroupedLinearImpl>(weak_from_this().lock()));
  TORCH_INTERNAL_ASSERT(self);
  optim::Fp8WeightTarget target;
  target.layer = this;
  target.weights = weight_params_;
  target.copies = [self] { return self->optimizer_fp8_weights(); };
  target.written = [self] {
    TORCH_CHECK(self->calls_state_->fp8_weight_cache->optimizer_weights.data.defined(), kModule,
                "::fp8_weight_target: written() before the copies were handed out (copies())");
    self->calls_state_->fp8_weight_cache->versions =
        autograd::tensor_versions(self->weight_params_);
  };
  return target;
}

optim::Fp8WeightCopies GroupedLinearImpl::optimizer_fp8_weights() const {
  ops::SplitQuantized& q = calls_state_->fp8_weight_cache->optimizer_weights;
  if (!q.data.defined()) {
    const int64_t groups = options.num_gemms(), n = out_features_per_partition,
                  k = in_features_per_partition;
    const torch::TensorOptions like = weight_params_.front().options();
    q.data = torch::empty({groups * n, k}, like.dtype(torch::kFloat8_e4m3fn));
    q.columnwise_data = torch::empty({groups * n * k}, like.dtype(torch::kFloat8_e4m3fn));
    q.scale_inv = torch::empty({groups}, like.dtype(torch::kFloat32));
    // What DelayedScaling makes of a weight, whose copies the optimizer writes in its place.
    const ops::SplitQuantizeOptions weight = fp8::gemm_options(fp8::DelayedScaling()).weight;
    q.format = weight.format;
    q.scaling = weight.scaling;
  }
  const fp8::DelayedScalingTensors& state = fp8_state_->tensors(fp8::TensorRole::kWeight);
  return {q.data, q.columnwise_data, state.scale, q.scale_inv, state.amax_history.select(0, 0)};
}

void GroupedLinearImpl::offer_fp8_weights() const {
  bool& offered = calls_state_->fp8_weights_offered;
  if (offered || !options.fp8_weights_from_optimizer()) return;
  // A layer fp8_weight_target() refuses is not offered (what it checks does not change while the
  // layer lives): its forwards keep casting.
  offered = true;
  if (!fp8_weight_target_refusal().empty()) return;
  const std::weak_ptr<const torch::nn::Module> alive = weak_from_this();
  // The offer holds the layer weakly: it ends with the layer.
  optim::detail::offer_fp8_weights(this, alive, [alive] {
    const auto layer = std::dynamic_pointer_cast<const GroupedLinearImpl>(alive.lock());
    return layer ? layer->fp8_weight_target() : optim::Fp8WeightTarget();
  });
}

void GroupedLinearImpl::backward_dw() {
  TORCH_CHECK(options.delay_wgrad_compute(), kModule,
              "::backward_dw: delay_wgrad_compute is off, so backward already computed the weight "
              "gradients");
  TORCH_CHECK(!calls_state_->wgrad_queue->empty(), kModule,
              "::backward_dw: no weight-gradient computation is queued (run backward first)");
  const autograd::DelayedWgrad work = std::move(calls_state_->wgrad_queue->front());
  calls_state_->wgrad_queue->pop_front();
  const std::vector<torch::Tensor> grads = autograd::run_delayed_wgrad(work);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < grads.size(); ++i) {
    // Accumulate exactly as autograd's AccumulateGrad would into .grad.
    torch::Tensor& grad = weight_params_[i].mutable_grad();
    if (grad.defined()) {
      grad.add_(grads[i]);
    } else {
      grad = grads[i];
    }
  }
}

int64_t GroupedLinearImpl::pending_wgrad_count() const {
  return static_cast<int64_t>(calls_state_->wgrad_queue->size());
}

std::vector<torch::Tensor> GroupedLinearImpl::main_grads() const { return main_grads_; }

void GroupedLinearImpl::set_main_grads(std::vector<torch::Tensor> buffers) {
  TORCH_CHECK(options.fuse_wgrad_accumulation(), kModule,
              "::set_main_grads: fuse_wgrad_accumulation is off, so main-grad buffers are unused");
  TORCH_CHECK(buffers.size() == main_grads_.size(), kModule, "::set_main_grads: expected ",
              main_grads_.size(), " buffer(s), got ", buffers.size());
  for (size_t i = 0; i < buffers.size(); ++i) {
    const torch::Tensor& b = buffers[i];
    TORCH_CHECK(b.defined(), kModule, "::set_main_grads: buffer ", i, " is undefined");
    TORCH_CHECK(b.sizes() == main_grads_[i].sizes(), kModule, "::set_main_grads: buffer ", i,
                " must have shape ", main_grads_[i].sizes(), ", got ", b.sizes());
    TORCH_CHECK(b.scalar_type() == torch::kFloat32, kModule, "::set_main_grads: buffer ", i,
                " must be float32, got ", b.scalar_type());
    TORCH_CHECK(b.device() == main_grads_[i].device(), kModule, "::set_main_grads: buffer ", i,
                " must be on ", main_grads_[i].device(), ", got ", b.device());
    TORCH_CHECK(b.is_contiguous(), kModule, "::set_main_grads: buffer ", i, " must be contiguous");
  }
  main_grads_ = std::move(buffers);
}

void GroupedLinearImpl::check_no_queued_wgrad(const char* where) const {
  TORCH_CHECK(calls_state_->wgrad_queue->empty(), where, ": ", calls_state_->wgrad_queue->size(),
              " delayed weight-gradient computation(s) are queued; run backward_dw() first");
}

void GroupedLinearImpl::to(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  check_no_queued_wgrad("GroupedLinear::to");
  pack_weights(device, dtype, non_blocking);
  torch::nn::Module::to(device, dtype, non_blocking);
  move_main_grads(device);
  drop_fp8_weight_copies();
}

void GroupedLinearImpl::to(torch::Device device, bool non_blocking) {
  check_no_queued_wgrad("GroupedLinear::to");
  pack_weights(device, weight_params_.front().scalar_type(), non_blocking);
  torch::nn::Module::to(device, non_blocking);
  move_main_grads(device);
  drop_fp8_weight_copies();
}

// to(device, dtype) on the parameters' own device: its checks and FP8 copy drop, no move.
void GroupedLinearImpl::to(torch::Dtype dtype, bool non_blocking) {
  to(weight_params_.front().device(), dtype, non_blocking);
}

std::shared_ptr<torch::nn::Module> GroupedLinearImpl::clone(
    const std::optional<torch::Device>& device) const {
  // The copy's queue would start empty, and the queued work's configs point at this layer's
  // main grads: refused as to() refuses it.
  check_no_queued_wgrad("GroupedLinear::clone");
  auto copy = std::dynamic_pointer_cast<GroupedLinearImpl>(Cloneable::clone(device));
  TORCH_INTERNAL_ASSERT(copy, kModule, "::clone: Cloneable made another type");
  // The copy's reset() made its main grads on options.device(), and Cloneable gave each of its
  // weights a storage of its own.
  const torch::Tensor& weight = copy->weight_params_.front();
  copy->move_main_grads(weight.device());
  copy->pack_weights(weight.device(), weight.scalar_type(), /*non_blocking=*/false);
  return copy;
}

// LibTorch's to() and clone() give each parameter a storage of its own: the discrete weights are
// moved into packed_weights' layout on `device` in `dtype` first (to() then finds them there).
// set_data keeps each parameter's identity, autograd state and version counter.
void GroupedLinearImpl::pack_weights(torch::Device device, torch::Dtype dtype, bool non_blocking) {
  if (options.single_grouped_weight()) return;
  const torch::Tensor& first = weight_params_.front();
  const bool packed =
      first.device() == device && first.scalar_type() == dtype &&
      std::all_of(weight_params_.begin(), weight_params_.end(),
                  [&](const torch::Tensor& w) { return w.storage().is_alias_of(first.storage()); });
  if (packed) return;
  const torch::NoGradGuard no_grad;
  const std::vector<torch::Tensor> weights =
      packed_weights(static_cast<int64_t>(weight_params_.size()), first.size(0), first.size(1),
                     first.options().device(device).dtype(dtype));
  for (size_t g = 0; g < weights.size(); ++g) {
    weights[g].copy_(weight_params_[g], non_blocking);
    weight_params_[g].set_data(weights[g]);
  }
}

// The copies stay where they were: the optimizer's (the parameters' new storage keeps their
// version counters, so they would pass as current) and the is_first_microbatch cache (a later
// micro-batch would meet them on the old device or in the old dtype's scaling).
void GroupedLinearImpl::drop_fp8_weight_copies() {
  autograd::Fp8WeightCache& cache = *calls_state_->fp8_weight_cache;
  cache.optimizer_weights = ops::SplitQuantized();
  cache.versions.clear();
  cache.weights = ops::SplitQuantized();
}

// Main grads stay float32 whatever the parameters' dtype; views of one buffer stay views of one
// buffer, so that the grouped GEMM keeps addressing them without a table.
void GroupedLinearImpl::move_main_grads(torch::Device device) {
  if (main_grads_.empty() || main_grads_.front().device() == device) return;
  if (main_grads_.size() == 1) {
    main_grads_.front() = main_grads_.front().to(device);
  } else {
    main_grads_ = torch::stack(main_grads_).to(device).unbind(0);
  }
}

std::vector<torch::Tensor> GroupedLinearImpl::expert_weights() const {
  if (options.single_grouped_weight()) return weight_params_.front().unbind(0);
  return weight_params_;
}

std::vector<torch::Tensor> GroupedLinearImpl::expert_biases() const {
  if (options.bias() && options.single_grouped_bias()) return bias_params_.front().unbind(0);
  return bias_params_;
}

TensorParallelAttributes GroupedLinearImpl::tensor_parallel_attributes(
    const std::string& parameter_name) const {
  TORCH_CHECK(named_parameters(/*recurse=*/false).contains(parameter_name), kModule,
              ": no parameter named '", parameter_name, "'");
  const bool row = options.parallel_mode() == ParallelMode::kRow;
  if (parameter_name.rfind("weight", 0) == 0) {
    // Weights are [out, in] (or [G, out, in]): row mode splits `in`, column mode (and, as in
    // TransformerEngine, no mode) the `out` dimension.
    const int64_t lead = options.single_grouped_weight() ? 1 : 0;
    return {true, lead + (row ? 1 : 0), 1};
  }
  if (options.parallel_mode() == ParallelMode::kColumn) {
    return {true, options.single_grouped_bias() ? 1 : 0, 1};
  }
  return {};
}

void GroupedLinearImpl::load_state_dict(
    const std::unordered_map<std::string, torch::Tensor>& state_dict) {
  const int64_t groups = options.num_gemms();
  std::set<std::string> used;
  // Collects the per-expert tensors of `name` from either layout.
  auto experts = [&](const std::string& name) {
    std::vector<torch::Tensor> tensors;
    if (auto it = state_dict.find(name); it != state_dict.end()) {
      TORCH_CHECK(it->second.dim() >= 1 && it->second.size(0) == groups, kModule,
                  "::load_state_dict: '", name, "' must have num_gemms=", groups,
                  " as its first dimension, got shape ", it->second.sizes());
      used.insert(name);
      return it->second.unbind(0);
    }
    for (int64_t g = 0; g < groups; ++g) {
      const std::string key = name + std::to_string(g);
      auto it = state_dict.find(key);
      TORCH_CHECK(it != state_dict.end(), kModule, "::load_state_dict: missing '", key,
                  "' (or a stacked '", name, "')");
      used.insert(key);
      tensors.push_back(it->second);
    }
    return tensors;
  };
  const std::vector<torch::Tensor> weights = experts("weight");
  const std::vector<torch::Tensor> biases =
      options.bias() ? experts("bias") : std::vector<torch::Tensor>{};
  const std::string fp8_prefix = std::string(kFp8State) + ".";
  std::unordered_map<std::string, torch::Tensor> fp8_state;
  for (const auto& [key, value] : state_dict) {
    if (key.rfind(fp8_prefix, 0) == 0) {
      fp8_state.emplace(key.substr(fp8_prefix.size()), value);
      continue;
    }
    TORCH_CHECK(used.count(key), kModule, "::load_state_dict: unexpected key '", key, "'");
  }
  // Every shape is checked before anything is copied: a rejected checkpoint leaves the layer
  // whole.
  const std::vector<torch::Tensor> weight_targets = expert_weights();
  const std::vector<torch::Tensor> bias_targets = expert_biases();
  auto check_all = [&](const std::vector<torch::Tensor>& targets,
                       const std::vector<torch::Tensor>& sources, const char* name) {
    for (size_t g = 0; g < targets.size(); ++g) {
      TORCH_CHECK(sources[g].sizes() == targets[g].sizes(), kModule, "::load_state_dict: ", name,
                  " of expert ", g, " must have shape ", targets[g].sizes(), ", got ",
                  sources[g].sizes());
      // Checked here, before anything is copied: a tensor copy_ refuses would stop a load halfway.
      TORCH_CHECK(torch::isFloatingType(sources[g].scalar_type()) &&
                      sources[g].layout() == torch::kStrided && !sources[g].is_meta(),
                  kModule, "::load_state_dict: ", name, " of expert ", g,
                  " must be a floating strided tensor with data, got ", sources[g].scalar_type(),
                  " ", sources[g].layout(), " on ", sources[g].device());
    }
  };
  check_all(weight_targets, weights, "weight");
  check_all(bias_targets, biases, "bias");
  if (fp8_state_) fp8_state_->check_state_dict(fp8_state, fp8_prefix);
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < weight_targets.size(); ++g) weight_targets[g].copy_(weights[g]);
  for (size_t g = 0; g < bias_targets.size(); ++g) bias_targets[g].copy_(biases[g]);
  if (fp8_state_) fp8_state_->load_state_dict(fp8_state);
}

void GroupedLinearImpl::load(torch::serialize::InputArchive& archive) {
  std::unordered_map<std::string, torch::Tensor> state;
  auto try_read = [&](const std::string& key) {
    torch::Tensor value;
    if (archive.try_read(key, value)) state.emplace(key, value);
  };
  for (const std::string name : {"weight", "bias"}) {
    try_read(name);
    for (int64_t g = 0; g < options.num_gemms(); ++g) try_read(name + std::to_string(g));
    // One past the layer's experts: an archive of more experts would load truncated.
    torch::Tensor extra;
    TORCH_CHECK(!archive.try_read(name + std::to_string(options.num_gemms()), extra), kModule,
                "::load: the archive has '", name, options.num_gemms(),
                "', so more experts than the layer's num_gemms (", options.num_gemms(), ")");
  }
  // The FP8 state's archive is read first, so that one load_state_dict checks everything before
  // it copies anything.
  torch::serialize::InputArchive fp8_archive;
  if (fp8_state_ && archive.try_read(kFp8State, fp8_archive)) {
    for (auto& [key, value] : fp8_state_->read(fp8_archive)) {
      state.emplace(std::string(kFp8State) + "." + key, std::move(value));
    }
  }
  load_state_dict(state);
}

}  // namespace torchmoe
