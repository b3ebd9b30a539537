#pragma once
// The checked collectives every part of torchmoe communicates through (the ground floor: modules,
// autograd, ops, fp8/ and optim/ call down into it; it calls only c10d). Each checks the group
// (defined, a positive timeout, a backend for the data's device) and its arguments, and waits for
// the work with the group's timeout: a peer that failed, exited or never joined surfaces as an
// error naming the op and this rank, never as a hang. Installed: a trainer sums what it reduces
// itself (the replicated parameters' gradients) with all_reduce_sum_.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <cstdint>

#include "torchmoe/distributed/process_group.h"

namespace torchmoe::distributed {

/// The group of `group`, checked for an op on `data`: defined, with a positive timeout and a
/// backend for data's device (Gloo for CPU, NCCL for CUDA). `op` names the caller in errors.
c10d::ProcessGroup& checked_group(const char* op, const ProcessGroupOptions& group,
                                  const at::Tensor& data);

/// The variable-split all-to-all of rows [N, ...] (N = Σ send_splits, one entry per rank; this
/// rank's own block as long sent as received) -> [Σ recv_splits, ...]. `op` names the caller.
at::Tensor all_to_all_rows(const at::Tensor& rows, c10::IntArrayRef send_splits,
                           c10::IntArrayRef recv_splits, const ProcessGroupOptions& group,
                           const char* op = "all_to_all_rows");

/// In place, over the group's ranks: the sum (the max) of a contiguous tensor.
void all_reduce_sum_(at::Tensor& tensor, const ProcessGroupOptions& group);
void all_reduce_max_(at::Tensor& tensor, const ProcessGroupOptions& group);

/// Errors on every rank, naming `what` and its range, unless `value` is the same on all of them
/// (one all-reduce and a host sync; refused during a CUDA graph capture).
void check_same_across_ranks(const char* op, const char* what, int64_t value,
                             const c10::Device& device, const ProcessGroupOptions& group);

}  // namespace torchmoe::distributed
