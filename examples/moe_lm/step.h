#pragma once
// One micro-batch of training: forward (in FP8 for the experts with --fp8), loss, backward, and
// the gradients' move into the trainer's fp32 sums, run eagerly or replayed from a CUDA graph
// (--cuda-graph).
//
// With --cuda-graph the first kEagerSteps steps run eagerly (they warm up the allocator, cuBLAS
// and the GEMMs' tensor-map tables on the stream that will be captured); then the micro-batch is
// captured once on static input buffers and replayed every later micro-batch: one launch instead
// of the host queueing every kernel. Two graphs when --accum > 1, sharing one memory pool: the
// first micro-batch of a step overwrites the gradient sums, the others add to them.
//
// The step must be free of host synchronisation to be captured: MoELayer keeps its split sizes on
// the device (dropless routing, sm90 grouped GEMMs). Everything that reads values on the host
// (loss, loads, gradient norm, the optimizer's learning rate) stays outside the graph.

#include <ATen/cuda/CUDAGraph.h>
#include <torch/types.h>

#include <array>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torchmoe/fp8/autocast.h>

#include "data.h"
#include "flags.h"
#include "model.h"
#include "trainer.h"

namespace moe_lm {

// What a micro-batch leaves for the host to read. Graphed, these are the graph's own output
// buffers, overwritten by its next replay.
struct MicroBatchResult {
  torch::Tensor loss;      // scalar float32, the LM loss (with --ep, this rank's part's mean)
  torch::Tensor aux_loss;  // scalar float32, the routers' losses (with --ep, this rank's share)
  std::vector<torch::Tensor> tokens_per_expert;  // one [E] per MoE layer
};

torch::Tensor lm_loss(const ModelOutput& out, const torch::Tensor& target);

// An exception's message for a person: a c10::Error carries a backtrace after its first line, which
// is left out.
std::string error_message(const std::exception& e);

class MicroBatchRunner {
 public:
  static constexpr int64_t kEagerSteps = 3;

  MicroBatchRunner(MoETransformer& model, Trainer& trainer, const Flags& f);

  // Runs micro-batch `micro` of a step; `step` counts this run's steps from 0 (graphs are captured
  // at step kEagerSteps).
  MicroBatchResult run(const Batch& batch, int64_t step, int64_t micro);

  // After a step's micro-batches: with --fp8 delayed, the delayed-scaling update of every expert
  // layer (input and weight amaxes, then grad_output's), once per step.
  void finish_step();

 private:
  MicroBatchResult forward_backward(const torch::Tensor& input, const torch::Tensor& target,
                                    bool first);

  MoETransformer& model_;
  Trainer& trainer_;
  const Flags& flags_;
  std::optional<torchmoe::fp8::Recipe> fp8_;  // --fp8's recipe, or none
  // [0]: the first micro-batch of a step, [1]: the others.
  std::array<std::unique_ptr<at::cuda::CUDAGraph>, 2> graphs_;
  std::array<MicroBatchResult, 2> graph_results_;
  torch::Tensor input_, target_;  // the graphs' static inputs
};

}  // namespace moe_lm
