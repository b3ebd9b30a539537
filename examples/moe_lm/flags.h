#pragma once
// The command-line flags of moe_lm: their values (Flags) and parse_flags, which reads and checks
// them and prints --help.

#include <cstdint>
#include <optional>
#include <string>

#include "model.h"

namespace moe_lm {

struct Flags {
  ModelConfig model;
  std::string data = "/usr/share/common-licenses";
  std::string device = "auto";
  std::string dtype = "auto";
  int64_t steps = 300;
  int64_t stop_at = 0;
  int64_t batch = 16;
  int64_t accum = 1;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;
  int64_t warmup = 30;
  double weight_decay = 0.1;
  double clip = 1.0;
  uint64_t seed = 1234;
  int64_t log_every = 10;
  int64_t eval_every = 100;
  int64_t eval_batches = 8;
  std::string csv;
  std::string save;
  int64_t save_every = 0;
  std::string resume;
  int64_t generate = 0;
  std::string prompt = "The ";
  double temperature = 0.8;
  int64_t profile_moe = 0;
  bool cuda_graph = false;
  std::string trace;
  int64_t trace_steps = 5;
  int64_t ep = 0;   // expert-parallel ranks; 0: one process
  std::string fp8;  // "", delayed, current or block: the experts' FP8 recipe
  std::string merge_checkpoint;

  // The processes a training run spans: --ep, or 1.
  int64_t ranks() const { return ep ? ep : 1; }
};

// Returns nullopt after --help; throws std::invalid_argument for bad flags.
std::optional<Flags> parse_flags(int argc, char** argv);

}  // namespace moe_lm
