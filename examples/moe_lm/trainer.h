#pragma once
// moe_lm's mixed-precision trainer and its learning-rate schedule.
//
// On CUDA the model computes in bf16 with fp32 master weights: the expert weights' gradients go
// straight into fp32 main-grad buffers (GroupedLinear's fused accumulation), the other parameters'
// bf16 gradients are added into fp32 buffers after each micro-batch, and torchmoe's FusedAdamW
// clips and updates the fp32 masters and writes the bf16 parameters in the same pass.
//
// With expert parallelism (--ep) the dense parameters are trained data-parallel: their gradient
// sums are summed over the ranks in one all-reduce before the step (they sit together at the
// start of the flat buffer), while each rank's expert shard keeps its own; the clipping norm is
// the whole model's (FusedAdamW's sharded clip_grad_norm).

#include <torch/serialize/archive.h>
#include <torchmoe/optim/fused_adamw.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "flags.h"
#include "model.h"

namespace moe_lm {

struct Slot {
  torch::Tensor param;      // what the model computes with (bf16 or fp32)
  torch::Tensor master;     // fp32 copy AdamW updates (the parameter itself when fp32)
  torch::Tensor main_grad;  // fp32 gradient sum over micro-batches (a view of one flat buffer)
  // An expert weight: GroupedLinear writes main_grad itself, and with --ep it is this rank's
  // shard.
  bool expert = false;
};

class Trainer {
 public:
  Trainer(MoETransformer& model, const Flags& f);

  // After each micro-batch's backward: move the non-fused gradients into the fp32 sums, which the
  // first micro-batch of a step overwrites (the experts' fused sums follow the model's
  // is_first_microbatch), so nothing clears them between steps.
  void accumulate(bool first_microbatch);

  // Clips and steps AdamW on the masters (which writes the parameters). Returns the gradient norm
  // before clipping (with --ep the whole model's, the same on every rank).
  double step(double lr);

  // The fp32 masters stand for the parameters (which are their casts), so a checkpoint loads
  // into any device and compute dtype. Buffers (router expert bias and load) go as they are.
  void save(torch::serialize::OutputArchive& archive) const;
  void load(torch::serialize::InputArchive& archive);

  // Loads the checkpoints of the ranks of an expert-parallel run (ranks[r]: rank r's) into this
  // trainer of the single-process model: the expert weights and their AdamW moments concatenated
  // in rank order, which is the global expert order; everything else (replicated) from rank 0.
  void load_merged(std::vector<torch::serialize::InputArchive>& ranks);

 private:
  // AdamW over `params`, one per slot in slot order (the masters, or stand-ins for them): weight
  // decay on the matrices only.
  std::unique_ptr<torchmoe::optim::FusedAdamW> make_optimizer(
      const std::vector<torch::Tensor>& params) const;

  MoETransformer& model_;
  const Flags& flags_;
  std::vector<Slot> slots_;
  torch::Tensor dense_grads_;  // the front of the flat buffer: the non-expert gradient sums
  std::unique_ptr<torchmoe::optim::FusedAdamW> optimizer_;
};

// The learning rate of optimizer step `step` (from 0): linear warmup over --warmup steps, then
// cosine decay to --min-lr-ratio · --lr at --steps.
double learning_rate(const Flags& f, int64_t step);

}  // namespace moe_lm
