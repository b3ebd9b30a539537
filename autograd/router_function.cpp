#include "torchmoe/autograd/router_function.h"

#include "torchmoe/autograd/once_differentiable.h"
#include "torchmoe/autograd/saved_data.h"
#include "torchmoe/ops/empty.h"

namespace torchmoe::autograd {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor RouterLogitsFunction::forward(AutogradContext* ctx, const at::Tensor& x,
                                         const at::Tensor& weight,
                                         const std::optional<at::Tensor>& bias,
                                         const std::shared_ptr<RouterGradLink>& link) {
  ctx->save_for_backward({x, weight, bias.value_or(at::Tensor())});
  save_link(ctx, link);
  // The backward's bf16 halves (ops::router_logits_backward) can be made by the top-k's launch.
  if (link && ops::router_logits_backward_splits(x, weight)) {
    link->split_weight = weight.contiguous();
  }
  return ops::router_logits(x, weight, bias.value_or(at::Tensor()));
}

variable_list RouterLogitsFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const variable_list saved = ctx->get_saved_variables();
  const at::Tensor grad_logits = grad_outputs[0].contiguous();
  const std::shared_ptr<RouterGradLink> link = saved_link<RouterGradLink>(ctx);
  const bool deferred = link && ctx->needs_input_grad(0);
  const ops::RouterGradX grad_x = !ctx->needs_input_grad(0) ? ops::RouterGradX::kNone
                                  : deferred                ? ops::RouterGradX::kDeferred
                                                            : ops::RouterGradX::kNow;
  // The top-k's split, when the gradient here is the one it split (autograd added nothing to it).
  ops::RouterGradXProduct split;
  if (link) {
    if (link->split_of.defined() && link->split_of.is_same(grad_logits)) split = link->split;
    link->split_of = at::Tensor();
    link->split = {};
    link->split_weight = at::Tensor();
  }
  const at::Tensor bias = saved[2].defined() && ctx->needs_input_grad(2) ? saved[2] : at::Tensor();
  ops::RouterLogitsGrads grads = ops::router_logits_backward(
      grad_logits, saved[0], saved[1], grad_x, ctx->needs_input_grad(1), split, bias);
  if (deferred) link->grad_x_product = std::move(grads.grad_x_product);
  return once_differentiable("RouterLogitsFunction", once,
                             {grads.grad_x, grads.grad_weight, grads.grad_bias, at::Tensor()});
}

variable_list ForkFunction::forward(AutogradContext* ctx, const at::Tensor& x,
                                    const std::shared_ptr<RouterGradLink>& link) {
  save_link(ctx, link);
  // The router's branch has no gradient when its link took it: none, rather than zeros to add.
  ctx->set_materialize_grads(false);
  return {x, x};
}

variable_list ForkFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const at::Tensor& router_branch = grad_outputs[0];
  const at::Tensor& other_branch = grad_outputs[1];
  const std::shared_ptr<RouterGradLink> link = saved_link<RouterGradLink>(ctx);
  // With the router's product to add in place, grad_x must be a tensor nothing else holds.
  const bool product = link && link->grad_x_product.lhs.defined();
  at::Tensor grad_x;
  if (router_branch.defined() && other_branch.defined()) {
    grad_x = router_branch + other_branch;  // a tensor of this node's own
  } else if (other_branch.defined()) {
    const bool own = link && link->other_branch_exclusive && other_branch.is_contiguous();
    grad_x = !product || own ? other_branch : other_branch.clone(at::MemoryFormat::Contiguous);
  } else if (router_branch.defined()) {
    grad_x = product ? router_branch.clone(at::MemoryFormat::Contiguous) : router_branch;
  }
  if (product) {
    grad_x = ops::router_grad_x(link->grad_x_product, grad_x);
    link->grad_x_product = {};  // its tensors freed; other_branch_exclusive kept for a rerun
  }
  return once_differentiable("ForkFunction", once, {grad_x, at::Tensor()});
}

namespace {

constexpr const char* kScoringKey = "scoring";

void save_scoring(AutogradContext* ctx, const ops::RouterScoring& scoring) {
  save_value(ctx, kScoringKey, scoring);
}

const ops::RouterScoring& scoring_of(AutogradContext* ctx) {
  return saved_value<ops::RouterScoring>(ctx, kScoringKey);
}

}  // namespace

variable_list RouterTopKFunction::forward(AutogradContext* ctx, const at::Tensor& logits,
                                          const std::optional<at::Tensor>& expert_bias,
                                          const ops::RouterScoring& scoring,
                                          const std::shared_ptr<RouterGradLink>& link) {
  save_link(ctx, link);
  ops::RouterTopK out = ops::router_topk(logits, expert_bias.value_or(at::Tensor()), scoring);
  save_scoring(ctx, scoring);
  // The counts only for the aux loss's gradient (an output saved: no copy).
  ctx->save_for_backward(
      {logits, out.indices, out.probs, scoring.aux_loss_scale > 0 ? out.counts : at::Tensor()});
  // Without the aux loss its output is a constant 0, as a zero tensor would be.
  if (scoring.aux_loss_scale > 0) {
    ctx->mark_non_differentiable({out.indices, out.counts});
  } else {
    ctx->mark_non_differentiable({out.indices, out.counts, out.aux_loss});
  }
  // Unused outputs (no aux or z loss) get no gradient rather than a tensor of zeros.
  ctx->set_materialize_grads(false);
  // An output cannot be undefined: no z loss is an empty tensor, like no aux sums.
  const at::Tensor z_loss =
      out.z_loss.defined() ? out.z_loss : ops::new_empty({0}, logits.options());
  return {out.indices, out.probs, out.aux_sums, out.lse, out.counts, out.aux_loss, z_loss};
}

variable_list RouterTopKFunction::backward(AutogradContext* ctx, variable_list grad_outputs) {
  const OnceDifferentiable once;
  const variable_list saved = ctx->get_saved_variables();
  auto contiguous = [](const at::Tensor& t) { return t.defined() ? t.contiguous() : t; };
  const ops::RouterScoring& scoring = scoring_of(ctx);
  const std::shared_ptr<RouterGradLink> link = saved_link<RouterGradLink>(ctx);
  ops::RouterTopKLinks links;
  if (link) {
    if (link->probs_grad_rows.defined()) {
      const int64_t tokens = saved[0].size(0);
      links.grad_probs_rows = link->probs_grad_rows.contiguous().view(-1);
      links.probs_row_map = link->probs_row_map.contiguous().view({tokens, scoring.topk});
      link->probs_grad_rows = at::Tensor();
      link->probs_row_map = at::Tensor();
    }
    links.split_weight = link->split_weight;
  }
  ops::RouterTopKGrads grads = ops::router_topk_backward(
      saved[0], saved[1], saved[2], contiguous(grad_outputs[1]), contiguous(grad_outputs[2]),
      contiguous(grad_outputs[3]), scoring, saved[3], contiguous(grad_outputs[5]),
      contiguous(grad_outputs[6]), links);
  if (link && grads.split.lhs.defined()) {
    link->split_of = grads.grad_logits;
    link->split = std::move(grads.split);
  }
  return once_differentiable("RouterTopKFunction", once,
                             {grads.grad_logits, at::Tensor(), at::Tensor(), at::Tensor()});
}

}  // namespace torchmoe::autograd
