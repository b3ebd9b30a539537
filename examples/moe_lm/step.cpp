// A micro-batch's forward, backward and gradient move, eager or replayed from a CUDA graph.

#include "step.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <fmt/core.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <variant>

namespace moe_lm {

torch::Tensor lm_loss(const ModelOutput& out, const torch::Tensor& target) {
  return at::cross_entropy_loss(out.logits.reshape({-1, out.logits.size(-1)}), target.reshape(-1));
}

std::string error_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e))
    return c10_error->what_without_backtrace();
  return e.what();
}

namespace fp8 = torchmoe::fp8;

// --fp8's recipe: TransformerEngine's defaults (delayed: amax history 1024, the max over it).
std::optional<fp8::Recipe> fp8_recipe(const std::string& name) {
  if (name == "delayed") return fp8::Recipe(fp8::DelayedScaling());
  if (name == "current") return fp8::Recipe(fp8::CurrentScaling());
  if (name == "block") return fp8::Recipe(fp8::BlockScaling());
  return std::nullopt;
}

MicroBatchRunner::MicroBatchRunner(MoETransformer& model, Trainer& trainer, const Flags& f)
    : model_(model), trainer_(trainer), flags_(f), fp8_(fp8_recipe(f.fp8)) {
  // Capture needs a stream of its own: the legacy default stream cannot be captured.
  if (flags_.cuda_graph && c10::cuda::getCurrentCUDAStream() == c10::cuda::getDefaultCUDAStream())
    throw std::logic_error("--cuda-graph: the training loop must run on a side stream");
}

MicroBatchResult MicroBatchRunner::forward_backward(const torch::Tensor& input,
                                                    const torch::Tensor& target, bool first) {
  ModelOutput out;
  {
    // The experts run their GEMMs in FP8 inside the guard; backward follows the recipe each layer
    // captured at forward.
    const fp8::Autocast guard(fp8_.value_or(fp8::Recipe(fp8::CurrentScaling())), fp8_.has_value());
    out = model_(input, first);
  }
  const torch::Tensor loss = lm_loss(out, target);
  // With --ep each rank backpropagates its share of the global batch's loss: its part's mean LM
  // loss / N (the batch's mean is the mean of N equal parts' means), and its router losses, which
  // are its share already (MoEOutput). The trainer sums the dense gradients over the ranks.
  ((loss / static_cast<double>(flags_.ranks()) + out.aux_loss) / static_cast<double>(flags_.accum))
      .backward();
  trainer_.accumulate(first);
  return {loss.detach(), out.aux_loss.detach(), out.tokens_per_expert};
}

MicroBatchResult MicroBatchRunner::run(const Batch& batch, int64_t step, int64_t micro) {
  const bool first = micro == 0;
  if (!flags_.cuda_graph || step < kEagerSteps)
    return forward_backward(batch.input, batch.target, first);
  const int index = first ? 0 : 1;
  if (!input_.defined()) {
    input_ = torch::empty_like(batch.input);
    target_ = torch::empty_like(batch.target);
  }
  input_.copy_(batch.input);
  target_.copy_(batch.target);
  if (!graphs_[index]) {
    auto graph = std::make_unique<at::cuda::CUDAGraph>();
    try {
      // The second graph allocates from the first one's pool: they never run at the same time,
      // and their outputs stay referenced (graph_results_), so neither overwrites the other's.
      if (graphs_[0]) {
        graph->capture_begin(graphs_[0]->pool());
      } else {
        graph->capture_begin();
      }
      graph_results_[index] = forward_backward(input_, target_, first);
      graph->capture_end();
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format(
          "--cuda-graph: capturing the training step failed (it must not synchronise with the "
          "host: MoELayer keeps its split sizes on the device only with sm_90 grouped GEMMs, "
          "TORCHMOE_GROUPED_GEMM_BACKEND=auto|sm90): {}",
          error_message(e)));
    }
    graphs_[index] = std::move(graph);
  }
  // Capturing recorded the work without running it; every micro-batch from here is a replay.
  graphs_[index]->replay();
  return graph_results_[index];
}

void MicroBatchRunner::finish_step() {
  if (!fp8_) return;
  if (const auto* delayed = std::get_if<fp8::DelayedScaling>(&*fp8_)) {
    // No amax group, also with --ep: the ranks hold different experts, not replicas of the same
    // ones, so each expert's scales follow its own amaxes (reduce_amax is for data-parallel
    // replicas of a layer: docs/fp8.md, "Across ranks").
    fp8::update_delayed_scaling(*model_, *delayed, fp8::Pass::kForward);
    fp8::update_delayed_scaling(*model_, *delayed, fp8::Pass::kBackward);
  }
}

}  // namespace moe_lm
