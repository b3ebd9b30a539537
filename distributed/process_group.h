#pragma once
// The ground floor of communication: ProcessGroupOptions (the c10d group every collective of
// torchmoe runs on, and its timeout: a type the user names in MoELayerOptions::expert_parallel and
// TopKRouterOptions::process_group), and init_process_group, the c10d process group of a job
// launched by torchrun (or anything that sets the same environment), made from C++ with PyTorch's
// own distributed engine: a TCPStore for the rendezvous, ProcessGroupGloo for CPU tensors and
// ProcessGroupNCCL for CUDA tensors. It is what torch.distributed.init_process_group(
// "cpu:gloo,cuda:nccl") gives a Python trainer. The collectives are in collectives.h.
//
// Example (launched by `torchrun --no-python --nproc-per-node=4 ./trainer`):
// ```
// auto group = torchmoe::distributed::init_process_group(torch::kCUDA);
// options.expert_parallel(group);  // MoELayerOptions: experts sharded over the 4 ranks
// ```

#include <c10/core/Device.h>
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

namespace torchmoe::distributed {

/// Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and, for CUDA, LOCAL_RANK from the
/// environment; connects to the TCPStore at MASTER_ADDR:MASTER_PORT (rank 0 serves it and waits
/// for all WORLD_SIZE ranks); and returns a group of WORLD_SIZE ranks with a Gloo backend for CPU
/// tensors and, when device is CUDA, an NCCL backend for CUDA tensors on GPU device.index() (or
/// LOCAL_RANK without an index), made the current device. Gloo takes its network interface from
/// GLOO_SOCKET_IFNAME when set, as in Python. `timeout` bounds the rendezvous and is the
/// backends' collective timeout.
c10::intrusive_ptr<c10d::ProcessGroup> init_process_group(
    c10::Device device, std::chrono::milliseconds timeout = std::chrono::minutes(10));

}  // namespace torchmoe::distributed
