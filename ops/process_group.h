#pragma once
// ProcessGroupOptions: the c10d process group a layer's collectives run on and how long each may
// take. A type the user names (MoELayerOptions::expert_parallel, TopKRouterOptions::process_group),
// kept at the lowest layer that takes it, as ops/types.h does for the others. Installed.

#include <torch/arg.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <utility>

namespace torchmoe {

/// A c10d process group (Gloo for CPU tensors, NCCL for CUDA tensors; e.g. from
/// torchmoe::distributed::init_process_group) and the timeout of every collective torchmoe runs
/// on it, so that a peer that failed or never joins surfaces as an error on the others instead of
/// a hang: Gloo work is waited for on the host for at most `timeout`; NCCL work is waited for by
/// the current stream (the host goes on), with `timeout` enforced by NCCL's watchdog.
///
/// Example:
/// ```
/// options.expert_parallel(torchmoe::ProcessGroupOptions(group).timeout(std::chrono::seconds(60)));
/// options.expert_parallel(group);  // the default timeout
/// ```
struct ProcessGroupOptions {
  /* implicit */ ProcessGroupOptions(c10::intrusive_ptr<c10d::ProcessGroup> group)
      : group_(std::move(group)) {}

  TORCH_ARG(c10::intrusive_ptr<c10d::ProcessGroup>, group);
  /// c10d's own default for Gloo and NCCL is 30 min; 10 min still covers a slow first NCCL
  /// communicator setup and fails a stuck job sooner.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
};

}  // namespace torchmoe
