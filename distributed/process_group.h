#pragma once
// init_process_group: the c10d process group of a job launched by torchrun (or anything that sets
// the same environment), made from C++ with PyTorch's own distributed engine: a TCPStore for the
// rendezvous, ProcessGroupGloo for CPU tensors and ProcessGroupNCCL for CUDA tensors. It is what
// torch.distributed.init_process_group("cpu:gloo,cuda:nccl") gives a Python trainer.
//
// Example (launched by `torchrun --no-python --nproc-per-node=4 ./trainer`):
// ```
// auto group = torchmoe::distributed::init_process_group(torch::kCUDA);
// options.expert_parallel(group);  // MoELayerOptions: experts sharded over the 4 ranks
// ```

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>

#include "torchmoe/ops/process_group.h"

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

/// In place: tensor (contiguous, on a device the group has a backend for) = its sum over the
/// group's ranks, waited for at most the group's timeout (a peer's failure or the timeout is an
/// error naming this rank). For what a trainer reduces itself, e.g. the replicated parameters'
/// gradients of an expert-parallel model. Every rank of the group must call it.
void all_reduce_sum_(at::Tensor& tensor, const ProcessGroupOptions& group);

}  // namespace torchmoe::distributed
