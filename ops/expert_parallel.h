#pragma once
// Expert parallelism's (EP) plans over a c10d process group: the split-size exchange (the one host
// synchronisation of a dropless EP layer), the received rows' routing map, and capacity mode's
// fixed layout. The communication itself is distributed/collectives.h's.

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <vector>

#include "torchmoe/distributed/process_group.h"
#include "torchmoe/ops/token_permutation.h"

namespace torchmoe::ops {

struct ExpertParallelSplits {
  std::vector<int64_t> send;  // [ep]: rows this rank sends to each rank
  std::vector<int64_t> recv;  // [ep]: rows this rank receives from each rank
  // [ep · L], rank-major: rows rank r sends to this rank's local expert l (L = E / ep).
  std::vector<int64_t> recv_per_expert;
};

// rows_per_expert [E] int32/int64 on the data's device (E = ep · L; rank r holds the global
// experts [r·L, (r+1)·L)): the rows this rank sends to each global expert. Exchanged with an
// all-to-all of L counts and a negative-count flag per rank, then copied to the host: on CUDA that
// copy is the host sync the variable-size exchange needs (the receive buffer's size and c10d's
// split lists live there). A negative count on any rank is an error on every rank (each block
// carries its sender's verdict).
ExpertParallelSplits exchange_split_sizes(const at::Tensor& rows_per_expert,
                                          const ProcessGroupOptions& group);

// The routing map that groups the rows an all-to-all delivered (blocks by source rank, each block
// grouped by local expert: chunk (r, l) holds recv_per_expert[r·L + l] rows) by local expert,
// sources in rank order within an expert; top-k 1. Built on the host from the exchanged counts
// and copied to `device` without a sync.
RoutingMap received_routing_map(c10::IntArrayRef recv_per_expert, int64_t num_local_experts,
                                at::Device device);

// The fixed-size layout of capacity mode: each expert's rows padded to `capacity`.
struct CapacityMap {
  at::Tensor row_map;       // [T, k] int64: padded row e·capacity + position; -1 where dropped
  at::Tensor sorted_slots;  // [E·capacity] int64: the slot of each padded row, -1 for padding
};

// indices [T, k] int32/int64 in [0, E) or -1 (dropped; so is any other index outside [0, E),
// which cannot be refused without a host sync). A slot's position within its expert follows slot
// order (as in permute_tokens); slots past `capacity` are dropped too. Computed on the device (on
// CUDA from the routing map's stable sort by expert, on the CPU from a cumulative sum over a
// [T·k, E] one-hot map): no host sync, so it can be captured in a CUDA graph.
CapacityMap make_capacity_map(const at::Tensor& indices, int64_t num_experts, int64_t capacity);

}  // namespace torchmoe::ops
