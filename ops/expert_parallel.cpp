#include "torchmoe/ops/expert_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <ATen/cuda/CUDAGraphsUtils.cuh>

#include <algorithm>
#include <exception>
#include <numeric>

namespace torchmoe::ops {
namespace {

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

ExpertParallelSplits exchange_split_sizes(const at::Tensor& rows_per_expert,
                                          const ProcessGroupOptions& group) {
  constexpr const char* kOp = "exchange_split_sizes";
  TORCH_CHECK(rows_per_expert.defined() && rows_per_expert.dim() == 1, kOp,
              ": rows_per_expert must be a 1-D tensor [num_experts], got ",
              rows_per_expert.defined() ? rows_per_expert.sizes() : at::IntArrayRef{});
  TORCH_CHECK(
      rows_per_expert.scalar_type() == at::kLong || rows_per_expert.scalar_type() == at::kInt, kOp,
      ": rows_per_expert must be int32 or int64, got ", rows_per_expert.scalar_type());
  c10d::ProcessGroup& pg = checked_group(kOp, group, rows_per_expert);
  const int64_t ep = pg.getSize(), experts = rows_per_expert.size(0);
  TORCH_CHECK(experts % ep == 0, kOp, ": num_experts must be divisible by the group size ", ep,
              ", got ", experts);
  const int64_t local = experts / ep;
  // Each rank's block for rank r: its counts for r's experts, then whether any of its counts is
  // negative (computed where the counts are: no sync), so that every rank learns of a bad count
  // anywhere and all of them stop with the same error instead of some waiting for the others.
  const at::Tensor counts_by_rank = rows_per_expert.to(at::kLong).reshape({ep, local});
  const at::Tensor negative = (counts_by_rank < 0).any().to(at::kLong).expand({ep, 1});
  at::Tensor send = at::cat({counts_by_rank, negative}, 1).contiguous();
  at::Tensor recv = at::empty_like(send);
  std::vector<int64_t> equal_splits;  // empty: local + 1 entries to and from each rank
  c10d::AllToAllOptions options;
  options.timeout = group.timeout();
  wait(kOp, pg, pg.alltoall_base(recv, send, equal_splits, equal_splits, options), group, send);
  // The host sync: both blocks in one copy. host[0]: what this rank sends, host[1]: receives.
  const at::Tensor host = at::stack({send, recv}).cpu();
  const auto blocks = host.accessor<int64_t, 3>();
  std::vector<int64_t> bad_ranks;
  for (const int64_t r : c10::irange(ep)) {
    if (blocks[1][r][local] != 0) bad_ranks.push_back(r);
  }
  TORCH_CHECK(bad_ranks.empty(), kOp, ": rows_per_expert must be >= 0 on every rank, got a ",
              "negative count on rank(s) ", c10::IntArrayRef(bad_ranks));

  ExpertParallelSplits splits;
  for (const int64_t r : c10::irange(ep)) {
    int64_t sent = 0, received = 0;
    for (const int64_t l : c10::irange(local)) {
      sent += blocks[0][r][l];
      received += blocks[1][r][l];
      splits.recv_per_expert.push_back(blocks[1][r][l]);
    }
    splits.send.push_back(sent);
    splits.recv.push_back(received);
  }
  return splits;
}

RoutingMap received_routing_map(c10::IntArrayRef recv_per_expert, int64_t num_local_experts,
                                at::Device device) {
  constexpr const char* kOp = "received_routing_map";
  TORCH_CHECK(num_local_experts > 0 && recv_per_expert.size() % num_local_experts == 0, kOp,
              ": recv_per_expert must hold ranks x num_local_experts counts, got ",
              recv_per_expert.size(), " for ", num_local_experts, " local experts");
  const int64_t local = num_local_experts;
  const auto ranks = static_cast<int64_t>(recv_per_expert.size()) / local;
  std::vector<int64_t> chunk_start(recv_per_expert.size() + 1, 0);
  for (const size_t c : c10::irange(recv_per_expert.size())) {
    TORCH_CHECK(recv_per_expert[c] >= 0, kOp, ": counts must be >= 0, got ", recv_per_expert);
    chunk_start[c + 1] = chunk_start[c] + recv_per_expert[c];
  }
  RoutingMap map;
  map.num_rows = chunk_start.back();
  map.host_splits.assign(local, 0);
  // sorted_slots[i]: the received row that lands in grouped row i (k = 1: slot = row); row_map
  // is its inverse.
  at::Tensor sorted = at::empty({map.num_rows}, at::kLong);
  at::Tensor row_map = at::empty({map.num_rows}, at::kLong);
  int64_t* sorted_ptr = sorted.data_ptr<int64_t>();
  int64_t* row_map_ptr = row_map.data_ptr<int64_t>();
  int64_t grouped = 0;
  for (const int64_t l : c10::irange(local)) {
    for (const int64_t r : c10::irange(ranks)) {
      const int64_t c = r * local + l;
      for (int64_t row = chunk_start[c]; row < chunk_start[c + 1]; ++row, ++grouped) {
        sorted_ptr[grouped] = row;
        row_map_ptr[row] = grouped;
      }
      map.host_splits[l] += recv_per_expert[c];
    }
  }
  at::Tensor splits = at::tensor(map.host_splits, at::kLong);
  if (device.is_cuda()) {
    // Pinned, so that the copies queue behind the stream's work instead of waiting for it.
    sorted = sorted.pin_memory().to(device, /*non_blocking=*/true);
    row_map = row_map.pin_memory().to(device, /*non_blocking=*/true);
    splits = splits.pin_memory().to(device, /*non_blocking=*/true);
  }
  map.sorted_slots = std::move(sorted);
  map.row_map = row_map.unsqueeze(1);
  map.m_splits = std::move(splits);
  return map;
}

CapacityMap make_capacity_map(const at::Tensor& indices, int64_t num_experts, int64_t capacity) {
  constexpr const char* kOp = "make_capacity_map";
  TORCH_CHECK(indices.defined() && indices.dim() == 2, kOp, ": indices must be 2-D [T, topk], got ",
              indices.defined() ? indices.sizes() : at::IntArrayRef{});
  TORCH_CHECK(num_experts > 0 && capacity >= 0, kOp,
              ": num_experts must be positive and capacity >= 0, got ", num_experts, " and ",
              capacity);
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt, kOp,
              ": indices must be int32 or int64, got ", indices.scalar_type());
  const at::Tensor flat = indices.reshape(-1).to(at::kLong);
  const at::Tensor valid = (flat >= 0) & (flat < num_experts);
  const at::Tensor expert = flat.clamp(0, num_experts - 1).unsqueeze(1);
  // position[s]: how many earlier slots chose the same expert.
  at::Tensor position;
  if (indices.is_cuda()) {
    // The routing map's stable sort by expert: a valid slot's row in expert order, less its
    // expert's first row (indices outside [0, E) sort after every expert's, their row -1). No host
    // sync, and memory of order T·k (the one-hot count below would be T·k·E).
    const RoutingMap routing = make_routing_map(indices, num_experts, IndexTrust::kDropless);
    const at::Tensor first_row = routing.m_splits.cumsum(0) - routing.m_splits;
    position = routing.row_map.reshape(-1) - first_row.index_select(0, expert.squeeze(1));
  } else {
    const at::Tensor chosen = at::zeros({flat.size(0), num_experts}, flat.options())
                                  .scatter_(1, expert, valid.unsqueeze(1).to(at::kLong));
    position = chosen.cumsum(0).gather(1, expert).squeeze(1) - 1;
  }
  const at::Tensor keep = valid & (position < capacity);
  CapacityMap map;
  map.row_map = at::where(keep, expert.squeeze(1) * capacity + position, -1).view(indices.sizes());
  map.sorted_slots = slots_of_rows(map.row_map, num_experts * capacity);
  return map;
}

at::Tensor all_to_all_rows(const at::Tensor& rows, c10::IntArrayRef send_splits,
                           c10::IntArrayRef recv_splits, const ProcessGroupOptions& group) {
  constexpr const char* kOp = "all_to_all_rows";
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

}  // namespace torchmoe::ops
