#include "torchmoe/ops/router.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <utility>
#include <vector>

#include "torchmoe/kernels/grouped_gemm_cublaslt.h"
#include "torchmoe/kernels/router.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

constexpr const char* kOp = "torchmoe::ops::router_logits";

// fp32, or fp64 when either operand is fp64.
at::ScalarType logits_type(const at::Tensor& x, const at::Tensor& weight) {
  return at::promote_types(at::promote_types(x.scalar_type(), weight.scalar_type()), at::kFloat);
}

// Both operands of one 16-bit dtype on CUDA: tensor cores with fp32 accumulation and output.
bool tensor_core_path(const at::Tensor& x, const at::Tensor& weight) {
  return x.is_cuda() && x.scalar_type() == weight.scalar_type() &&
         (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
}

// An fp32 product of 16-bit operands as one cuBLASLt matmul of the per-group backend, whose plan
// (descriptors and algorithm) is cached: at::mm with an fp32 out_dtype asks cuBLASLt's heuristic
// at every call (19 us of host time per router forward on an H100 host). kFprop: input [rows, k]
// · other [n, k]ᵀ -> [rows, n]; kWgrad: other [rows, n]ᵀ · input [rows, k] -> [n, k].
at::Tensor fp32_product(kernels::GemmKind kind, const at::Tensor& input, const at::Tensor& other) {
  const at::Tensor a = input.contiguous(), b = other.contiguous();
  const int64_t rows = a.size(0), k = a.size(1);
  const int64_t n = kind == kernels::GemmKind::kFprop ? b.size(0) : b.size(1);
  const auto shape = kind == kernels::GemmKind::kFprop ? std::vector<int64_t>{rows, n}
                                                       : std::vector<int64_t>{n, k};
  at::Tensor out = new_empty(shape, a.options().dtype(at::kFloat));
  kernels::GroupedGemmParams params;
  params.kind = kind;
  params.n = n;
  params.k = k;
  params.input_type = kernel_type(a.scalar_type());
  params.output_type = kernels::ScalarType::kFloat32;
  kernels::GemmGroup group;
  group.rows = rows;
  group.input = a.const_data_ptr();
  if (kind == kernels::GemmKind::kFprop) {
    group.weight = b.const_data_ptr();
  } else {
    group.grad_output = b.const_data_ptr();
  }
  group.output = out.data_ptr();
  params.groups.push_back(group);
  detail::run_cublaslt(a, std::move(params));
  return out;
}

constexpr const char* kTopKOp = "torchmoe::ops::router_topk";

enum class TopKBackend {
  kAten,  // ATen ops: any device, fp32/fp64, any expert count and k
  kCuda,  // kernels/router.cu: fp32 logits, E <= kRouterMaxExperts, k <= kRouterMaxTopK
};

TopKBackend select_topk_backend(const at::Tensor& logits, const RouterScoring& scoring) {
  if (logits.is_cuda() && logits.scalar_type() == at::kFloat &&
      logits.size(1) <= kernels::kRouterMaxExperts && scoring.topk <= kernels::kRouterMaxTopK &&
      scoring.num_groups <= kernels::kRouterMaxGroups) {
    return TopKBackend::kCuda;
  }
  return TopKBackend::kAten;
}

// The operands router_logits and its backward multiply.
void check_operands(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.defined() && x.dim() == 2, kOp, ": x must be 2-D [tokens, hidden], got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(weight.defined() && weight.dim() == 2 && weight.size(1) == x.size(1), kOp,
              ": weight must be [experts, hidden=", x.size(1), "], got ",
              weight.defined() ? weight.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isFloatingType(x.scalar_type()) && at::isFloatingType(weight.scalar_type()), kOp,
              ": x and weight must have floating dtypes, got ", x.scalar_type(), " and ",
              weight.scalar_type());
  TORCH_CHECK(x.device() == weight.device(), kOp, ": x and weight must be on one device, got ",
              x.device(), " and ", weight.device());
}

// The logits router_topk and its backward take, and a top-k they can choose.
void check_logits(const at::Tensor& logits, const RouterScoring& scoring) {
  TORCH_CHECK(logits.defined() && logits.dim() == 2 && logits.size(1) > 0, kTopKOp,
              ": logits must be 2-D [tokens, experts > 0], got ",
              logits.defined() ? logits.sizes() : at::IntArrayRef{});
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble, kTopKOp,
              ": logits must be float32 or float64, got ", logits.scalar_type());
  TORCH_CHECK(logits.is_contiguous(), kTopKOp, ": logits must be contiguous");
  TORCH_CHECK(scoring.topk >= 1 && scoring.topk <= logits.size(1), kTopKOp,
              ": topk must be in [1, ", logits.size(1), "], got ", scoring.topk);
  const int64_t experts = logits.size(1), groups = scoring.num_groups;
  TORCH_CHECK(groups >= 1 && experts % groups == 0 && (groups == 1 || experts / groups >= 2),
              kTopKOp, ": num_groups must divide the ", experts,
              " experts into groups of at least 2 (each group is ranked by its two best), got ",
              groups);
  TORCH_CHECK(scoring.topk_groups >= 1 && scoring.topk_groups <= groups, kTopKOp,
              ": topk_groups must be in [1, num_groups=", groups, "], got ", scoring.topk_groups);
  TORCH_CHECK(groups == 1 || scoring.topk <= scoring.topk_groups * (experts / groups), kTopKOp,
              ": topk must be at most the ", scoring.topk_groups * (experts / groups),
              " experts of the topk_groups kept groups, got ", scoring.topk);
  TORCH_CHECK(std::isfinite(scoring.scale) && scoring.scale > 0, kTopKOp,
              ": scale must be finite and positive, got ", scoring.scale);
}

// The choice scores with every expert outside the token's topk_groups best groups at -inf.
at::Tensor group_limited(const at::Tensor& choice, const RouterScoring& scoring) {
  if (scoring.num_groups == 1) return choice;
  const int64_t tokens = choice.size(0), experts = choice.size(1), groups = scoring.num_groups;
  const at::Tensor grouped = choice.view({tokens, groups, experts / groups});
  const at::Tensor group_scores = std::get<0>(grouped.topk(2, 2)).sum(2);  // [T, G]
  const at::Tensor kept = std::get<1>(group_scores.topk(scoring.topk_groups, 1));
  const at::Tensor mask =
      at::zeros({tokens, groups}, choice.options().dtype(at::kBool)).scatter(1, kept, true);
  return grouped.masked_fill(mask.logical_not().unsqueeze(2), -INFINITY).view({tokens, experts});
}

at::Tensor aten_scores(const at::Tensor& logits, const RouterScoring& scoring) {
  return scoring.sigmoid ? at::sigmoid(logits) : at::softmax(logits, 1);
}

kernels::RouterParams kernel_params(const at::Tensor& logits, const RouterScoring& scoring) {
  kernels::RouterParams p;
  p.tokens = logits.size(0);
  p.experts = logits.size(1);
  p.topk = scoring.topk;
  p.sigmoid = scoring.sigmoid;
  p.normalize = scoring.normalize;
  p.num_groups = scoring.num_groups;
  p.topk_groups = scoring.topk_groups;
  p.scale = static_cast<float>(scoring.scale);
  p.logits = logits.const_data_ptr<float>();
  return p;
}

// A defined gradient that is not all-absent (an empty aux stands for "not asked for").
const float* optional_data(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.const_data_ptr<float>() : nullptr;
}

}  // namespace

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  check_operands(x, weight);
  TORCH_CHECK(!bias.defined() ||
                  (bias.dim() == 1 && bias.size(0) == weight.size(0) &&
                   at::isFloatingType(bias.scalar_type()) && bias.device() == weight.device()),
              kOp, ": bias must be a floating [experts=", weight.size(0), "] tensor on ",
              weight.device(), ", got ",
              bias.defined()
                  ? c10::str(bias.scalar_type(), " ", bias.sizes(), " on ", bias.device())
                  : std::string());
  at::Tensor logits;
  if (tensor_core_path(x, weight) && x.numel() > 0 && weight.numel() > 0) {
    logits = fp32_product(kernels::GemmKind::kFprop, x, weight);
  } else {
    const at::ScalarType compute = logits_type(x, weight);
    logits = at::mm(x.to(compute), weight.to(compute).t());
  }
  if (bias.defined()) logits.add_(bias);
  return logits;
}

bool router_logits_backward_splits(const at::Tensor& x, const at::Tensor& weight) {
  // bf16 only: fp16's narrow exponent range makes the small halves of small gradients subnormal.
  return tensor_core_path(x, weight) && x.scalar_type() == at::kBFloat16 &&
         x.device() == weight.device();
}

RouterLogitsGrads router_logits_backward(const at::Tensor& grad_logits, const at::Tensor& x,
                                         const at::Tensor& weight, RouterGradX grad_x,
                                         bool need_grad_weight, const RouterGradXProduct& split,
                                         const at::Tensor& bias) {
  check_operands(x, weight);
  TORCH_CHECK(grad_logits.defined() && grad_logits.dim() == 2 && grad_logits.size(0) == x.size(0) &&
                  grad_logits.size(1) == weight.size(0),
              kOp, ": grad_logits must be [tokens=", x.size(0), ", experts=", weight.size(0),
              "], got ", grad_logits.defined() ? grad_logits.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isFloatingType(grad_logits.scalar_type()), kOp,
              ": grad_logits must have a floating dtype, got ", grad_logits.scalar_type());
  TORCH_CHECK(grad_logits.device() == x.device(), kOp, ": grad_logits must be on ", x.device(),
              " like x and weight, got ", grad_logits.device());
  RouterLogitsGrads grads;
  RouterGradXProduct product;
  product.out_dtype = x.scalar_type();
  const bool need_grad_x = grad_x != RouterGradX::kNone;
  const bool split_path = router_logits_backward_splits(x, weight);
  const int64_t tokens = x.size(0), experts = weight.size(0);
  if (split.lhs.defined()) {
    TORCH_CHECK(
        split_path && split.lhs.sizes() == at::IntArrayRef({tokens, 2 * experts}) &&
            split.lhs.scalar_type() == at::kBFloat16 && split.lhs.device() == x.device() &&
            (!need_grad_x || (split.rhs.defined() &&
                              split.rhs.sizes() == at::IntArrayRef({2 * experts, x.size(1)}))),
        kOp, ": split must be router_topk_backward's split for bf16 x and weight on ", "CUDA ([",
        tokens, ", ", 2 * experts, "] and [", 2 * experts, ", ", x.size(1), "] bf16), got ",
        split.lhs.sizes(), " ", split.lhs.scalar_type(), " for ", x.scalar_type(), " x on ",
        x.device());
  }
  if (split_path) {
    // [hi | lo] and [W; W] (kernels/router.h) in one launch, or the top-k's launch when it wrote
    // them: each product below is then one GEMM over both halves.
    const c10::cuda::CUDAGuard guard(x.device());
    if (split.lhs.defined()) {
      product.lhs = split.lhs;
      if (need_grad_x) product.rhs = split.rhs;
    } else {
      const at::Tensor g = grad_logits.to(at::kFloat).contiguous();
      const at::Tensor w = need_grad_x ? weight.contiguous() : at::Tensor();
      product.lhs = new_empty({tokens, 2 * experts}, x.options());
      if (need_grad_x) product.rhs = new_empty({2 * experts, x.size(1)}, x.options());
      kernels::RouterGradSplitParams p;
      p.grad = g.const_data_ptr<float>();
      p.hilo = product.lhs.data_ptr();
      p.tokens = tokens;
      p.experts = experts;
      p.weight = need_grad_x ? w.const_data_ptr() : nullptr;
      p.stacked = need_grad_x ? product.rhs.data_ptr() : nullptr;
      p.hidden = x.size(1);
      kernels::launch_router_grad_split(p, at::cuda::getCurrentCUDAStream().stream());
    }
    if (need_grad_weight) {
      // Rows [0, E) are hiᵀ·x, rows [E, 2E) loᵀ·x: their fp32 sum, rounded once.
      const at::Tensor halves = x.numel() > 0 && experts > 0
                                    ? fp32_product(kernels::GemmKind::kWgrad, x, product.lhs)
                                    : at::mm(product.lhs.t(), x, at::kFloat);
      TORCH_INTERNAL_ASSERT(halves.is_contiguous(), kOp, ": the halves' product is not row-major");
      grads.grad_weight = new_empty(weight.sizes(), weight.options());
      kernels::RouterHalvesSumParams p;
      p.halves = halves.const_data_ptr<float>();
      p.out = grads.grad_weight.data_ptr();
      p.experts = experts;
      p.hidden = x.size(1);
      kernels::launch_router_halves_sum(p, at::cuda::getCurrentCUDAStream().stream());
    }
  } else {
    const at::ScalarType compute = logits_type(x, weight);
    product.lhs = grad_logits.to(compute);
    if (need_grad_x) product.rhs = weight.to(compute);
    if (need_grad_weight) {
      grads.grad_weight = at::mm(product.lhs.t(), x.to(compute)).to(weight.scalar_type());
    }
  }
  if (bias.defined()) grads.grad_bias = grad_logits.sum(0).to(bias.scalar_type());
  if (grad_x == RouterGradX::kNow) {
    grads.grad_x = router_grad_x(product);
  } else if (grad_x == RouterGradX::kDeferred) {
    grads.grad_x_product = std::move(product);
  }
  return grads;
}

at::Tensor router_grad_x(const RouterGradXProduct& product, const at::Tensor& grad_x_addend) {
  const at::Tensor& lhs = product.lhs;
  const at::Tensor& rhs = product.rhs;
  TORCH_CHECK(lhs.defined() && rhs.defined() && lhs.dim() == 2 && rhs.dim() == 2 &&
                  lhs.size(1) == rhs.size(0) && lhs.scalar_type() == rhs.scalar_type() &&
                  lhs.device() == rhs.device(),
              "torchmoe::ops::router_grad_x: the product must be router_logits_backward's "
              "grad_x_product (RouterGradX::kDeferred)");
  TORCH_CHECK(!grad_x_addend.defined() ||
                  (grad_x_addend.dim() == 2 && grad_x_addend.size(0) == lhs.size(0) &&
                   grad_x_addend.size(1) == rhs.size(1) &&
                   grad_x_addend.scalar_type() == product.out_dtype &&
                   grad_x_addend.device() == lhs.device() && grad_x_addend.is_contiguous()),
              "torchmoe::ops::router_grad_x: grad_x_addend must be a contiguous ",
              product.out_dtype, " [", lhs.size(0), ", ", rhs.size(1), "] tensor on ", lhs.device(),
              ", got ", grad_x_addend.defined() ? grad_x_addend.sizes() : at::IntArrayRef{});
  if (lhs.scalar_type() == product.out_dtype) {
    return grad_x_addend.defined() ? at::Tensor(grad_x_addend).addmm_(lhs, rhs) : at::mm(lhs, rhs);
  }
  const at::Tensor grad_x = at::mm(lhs, rhs).to(product.out_dtype);
  return grad_x_addend.defined() ? grad_x_addend + grad_x : grad_x;
}

RouterTopK router_topk(const at::Tensor& logits, const at::Tensor& expert_bias,
                       const RouterScoring& scoring) {
  check_logits(logits, scoring);
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  TORCH_CHECK(!scoring.aux || tokens < kernels::kRouterMaxAuxTokens, kTopKOp,
              ": the aux loss's sums take fewer than 2^31 tokens, got ", tokens);
  TORCH_CHECK(std::isfinite(scoring.aux_loss_scale) && scoring.aux_loss_scale >= 0 &&
                  (scoring.aux_loss_scale == 0 || scoring.aux),
              kTopKOp, ": aux_loss_scale must be finite, >= 0, and 0 without aux, got ",
              scoring.aux_loss_scale);
  const bool want_loss = scoring.aux_loss_scale > 0;
  TORCH_CHECK(std::isfinite(scoring.z_loss_scale) && scoring.z_loss_scale >= 0 &&
                  (scoring.z_loss_scale == 0 || scoring.z_loss),
              kTopKOp, ": z_loss_scale must be finite, >= 0, and 0 without z_loss, got ",
              scoring.z_loss_scale);
  TORCH_CHECK(!expert_bias.defined() ||
                  (expert_bias.dim() == 1 && expert_bias.size(0) == experts &&
                   expert_bias.scalar_type() == at::kFloat &&
                   expert_bias.device() == logits.device() && expert_bias.is_contiguous()),
              kTopKOp, ": expert_bias must be a contiguous float32 [", experts, "] tensor on ",
              logits.device());
  RouterTopK out;
  if (select_topk_backend(logits, scoring) == TopKBackend::kCuda) {
    const c10::cuda::CUDAGuard guard(logits.device());
    kernels::RouterParams p = kernel_params(logits, scoring);
    // Eight small tensors of one call: one allocation (new_empty_packed). The z-loss's is made
    // either way and returned only when asked for.
    std::vector<at::Tensor> t =
        new_empty_packed({{{tokens, scoring.topk}, at::kLong},
                          {{tokens, scoring.topk}, at::kFloat},
                          {{scoring.aux ? experts : 0}, at::kFloat},
                          {{tokens}, at::kFloat},
                          {{experts}, at::kLong},
                          {{}, at::kFloat},
                          {{}, at::kFloat},
                          {{kernels::router_forward_scratch_words(p)}, at::kLong}},
                         logits.device());
    out.indices = std::move(t[0]);
    out.probs = std::move(t[1]);
    out.aux_sums = std::move(t[2]);
    out.lse = std::move(t[3]);
    out.counts = std::move(t[4]);
    out.aux_loss = std::move(t[5]);
    p.expert_bias = expert_bias.defined() ? expert_bias.const_data_ptr<float>() : nullptr;
    p.indices = out.indices.data_ptr<int64_t>();
    p.probs = out.probs.data_ptr<float>();
    if (scoring.aux) p.aux_sums = out.aux_sums.data_ptr<float>();
    p.scratch = t[7].data_ptr<int64_t>();
    p.lse = out.lse.data_ptr<float>();
    if (scoring.z_loss) {
      out.z_loss = std::move(t[6]);
      p.z_loss = out.z_loss.data_ptr<float>();
      p.z_loss_scale = scoring.z_loss_scale;
    }
    p.counts = out.counts.data_ptr<int64_t>();
    // Written also without the loss (its 0): no fill for the caller to make.
    p.aux_loss = out.aux_loss.data_ptr<float>();
    p.aux_loss_scale = scoring.aux_loss_scale;
    kernels::launch_router_forward(p, at::cuda::getCurrentCUDAStream().stream());
    return out;
  }
  const at::Tensor scores = aten_scores(logits, scoring);
  const at::Tensor choice =
      group_limited(expert_bias.defined() ? scores + expert_bias : scores, scoring);
  out.indices = std::get<1>(choice.topk(scoring.topk, 1));
  out.probs = scores.gather(1, out.indices);
  if (scoring.normalize) out.probs = out.probs / (out.probs.sum(1, true) + kernels::kRouterNormEps);
  if (scoring.scale != 1.0) out.probs = out.probs * scoring.scale;
  out.aux_sums = !scoring.aux ? new_empty({0}, logits.options())
                 : scoring.sigmoid
                     ? (scores / (scores.sum(1, true) + kernels::kRouterNormEps)).sum(0)
                     : scores.sum(0);
  out.lse = at::logsumexp(logits, 1);
  out.counts = at::zeros({experts}, logits.options().dtype(at::kLong))
                   .scatter_add(0, out.indices.reshape(-1), at::ones_like(out.indices.reshape(-1)));
  out.aux_loss = want_loss ? at::dot(out.aux_sums, out.counts.to(logits.scalar_type())) *
                                 scoring.aux_loss_scale
                           : at::zeros({}, logits.options());
  if (scoring.z_loss) {
    out.z_loss = scoring.z_loss_scale > 0 ? out.lse.square().sum() * scoring.z_loss_scale
                                          : at::zeros({}, logits.options());
  }
  return out;
}

RouterTopKGrads router_topk_backward(const at::Tensor& logits, const at::Tensor& indices,
                                     const at::Tensor& probs, const at::Tensor& grad_probs,
                                     const at::Tensor& grad_aux, const at::Tensor& grad_lse,
                                     const RouterScoring& scoring, const at::Tensor& counts,
                                     const at::Tensor& grad_aux_loss, const at::Tensor& grad_z_loss,
                                     const RouterTopKLinks& links) {
  check_logits(logits, scoring);
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  // The forward's outputs: indices and probs as router_topk returned them.
  const auto check_saved = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.defined() && t.sizes() == at::IntArrayRef({tokens, scoring.topk}) &&
                    t.scalar_type() == dtype && t.device() == logits.device() && t.is_contiguous(),
                kTopKOp, ": ", name, " must be a contiguous ", dtype, " [", tokens, ", ",
                scoring.topk, "] tensor on ", logits.device(), " (router_topk's), got ",
                t.defined() ? c10::str(t.is_contiguous() ? "a contiguous " : "a non-contiguous ",
                                       t.scalar_type(), " ", t.sizes(), " tensor on ", t.device())
                            : std::string("an undefined tensor"));
  };
  check_saved(indices, at::kLong, "indices");
  check_saved(probs, logits.scalar_type(), "probs");
  auto check_grad = [&](const at::Tensor& g, at::IntArrayRef shape, const char* name) {
    TORCH_CHECK(!g.defined() || g.numel() == 0 ||
                    (g.sizes() == shape && g.is_contiguous() &&
                     g.scalar_type() == logits.scalar_type() && g.device() == logits.device()),
                kTopKOp, ": ", name, " must be a contiguous ", logits.scalar_type(), " ", shape,
                " tensor on ", logits.device());
  };
  check_grad(grad_probs, {tokens, scoring.topk}, "grad_probs");
  check_grad(grad_aux, {experts}, "grad_aux");
  check_grad(grad_lse, {tokens}, "grad_lse");
  const bool loss_grad = grad_aux_loss.defined() && grad_aux_loss.numel() > 0;
  if (loss_grad) {
    check_grad(grad_aux_loss, {}, "grad_aux_loss");
    TORCH_CHECK(scoring.aux && scoring.aux_loss_scale > 0, kTopKOp,
                ": grad_aux_loss needs aux and aux_loss_scale > 0");
    TORCH_CHECK(counts.defined() && counts.sizes() == at::IntArrayRef({experts}) &&
                    counts.scalar_type() == at::kLong && counts.device() == logits.device() &&
                    counts.is_contiguous(),
                kTopKOp, ": grad_aux_loss needs the forward's counts, a contiguous int64 [",
                experts, "] tensor on ", logits.device());
  }
  const bool z_given = grad_z_loss.defined() && grad_z_loss.numel() > 0;
  if (z_given) {
    check_grad(grad_z_loss, {}, "grad_z_loss");
    TORCH_CHECK(scoring.z_loss, kTopKOp, ": grad_z_loss needs z_loss");
  }
  // A zero scale's z-loss is the constant 0: no gradient (0 · an infinite logsumexp is NaN).
  const bool z_grad = z_given && scoring.z_loss_scale > 0;
  const at::Tensor& rows = links.grad_probs_rows;
  const at::Tensor& row_map = links.probs_row_map;
  TORCH_CHECK(rows.defined() == row_map.defined(), kTopKOp,
              ": grad_probs_rows and probs_row_map go together, got only ",
              rows.defined() ? "grad_probs_rows" : "probs_row_map");
  if (rows.defined()) {
    TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == logits.scalar_type() &&
                    rows.device() == logits.device() && rows.is_contiguous(),
                kTopKOp, ": grad_probs_rows must be a contiguous 1-D ", logits.scalar_type(),
                " tensor on ", logits.device(), ", got ", rows.sizes(), " ", rows.scalar_type(),
                " on ", rows.device());
    TORCH_CHECK(row_map.sizes() == at::IntArrayRef({tokens, scoring.topk}) &&
                    row_map.scalar_type() == at::kLong && row_map.device() == logits.device() &&
                    row_map.is_contiguous(),
                kTopKOp, ": probs_row_map must be a contiguous int64 [", tokens, ", ", scoring.topk,
                "] tensor on ", logits.device(), ", got ", row_map.sizes(), " ",
                row_map.scalar_type(), " on ", row_map.device());
  }
  const at::Tensor& split_weight = links.split_weight;
  TORCH_CHECK(!split_weight.defined() ||
                  (split_weight.dim() == 2 && split_weight.size(0) == experts &&
                   split_weight.scalar_type() == at::kBFloat16 &&
                   split_weight.device() == logits.device() && split_weight.is_contiguous()),
              kTopKOp, ": split_weight must be the router's contiguous bf16 [", experts,
              ", hidden] weight on ", logits.device(), ", got ",
              split_weight.defined() ? split_weight.sizes() : at::IntArrayRef{});
  RouterTopKGrads grads;
  if (select_topk_backend(logits, scoring) == TopKBackend::kCuda) {
    const c10::cuda::CUDAGuard guard(logits.device());
    at::Tensor grad_logits = new_empty(logits.sizes(), logits.options());
    kernels::RouterParams p = kernel_params(logits, scoring);
    if (rows.defined()) {
      p.grad_probs_rows = rows.const_data_ptr<float>();
      p.probs_row_map = row_map.const_data_ptr<int64_t>();
    }
    if (split_weight.defined()) {
      const int64_t hidden = split_weight.size(1);
      grads.split.lhs = new_empty({tokens, 2 * experts}, split_weight.options());
      grads.split.rhs = new_empty({2 * experts, hidden}, split_weight.options());
      grads.split.out_dtype = at::kBFloat16;
      p.grad_hilo = grads.split.lhs.data_ptr();
      p.split_weight = split_weight.const_data_ptr();
      p.stacked = grads.split.rhs.data_ptr();
      p.hidden = hidden;
    }
    p.saved_indices = indices.const_data_ptr<int64_t>();
    p.saved_probs = probs.const_data_ptr<float>();
    p.grad_probs = optional_data(grad_probs);
    p.grad_aux = scoring.aux ? optional_data(grad_aux) : nullptr;
    p.grad_lse = optional_data(grad_lse);
    if (loss_grad) {
      p.grad_aux_loss = grad_aux_loss.const_data_ptr<float>();
      p.saved_counts = counts.const_data_ptr<int64_t>();
      p.aux_loss_scale = scoring.aux_loss_scale;
    }
    if (z_grad) {
      p.grad_z_loss = grad_z_loss.const_data_ptr<float>();
      p.z_loss_scale = scoring.z_loss_scale;
    }
    p.grad_logits = grad_logits.data_ptr<float>();
    kernels::launch_router_backward(p, at::cuda::getCurrentCUDAStream().stream());
    grads.grad_logits = std::move(grad_logits);
    return grads;
  }
  const at::Tensor s = aten_scores(logits, scoring);
  at::Tensor ds = at::zeros_like(s);
  at::Tensor ga =
      scoring.aux && grad_aux.defined() && grad_aux.numel() > 0 ? grad_aux : at::Tensor();
  if (loss_grad) {
    const at::Tensor through_loss =
        grad_aux_loss * scoring.aux_loss_scale * counts.to(s.scalar_type());
    ga = ga.defined() ? ga + through_loss : through_loss;
  }
  if (ga.defined()) {
    if (scoring.sigmoid) {
      const at::Tensor sum = s.sum(1, true) + kernels::kRouterNormEps;
      ds = ds + (ga - (ga * (s / sum)).sum(1, true)) / sum;
    } else {
      ds = ds + ga;
    }
  }
  // probs' whole gradient: the argument's and the rows' read through the map.
  at::Tensor gp = grad_probs.defined() && grad_probs.numel() > 0 ? grad_probs : at::Tensor();
  if (rows.defined()) {
    // No rows: every slot's entry is -1 (no gradient); index_select would find no row 0.
    const at::Tensor linked =
        rows.numel() == 0
            ? at::zeros_like(probs)
            : at::where(row_map >= 0,
                        rows.index_select(0, row_map.clamp_min(0).reshape(-1)).view_as(row_map), 0);
    gp = gp.defined() ? gp + linked : linked;
  }
  if (gp.defined()) {
    // probs = scale · p: p's gradient is scale · gp, and scale · gp · p = gp · probs.
    at::Tensor g = scoring.scale != 1.0 ? gp * scoring.scale : gp;
    if (scoring.normalize) {
      const at::Tensor chosen_sum = s.gather(1, indices).sum(1, true) + kernels::kRouterNormEps;
      g = (g - (gp * probs).sum(1, true)) / chosen_sum;
    }
    ds = ds.scatter_add(1, indices, g);
  }
  at::Tensor grad_logits = scoring.sigmoid ? ds * s * (1 - s) : s * (ds - (s * ds).sum(1, true));
  // The logsumexp's gradient, its own and the z-loss's: d(scale · Σ lse²)/d lse = 2 · scale · lse.
  at::Tensor gl = grad_lse.defined() && grad_lse.numel() > 0 ? grad_lse : at::Tensor();
  if (z_grad) {
    const at::Tensor through_z =
        at::logsumexp(logits, 1) * (grad_z_loss * (2 * scoring.z_loss_scale));
    gl = gl.defined() ? gl + through_z : through_z;
  }
  if (gl.defined()) grad_logits = grad_logits + gl.unsqueeze(1) * at::softmax(logits, 1);
  grads.grad_logits = std::move(grad_logits);
  return grads;
}

}  // namespace torchmoe::ops
