#pragma once
// moe_lm's training loop: each step's micro-batches (step.h) and optimizer step (trainer.h), then
// its progress line, validation, CSV row and checkpoint; --trace records a few of the steps.

#include <fmt/os.h>
#include <torch/types.h>

#include <cstdint>
#include <string>

#include "data.h"
#include "flags.h"
#include "model.h"
#include "trainer.h"

namespace moe_lm {

// What the loop needs of the run besides its flags.
struct TrainContext {
  torch::Device device = torch::kCPU;
  bool cuda = false;
  int64_t rank = 0;              // with --ep this process's rank, else 0
  bool expert_parallel = false;  // --ep: every rank saves its own file
  std::string save;              // the file this process saves (--save, with --ep its rank's)
  int64_t start_step = 0;        // the loop trains steps [start_step, end_step)
  int64_t end_step = 0;
};

// Trains the steps of `context`, writing their rows to `csv` when it is not null. Returns the
// step time (ms) --profile-moe compares with: the mean over the steps after the first (which
// includes one-time setup), or the first step's when there is no other.
double train(MoETransformer& model, Trainer& trainer, const Corpus& corpus, const Flags& f,
             const TrainContext& context, fmt::ostream* csv);

}  // namespace moe_lm
