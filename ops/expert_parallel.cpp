#include "torchmoe/ops/expert_parallel.h"

#include <ATen/ATen.h>
#include <c10/util/irange.h>

#include <vector>

#include "torchmoe/distributed/collectives.h"

namespace torchmoe::ops {

ExpertParallelSplits exchange_split_sizes(const at::Tensor& rows_per_expert,
                                          const ProcessGroupOptions& group) {
  constexpr const char* kOp = "exchange_split_sizes";
  TORCH_CHECK(rows_per_expert.defined() && rows_per_expert.dim() == 1, kOp,
              ": rows_per_expert must be a 1-D tensor [num_experts], got ",
              rows_per_expert.defined() ? rows_per_expert.sizes() : at::IntArrayRef{});
  TORCH_CHECK(
      rows_per_expert.scalar_type() == at::kLong || rows_per_expert.scalar_type() == at::kInt, kOp,
      ": rows_per_expert must be int32 or int64, got ", rows_per_expert.scalar_type());
  c10d::ProcessGroup& pg = distributed::checked_group(kOp, group, rows_per_expert);
  const int64_t ep = pg.getSize(), experts = rows_per_expert.size(0);
  TORCH_CHECK(experts % ep == 0, kOp, ": num_experts must be divisible by the group size ", ep,
              ", got ", experts);
  const int64_t local = experts / ep;
  // Each rank's block for rank r: its counts for r's experts, then whether any of its counts is
  // negative (computed where the counts are: no sync), so that every rank learns of a bad count
  // anywhere and all of them stop with the same error instead of some waiting for the others.
  const at::Tensor counts_by_rank = rows_per_expert.to(at::kLong).reshape({ep, local});
  const at::Tensor negative = (counts_by_rank < 0).any().to(at::kLong).expand({ep, 1});
  const at::Tensor send = at::cat({counts_by_rank, negative}, 1);
  // Row r (local + 1 entries) to rank r, and one row from each.
  const std::vector<int64_t> one_row_each(ep, 1);
  const at::Tensor recv =
      distributed::all_to_all_rows(send, one_row_each, one_row_each, group, kOp);
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

}  // namespace torchmoe::ops
