#include "torchmoe/distributed/collectives.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/cuda/CUDAGraphsUtils.cuh>

#include <algorithm>
#include <exception>
#include <numeric>
#include <vector>

namespace torchmoe::distributed {
namespace {

// Waits for the collective. Gloo (CPU data): the host waits at most the group's timeout. NCCL
// (CUDA data): the current stream waits for the collective and the host goes on queueing work;
// the group's timeout, passed in the op's options, is what NCCL's watchdog enforces. (A timed
// wait on NCCL work blocks the host until the collective completes: measured on the H100, it
// drained the GPU's queue at every exchange, 2 ms of host time per all-to-all in backward.) c10d
// reports a peer that exited or a collective that timed out as an exception from wait(); it is
// rethrown with the op and this rank named, so that each surviving rank stops with an error that
// says where it was.
void wait(const char* op, c10d::ProcessGroup& pg, const c10::intrusive_ptr<c10d::Work>& work,
          const ProcessGroupOptions& group, const at::Tensor& data) {
  bool completed = false;
  try {
    completed = data.is_cuda() ? work->wait() : work->wait(group.timeout());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, op, ": the collective failed on rank ", pg.getRank(), " of ", pg.getSize(),
                " (a peer failed, exited, or did not join within ", group.timeout().count(),
                " ms): ", e.what());
  }
  TORCH_CHECK(completed, op, ": the collective was aborted on rank ", pg.getRank(), " of ",
              pg.getSize());
}

// In place: tensor = `reduce` over the group's ranks; the all-reduces below name their op.
void all_reduce_in_place(const char* op, at::Tensor& tensor, const ProcessGroupOptions& group,
                         c10d::ReduceOp::RedOpType reduce) {
  TORCH_CHECK(tensor.defined() && tensor.is_contiguous(), op,
              ": tensor must be a defined contiguous tensor");
  c10d::ProcessGroup& pg = checked_group(op, group, tensor);
  std::vector<at::Tensor> tensors{tensor};
  c10d::AllreduceOptions options;
  options.reduceOp = reduce;
  options.timeout = group.timeout();
  wait(op, pg, pg.allreduce(tensors, options), group, tensor);
}

}  // namespace

c10d::ProcessGroup& checked_group(const char* op, const ProcessGroupOptions& group,
                                  const at::Tensor& data) {
  TORCH_CHECK(group.group(), op, ": the process group must be defined, got a null group");
  // c10d reads a zero timeout as "no timeout": a peer that never comes would hang the others.
  TORCH_CHECK(group.timeout().count() > 0, op, ": the group's timeout must be positive, got ",
              group.timeout().count(), " ms");
  c10d::ProcessGroup& pg = *group.group();
  const std::vector<c10::Device> devices = pg.getDeviceTypes();
  const bool has_backend = std::any_of(devices.begin(), devices.end(), [&](const c10::Device& d) {
    return d.type() == data.device().type();
  });
  TORCH_CHECK(has_backend, op, ": the process group must have a backend for the data's device ",
              data.device(), " (Gloo for CPU, NCCL for CUDA), got one for ", devices);
  return pg;
}

at::Tensor all_to_all_rows(const at::Tensor& rows, c10::IntArrayRef send_splits,
                           c10::IntArrayRef recv_splits, const ProcessGroupOptions& group,
                           const char* op) {
  const char* const kOp = op;
  TORCH_CHECK(rows.defined() && rows.dim() >= 1, kOp, ": rows must be [N, ...], got ",
              rows.defined() ? rows.sizes() : at::IntArrayRef{});
  c10d::ProcessGroup& pg = checked_group(kOp, group, rows);
  const auto ep = static_cast<size_t>(pg.getSize());
  TORCH_CHECK(send_splits.size() == ep && recv_splits.size() == ep, kOp,
              ": send_splits and recv_splits must have one entry per rank (", ep, "), got ",
              send_splits.size(), " and ", recv_splits.size());
  const auto non_negative = [](c10::IntArrayRef s) {
    return std::all_of(s.begin(), s.end(), [](int64_t v) { return v >= 0; });
  };
  TORCH_CHECK(non_negative(send_splits) && non_negative(recv_splits), kOp,
              ": split sizes must be >= 0, got send ", send_splits, " and recv ", recv_splits);
  const int64_t sent = std::accumulate(send_splits.begin(), send_splits.end(), 0L);
  TORCH_CHECK(sent == rows.size(0), kOp, ": send_splits must sum to rows.size(0) = ", rows.size(0),
              ", got ", send_splits, " (sum ", sent, ")");
  // Gloo requires it (its message would come from a worker thread while the peers wait), and the
  // rows this rank keeps cannot differ between sending and receiving.
  const int64_t rank = pg.getRank();
  TORCH_CHECK(send_splits[rank] == recv_splits[rank], kOp, ": this rank's own block must be as ",
              "long sent as received, got send_splits[", rank, "] = ", send_splits[rank],
              " and recv_splits[", rank, "] = ", recv_splits[rank]);
  std::vector<int64_t> out_shape = rows.sizes().vec();
  out_shape[0] = std::accumulate(recv_splits.begin(), recv_splits.end(), 0L);
  at::Tensor input = rows.contiguous();
  at::Tensor output = at::empty(out_shape, rows.options());
  std::vector<int64_t> send = send_splits.vec(), recv = recv_splits.vec();
  c10d::AllToAllOptions options;
  options.timeout = group.timeout();
  wait(kOp, pg, pg.alltoall_base(output, input, recv, send, options), group, input);
  return output;
}

void all_reduce_sum_(at::Tensor& tensor, const ProcessGroupOptions& group) {
  all_reduce_in_place("all_reduce_sum_", tensor, group, c10d::ReduceOp::SUM);
}

void all_reduce_max_(at::Tensor& tensor, const ProcessGroupOptions& group) {
  all_reduce_in_place("all_reduce_max_", tensor, group, c10d::ReduceOp::MAX);
}

void check_same_across_ranks(const char* op, const char* what, int64_t value,
                             const c10::Device& device, const ProcessGroupOptions& group) {
  TORCH_CHECK(
      !device.is_cuda() || at::cuda::currentStreamCaptureStatus() == at::cuda::CaptureStatus::None,
      op, ": ", what,
      " must be checked against the other ranks with a host sync, which a CUDA "
      "graph capture cannot make, got ",
      what, " = ", value, " during a capture (run one step with it before capturing)");
  at::Tensor range = at::tensor({value, -value}, at::kLong).to(device);
  all_reduce_in_place(op, range, group, c10d::ReduceOp::MAX);
  const at::Tensor host = range.cpu();
  const int64_t most = host[0].item<int64_t>(), least = -host[1].item<int64_t>();
  c10d::ProcessGroup& pg = *group.group();
  TORCH_CHECK(most == least, op, ": every rank must have the same ", what, ", got ", value,
              " on rank ", pg.getRank(), " of ", pg.getSize(), " and from ", least, " to ", most,
              " across the group");
}

}  // namespace torchmoe::distributed
