#pragma once
// moe_lm's runs of the model beside the training steps: the validation loss, text generation
// (--generate) and --profile-moe's timings.

#include <torch/types.h>

#include <cstdint>

#include "data.h"
#include "flags.h"
#include "model.h"
#include "trainer.h"

namespace moe_lm {

// The sum over the ranks of an --ep run of a value each has (the value itself without --ep).
// Every rank must call it.
torch::Tensor rank_sum(const torch::Tensor& value, const MoETransformer& model);

// The mean LM loss over --eval-batches fixed batches of the validation text. With --ep every rank
// evaluates its part of each batch (the MoE layers need all ranks), and the mean of the parts'
// means is the batch's.
double evaluate(MoETransformer& model, const Corpus& c, const Flags& f, int64_t rank,
                const torch::Device& device);

// Samples --generate bytes after --prompt (greedy at --temperature 0) and prints the text.
void generate(MoETransformer& model, const Flags& f, const torch::Device& device);

// Times forward+backward of one MoE layer alone at the training shape (unit-RMS random input)
// and reports layers · that time as a share of the measured step time `step_ms`, then the
// optimizer step's share. Leaves the gradients and the optimizer state changed: nothing is trained
// after it.
void profile_moe(MoETransformer& model, Trainer& trainer, const Flags& f,
                 const torch::Device& device, torch::Dtype dtype, double step_ms);

}  // namespace moe_lm
