#pragma once
// moe_lm's training text: the byte corpus split into training and validation, and batches of
// windows from it.

#include <torch/types.h>

#include <cstdint>
#include <string>

#include "flags.h"

namespace moe_lm {

struct Corpus {
  torch::Tensor train, valid;  // int64 bytes, on the CPU
};

// The text file or directory `path`, its last tenth held out for validation. Throws
// std::runtime_error when it is missing or too short for windows of `seq` bytes.
Corpus load_corpus(const std::string& path, int64_t seq);

struct Batch {
  torch::Tensor input, target;  // [B, S] int64
};

// Windows starting at `starts`: input bytes [s, s + S), targets shifted by one.
Batch windows(const torch::Tensor& text, const torch::Tensor& starts, int64_t seq,
              const torch::Device& device);

// The batch of (step, micro) depends on the seed and those only, so a resumed run sees the same
// data. With --ep N, rank `rank` takes the rank-th of N equal consecutive parts of it: the ranks
// together train on the batch a single process would.
Batch train_batch(const Corpus& c, const Flags& f, int64_t step, int64_t micro, int64_t rank,
                  const torch::Device& device);

// Rank `rank`'s part of `count` rows from `first` under --ep (all of them in one process).
torch::Tensor rank_part(const torch::Tensor& rows, int64_t first, int64_t count, const Flags& f,
                        int64_t rank);

}  // namespace moe_lm
