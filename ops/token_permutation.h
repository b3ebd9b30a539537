#pragma once
// Token permutation for MoE layers: the routing map from top-k expert indices, and the row
// movements between token order [T, H] and expert-grouped order [N, H]. Semantics and layout:
// kernels/token_permutation.h. CPU: plain ATen (the reference); CUDA: kernels/token_permutation.cu.

#include <ATen/core/Tensor.h>

#include "torchmoe/ops/types.h"

#include <cstdint>
#include <vector>

namespace torchmoe::ops {

struct RoutingMap {
  at::Tensor row_map;                // [T, k] int64: permuted row of each slot, -1 when dropped
  at::Tensor sorted_slots;           // [N] int64: slot t·k + j of each permuted row
  at::Tensor row_tokens;             // [N] int64: token t of each permuted row (slot / k)
  at::Tensor row_probs;              // [N] float32: probs' value of each permuted row, or undefined
                                     // (no probs given; received_routing_map makes neither)
  at::Tensor m_splits;               // [E] int64 on the indices' device: rows per expert
  std::vector<int64_t> host_splits;  // the same on the host (not on CUDA with kDropless)
  int64_t num_rows = 0;              // N = Σ m_splits
};

// What make_routing_map may assume about its indices.
enum class IndexTrust {
  // Any caller's indices: checked to be in [0, E) or -1. On CUDA the split sizes are copied to
  // the host (one sync), which is also how N is known.
  kChecked,
  // A router's own top-k, with no capacity: every index is in [0, E), so N = T·k without looking.
  // On CUDA nothing is copied to the host (CUDA-graph safe) and host_splits stays empty; an index
  // outside [0, E) is not detected. Only for indices torchmoe made itself.
  kDropless,
};

// The map's split sizes as SplitSizes, with every copy the map holds (no host copy on CUDA under
// kDropless), so that no GEMM backend copies them again.
SplitSizes split_sizes(const RoutingMap& map);

// indices [T, k] int32/int64 with values in [0, E) or -1 (dropped). Rows are grouped by expert,
// in slot order within an expert. probs: none, or [T, k] float32 on the indices' device, whose
// value of each permuted row the map's pass writes into row_probs (the routing probabilities in
// row order, without a launch of their own).
RoutingMap make_routing_map(const at::Tensor& indices, int64_t num_experts,
                            IndexTrust trust = IndexTrust::kChecked, const at::Tensor& probs = {});

// tokens [T, H] -> [N, H]: row r = tokens[sorted_slots[r] / k] (· probs.flat[sorted_slots[r]]
// when given, probs [T, k]); zeros where sorted_slots[r] is -1. row_map [T, k] and sorted_slots
// [N] must be the two directions of one permutation (make_routing_map's, or a row_map meeting
// the contract below with its slots_of_rows): the CUDA kernel reads each token row once and writes
// the rows row_map names (a row sorted_slots gives a slot that row_map does not name back is left
// unwritten there).
at::Tensor permute_rows(const at::Tensor& tokens, const at::Tensor& row_map,
                        const at::Tensor& sorted_slots, const at::Tensor& probs);

// The contract of a row_map [T, k] over num_rows permuted rows: every entry is -1 (a dropped slot)
// or a row in [0, num_rows), and no row is named twice; rows no entry names (padding) are
// allowed. Checks it; on CUDA this costs one device-to-host copy. `op` names the caller.
void check_row_map(const char* op, const at::Tensor& row_map, int64_t num_rows);

// row_map's inverse: the slot of each of the num_rows permuted rows, -1 for a row no slot names
// (no host synchronisation; row_map must meet the contract above).
at::Tensor slots_of_rows(const at::Tensor& row_map, int64_t num_rows);

// The token each permuted row copies: sorted_slots / topk, floored, so that a padding row's -1
// stays -1 (which the row gathers read as a zero row).
at::Tensor tokens_of_rows(const at::Tensor& sorted_slots, int64_t topk);

// permuted [N, H] -> [T, H]: out[t] = Σ_j probs[t, j] · permuted[row_map[t, j]] (weight 1 without
// probs), summed in fp32 (fp64 for fp64 data) with one rounding. Entries -1 are dropped slots. The
// CUDA kernels read any entry outside [0, N) as dropped (and unpermute_rows_backward any slot
// outside [0, T·k) as padding) rather than as an address; check_row_map refuses them at the cost
// of a host sync.
at::Tensor unpermute_rows(const at::Tensor& permuted, const at::Tensor& row_map,
                          const at::Tensor& probs);

struct UnpermuteGrads {
  at::Tensor grad_permuted;  // [N, H]
  at::Tensor grad_probs;     // [T, k] in probs' dtype
};

// Gradients of unpermute_rows with probs [T, k] for grad_out [T, H]; sorted_slots as from
// make_routing_map or slots_of_rows.
UnpermuteGrads unpermute_rows_backward(const at::Tensor& grad_out, const at::Tensor& permuted,
                                       const at::Tensor& sorted_slots, const at::Tensor& probs);

}  // namespace torchmoe::ops
