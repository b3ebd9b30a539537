// moe_lm's training loop (train_loop.h).

#include "train_loop.h"

#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>
#include <stdexcept>
#include <utility>

#include "checkpoint.h"
#include "evaluate.h"
#include "report.h"
#include "step.h"

namespace moe_lm {
namespace {

namespace profiler = torch::autograd::profiler;

// --trace: a Kineto trace of steps [begin, end), from the run's 10th or as late as fits, written
// by rank 0 only.
class StepTrace {
 public:
  StepTrace(const Flags& f, bool cuda, int64_t start_step, int64_t end_step)
      : path_(f.trace),
        begin_(std::max(start_step, std::min(start_step + 9, end_step - f.trace_steps))),
        end_(std::min(end_step, begin_ + f.trace_steps)),
        config_(torch::profiler::impl::ProfilerState::KINETO),
        activities_{torch::profiler::impl::ActivityType::CPU},
        tracing_(!f.trace.empty() && reporting()) {
    if (cuda) activities_.insert(torch::profiler::impl::ActivityType::CUDA);
  }

  // Before step `step`'s work: starts the trace at its first step.
  void before(int64_t step) {
    if (!tracing_ || step != begin_) return;
    profiler::prepareProfiler(config_, activities_);
    profiler::enableProfiler(config_, activities_);
  }

  // After step `step`'s training: ends the trace at its last step and writes it.
  void after(int64_t step) {
    if (!tracing_ || step + 1 != end_) return;
    profiler::disableProfiler()->save(path_);
    say("  trace of steps {}-{} written to {}\n", begin_ + 1, end_, path_);
  }

 private:
  const std::string path_;
  const int64_t begin_, end_;
  const profiler::ProfilerConfig config_;
  std::set<torch::profiler::impl::ActivityType> activities_;
  const bool tracing_;
};

// What a step's work leaves: the losses and the first micro-batch's loads stay on the device until
// the step's one host read (the gradient norm in trainer.step) has waited for the GPU anyway.
struct StepResult {
  double lr = 0.0;
  double grad_norm = 0.0;
  double ms = 0.0;  // the step's time, to the device's end of its work
  torch::Tensor loss_sum, aux_sum, loads;
};

// Step `step`: its micro-batches, the optimizer step and --expert-bias's update.
StepResult run_step(MicroBatchRunner& runner, MoETransformer& model, Trainer& trainer,
                    const Corpus& corpus, const Flags& f, const TrainContext& context,
                    int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  StepResult r;
  r.lr = learning_rate(f, step);
  for (int64_t micro = 0; micro < f.accum; ++micro) {
    const Batch batch = train_batch(corpus, f, step, micro, context.rank, context.device);
    const MicroBatchResult m = runner.run(batch, step - context.start_step, micro);
    r.loss_sum = micro == 0 ? m.loss.clone() : r.loss_sum + m.loss;
    r.aux_sum = micro == 0 ? m.aux_loss.clone() : r.aux_sum + m.aux_loss;
    if (micro == 0) r.loads = torch::stack(m.tokens_per_expert);  // [layers, E]
  }
  runner.finish_step();
  r.grad_norm = trainer.step(r.lr);
  if (f.model.expert_bias) {
    for (auto& moe : model->moe_layers()) moe->router->update_expert_bias();
  }
  if (context.cuda) torch::cuda::synchronize();
  r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace

double train(MoETransformer& model, Trainer& trainer, const Corpus& corpus, const Flags& f,
             const TrainContext& context, fmt::ostream* csv) {
  MicroBatchRunner runner(model, trainer, f);
  if (f.cuda_graph)
    say("cuda graph: steps from {} replay one captured micro-batch\n",
        context.start_step + MicroBatchRunner::kEagerSteps + 1);
  const int64_t tokens_per_step = f.batch * f.accum * f.model.seq;
  double timed_ms = 0;
  int64_t timed_steps = 0;
  double last_ms = 0;
  StepTrace trace(f, context.cuda, context.start_step, context.end_step);
  for (int64_t step = context.start_step; step < context.end_step; ++step) {
    trace.before(step);
    const StepResult r = run_step(runner, model, trainer, corpus, f, context, step);
    last_ms = r.ms;
    if (step > context.start_step) {  // the first step includes one-time setup
      timed_ms += last_ms;
      ++timed_steps;
    }
    StepFigures s;
    s.step = step + 1;
    s.lr = r.lr;
    s.grad_norm = r.grad_norm;
    s.ms = last_ms;
    // Running average over this run's steps after its first (which includes one-time setup);
    // on the first step, that step's time.
    s.avg_ms = timed_steps ? timed_ms / static_cast<double>(timed_steps) : last_ms;
    // With --ep: the LM loss is the mean of the ranks' (their parts are equal), the router losses
    // the sum of their shares.
    const torch::Tensor sums = rank_sum(torch::stack({r.loss_sum, r.aux_sum}), model);
    s.loss = sums[0].item<double>() / static_cast<double>(f.accum * f.ranks());
    s.aux = sums[1].item<double>() / static_cast<double>(f.accum);
    if (!std::isfinite(s.loss) || !std::isfinite(s.aux)) {
      throw std::runtime_error(
          fmt::format("step {}: the loss is {} and the router's {}: training diverged (lower --lr, "
                      "--weight-decay or the loss coefficients)",
                      step + 1, s.loss, s.aux));
    }
    s.load = load_range(r.loads);
    trace.after(step);
    const bool last = step + 1 == context.end_step;
    if ((f.eval_every && (step + 1) % f.eval_every == 0) || last)
      s.val = evaluate(model, corpus, f, context.rank, context.device);
    s.tok_s = static_cast<double>(tokens_per_step) / (last_ms / 1000.0);
    s.avg_tok_s = static_cast<double>(tokens_per_step) / (s.avg_ms / 1000.0);
    if ((step + 1) % f.log_every == 0 || step == context.start_step || last)
      say_progress(s, f.steps, context.end_step - step - 1);
    if (s.val) say_validation(*s.val);
    if (csv) write_csv_row(*csv, s);
    if (!f.save.empty() && (last || (f.save_every && (step + 1) % f.save_every == 0))) {
      save_checkpoint(context.save, model, trainer, step + 1);
      say("  saved {} (step {})\n",
          context.expert_parallel ? f.save + fmt::format(".rank<r>-of-{}", f.ep) : f.save,
          step + 1);
    }
  }
  return timed_steps ? timed_ms / static_cast<double>(timed_steps) : last_ms;
}

}  // namespace moe_lm
