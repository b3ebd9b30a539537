#pragma once
// Token permutation for MoE layers: group the T·k (token, choice) slots of a top-k routing by
// expert, copy token rows into that order, and sum them back.
//
// Kernel layer: raw pointers, sizes and a stream. Validation, allocation and dispatch:
// ops/token_permutation.cpp.
//
//   indices [T, k]   expert of each slot s = t·k + j; -1 = dropped (capacity), else in [0, E)
//   row_map [T, k]   permuted row of each slot, -1 when dropped
//   sorted_slots [N] slot of each permuted row (row_map's inverse); N = kept slots, or more rows
//                    (padding) whose entry is -1: no slot maps to them
//
//   permute     permuted[r] = tokens[sorted_slots[r] / k]  (· probs[sorted_slots[r]])
//   unpermute   out[t] = Σ_j probs[t, j] · permuted[row_map[t, j]]
//
// Rows are ordered by expert and, within an expert, by slot (a stable sort), so the result is
// deterministic and matches the CPU reference exactly. One warp writes each output element, so no
// kernel needs atomics: permute reads each token row once and writes its permuted rows (through
// row_map), unpermute sums per token (through row_map), unpermute_backward per permuted row
// (through sorted_slots).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

struct RoutingMapParams {
  int64_t tokens = 0;   // T
  int64_t topk = 0;     // k
  int64_t experts = 0;  // E
  const void* indices = nullptr;
  bool indices_int32 = false;  // int32 indices, else int64

  int64_t* row_map = nullptr;       // [T·k]
  int64_t* sorted_slots = nullptr;  // [T·k]: permuted rows first, then the dropped slots
  int64_t* row_tokens = nullptr;    // [T·k]: sorted_slots' tokens (slot / k), in the same order
  const float* probs = nullptr;     // [T·k] or null
  float* row_probs = nullptr;       // [T·k] with probs: sorted_slots' probabilities, in order
  // [E + 2] int64: tokens per expert, then the dropped count, then the count of indices outside
  // [-1, E) (an error the caller reports after reading the counts back).
  int64_t* counts = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;  // at least routing_map_workspace_bytes(T·k, E)
};

// The counting sort keeps a position per expert and per warp in 32 KB of shared memory.
constexpr int64_t kRoutingMapMaxExperts = 4094;
size_t routing_map_workspace_bytes(int64_t slots, int64_t experts);
void launch_routing_map(const RoutingMapParams& params, cudaStream_t stream);

struct PermuteParams {
  int64_t tokens = 0;  // T
  int64_t topk = 0;    // k
  int64_t rows = 0;    // N, permuted rows
  int64_t hidden = 0;  // H
  ScalarType data_type = ScalarType::kFloat32;
  ScalarType prob_type = ScalarType::kFloat32;
  const int64_t* row_map = nullptr;       // [T, k]   (permute, unpermute)
  const int64_t* sorted_slots = nullptr;  // [N]      (permute, unpermute_backward)
  const void* probs = nullptr;            // [T, k] or null (weight 1)
  const void* input = nullptr;
  void* output = nullptr;
  // unpermute_backward only: the forward's permuted input and the probability gradient [T, k]
  // (its dropped slots are left untouched).
  const void* permuted = nullptr;
  void* grad_probs = nullptr;
};

// output[r] = input[sorted_slots[r] / k] (· probs[sorted_slots[r]]), r < N; zeros where
// sorted_slots[r] is -1. Written as output[row_map[t, j]] = input[t] (· probs[t, j]): row_map and
// sorted_slots must be each other's inverse.
void launch_permute(const PermuteParams& params, cudaStream_t stream);
// output[t] = Σ_j probs[t,j] · input[row_map[t,j]] over kept slots, summed in fp32 (0 if none).
void launch_unpermute(const PermuteParams& params, cudaStream_t stream);
// The gradient of unpermute with probs, input = grad_out [T, H]; for each permuted row r with
// slot s = sorted_slots[r], token t = s / k:
//   output[r] = probs[s] · grad_out[t]                 (grad of permuted)
//   grad_probs[s] = <grad_out[t], permuted[r]>
// and output[r] = 0 for a row whose slot is -1.
void launch_unpermute_backward(const PermuteParams& params, cudaStream_t stream);

}  // namespace torchmoe::kernels
