#include "torchmoe/ops/token_permutation.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>
#include <utility>
#include <vector>

#include "torchmoe/kernels/token_permutation.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

enum class PermuteBackend {
  kReference,  // CPU: ATen index ops
  kCuda,       // kernels/token_permutation.cu
};

// The dispatch table; throws NotImplementedError for valid but unsupported device/dtype pairs.
PermuteBackend select_backend(const char* op, const at::Tensor& data) {
  const at::ScalarType dtype = data.scalar_type();
  if (data.is_cpu()) return PermuteBackend::kReference;
  if (data.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    return PermuteBackend::kCuda;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": no backend for ", data.device(), " tensors of dtype ",
                              dtype,
                              " (supported: CPU floating dtypes; CUDA float32, float16, bfloat16)");
}

void check_rows(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.dim() == 2, op, ": ", name, " must be 2-D [rows, hidden], got ",
              t.defined() ? t.sizes() : at::IntArrayRef{});
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must have a floating dtype, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// An int64 index tensor of `dim` dimensions, contiguous, on the data's device; `layout` follows
// the type in the message (e.g. " [tokens, topk]").
void check_index_tensor(const char* op, const char* name, const at::Tensor& t, int64_t dim,
                        const char* layout, const at::Tensor& data) {
  TORCH_CHECK(t.defined() && t.dim() == dim && t.scalar_type() == at::kLong, op, ": ", name,
              " must be a ", dim, "-D int64 tensor", layout, ", got ",
              t.defined() ? t.sizes() : at::IntArrayRef{}, " ",
              t.defined() ? t.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK(t.device() == data.device(), op, ": ", name, " must be on ", data.device(), ", got ",
              t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_probs(const char* op, const at::Tensor& probs, at::IntArrayRef expected,
                 const at::Tensor& data) {
  if (!probs.defined()) return;
  TORCH_CHECK(probs.sizes() == expected, op, ": probs must have shape ", expected,
              " (tokens, topk), got ", probs.sizes());
  TORCH_CHECK(probs.device() == data.device(), op, ": probs must be on ", data.device(), ", got ",
              probs.device());
  TORCH_CHECK(at::isFloatingType(probs.scalar_type()), op,
              ": probs must have a floating dtype, got ", probs.scalar_type());
  TORCH_CHECK(!data.is_cuda() || probs.scalar_type() == at::kFloat ||
                  probs.scalar_type() == data.scalar_type(),
              op, ": probs must be float32 or the data's dtype ", data.scalar_type(),
              " on CUDA, got ", probs.scalar_type());
  TORCH_CHECK(probs.is_contiguous(), op, ": probs must be contiguous");
}

at::ScalarType compute_type(const at::Tensor& data) {
  return data.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// CPU reference helpers: the kept slots, their permuted rows and their tokens.
struct KeptSlots {
  at::Tensor slots, rows, tokens;
};

KeptSlots kept_slots(const at::Tensor& row_map) {
  const at::Tensor flat = row_map.reshape(-1);
  const at::Tensor slots = at::nonzero(flat >= 0).reshape(-1);
  return {slots, flat.index_select(0, slots), at::floor_divide(slots, row_map.size(1))};
}

kernels::PermuteParams kernel_params(int64_t tokens, int64_t topk, int64_t rows, int64_t hidden,
                                     const at::Tensor& data, const at::Tensor& probs) {
  kernels::PermuteParams p;
  p.tokens = tokens;
  p.topk = topk;
  p.rows = rows;
  p.hidden = hidden;
  p.data_type = kernel_type(data.scalar_type());
  p.prob_type = probs.defined() ? kernel_type(probs.scalar_type()) : kernels::ScalarType::kFloat32;
  p.probs = probs.defined() ? probs.const_data_ptr() : nullptr;
  return p;
}

}  // namespace

SplitSizes split_sizes(const RoutingMap& map) {
  if (!map.m_splits.is_cuda()) return SplitSizes(map.host_splits);
  if (map.host_splits.empty()) return SplitSizes(map.m_splits);
  return SplitSizes(map.host_splits, map.m_splits);
}

RoutingMap make_routing_map(const at::Tensor& indices, int64_t num_experts, IndexTrust trust,
                            const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::make_routing_map";
  TORCH_CHECK(indices.defined() && indices.dim() == 2, kOp,
              ": indices must be 2-D [tokens, topk], got ",
              indices.defined() ? indices.sizes() : at::IntArrayRef{});
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt, kOp,
              ": indices must be int64 or int32, got ", indices.scalar_type());
  TORCH_CHECK(num_experts > 0 && num_experts < std::numeric_limits<int32_t>::max() - 2, kOp,
              ": num_experts must be positive and below 2^31 - 3, got ", num_experts);
  TORCH_CHECK(indices.numel() < std::numeric_limits<int32_t>::max(), kOp,
              ": at most 2^31 - 1 (token, expert) slots, got ", indices.numel());
  const int64_t tokens = indices.size(0), topk = indices.size(1);
  TORCH_CHECK(
      !probs.defined() || (probs.sizes() == indices.sizes() && probs.scalar_type() == at::kFloat &&
                           probs.device() == indices.device()),
      kOp, ": probs must be a float32 tensor of the indices' shape ", indices.sizes(), " on ",
      indices.device(), ", got ", probs.defined() ? probs.sizes() : at::IntArrayRef{}, " ",
      probs.defined() ? probs.scalar_type() : at::ScalarType::Undefined, " on ",
      probs.defined() ? probs.device() : indices.device());
  const at::TensorOptions long_options = indices.options().dtype(at::kLong);
  RoutingMap map;
  at::Tensor host_counts;  // [E + 2] on the host: per expert, dropped, out of range
  if (indices.is_cpu()) {
    const at::Tensor flat = indices.reshape(-1).to(at::kLong);
    const at::Tensor in_range = (flat >= 0) & (flat < num_experts);
    const at::Tensor keys =
        at::where(in_range, flat, at::where(flat == -1, num_experts, num_experts + 1));
    host_counts = at::bincount(keys, {}, num_experts + 2);
    map.sorted_slots = std::get<1>(at::sort(keys, /*stable=*/true, 0, false));
    map.row_map = at::full({tokens * topk}, -1, long_options);
    // Filled below once the kept count is known.
  } else if (indices.is_cuda()) {
    const c10::cuda::CUDAGuard guard(indices.device());
    TORCH_CHECK_NOT_IMPLEMENTED(num_experts <= kernels::kRoutingMapMaxExperts, kOp, ": at most ",
                                kernels::kRoutingMapMaxExperts,
                                " experts on CUDA (the counting sort's bins are in shared memory), "
                                "got ",
                                num_experts);
    const at::Tensor idx = indices.contiguous();
    const int64_t slots = tokens * topk;
    const size_t workspace_bytes = kernels::routing_map_workspace_bytes(slots, num_experts);
    // The map, the counts (per expert, dropped, out of range) and the kernel's workspace: one
    // allocation (new_empty_packed).
    std::vector<at::Tensor> t =
        new_empty_packed({{{tokens, topk}, at::kLong},
                          {{slots}, at::kLong},
                          {{slots}, at::kLong},
                          {{probs.defined() ? slots : 0}, at::kFloat},
                          {{num_experts + 2}, at::kLong},
                          {{static_cast<int64_t>(workspace_bytes)}, at::kByte}},
                         indices.device());
    map.row_map = std::move(t[0]);
    map.sorted_slots = std::move(t[1]);
    map.row_tokens = std::move(t[2]);
    if (probs.defined()) map.row_probs = std::move(t[3]);
    const at::Tensor& counts = t[4];
    kernels::RoutingMapParams p;
    p.tokens = tokens;
    p.topk = topk;
    p.experts = num_experts;
    p.indices = idx.const_data_ptr();
    p.indices_int32 = idx.scalar_type() == at::kInt;
    p.row_map = map.row_map.data_ptr<int64_t>();
    p.sorted_slots = map.sorted_slots.data_ptr<int64_t>();
    p.row_tokens = map.row_tokens.data_ptr<int64_t>();
    // Values only: row_probs is data (route_tokens gives it autograd history through
    // RowProbsFunction).
    const at::Tensor probs_values =
        !probs.defined() || probs.is_contiguous() ? probs : probs.detach().contiguous();
    if (probs.defined()) {
      p.probs = probs_values.const_data_ptr<float>();
      p.row_probs = map.row_probs.data_ptr<float>();
    }
    p.counts = counts.data_ptr<int64_t>();
    p.workspace = t[5].data_ptr();
    p.workspace_bytes = workspace_bytes;
    kernels::launch_routing_map(p, at::cuda::getCurrentCUDAStream().stream());
    // The experts' counts, an alias rather than a narrow (no dispatcher).
    map.m_splits = alias_storage(counts, at::kLong, {num_experts}, {1}, counts.storage_offset());
    if (trust == IndexTrust::kDropless) {
      map.num_rows = slots;
      return map;
    }
    host_counts = counts.to(at::kCPU);  // the one device-to-host copy
  } else {
    TORCH_CHECK_NOT_IMPLEMENTED(false, kOp, ": no backend for indices on ", indices.device());
  }
  const auto* c = host_counts.const_data_ptr<int64_t>();
  TORCH_CHECK(c[num_experts + 1] == 0, kOp, ": indices must be in [0, ", num_experts,
              ") or -1 (dropped), got ", c[num_experts + 1], " out of range");
  map.host_splits.assign(c, c + num_experts);
  for (int64_t e = 0; e < num_experts; ++e) map.num_rows += c[e];
  if (indices.is_cpu()) {
    map.m_splits = host_counts.narrow(0, 0, num_experts).clone();
    const at::Tensor kept = map.sorted_slots.narrow(0, 0, map.num_rows);
    map.row_map.index_copy_(0, kept, at::arange(map.num_rows, long_options));
    map.row_map = map.row_map.view({tokens, topk});
  }
  map.sorted_slots = map.sorted_slots.narrow(0, 0, map.num_rows);
  if (indices.is_cpu()) {
    map.row_tokens = tokens_of_rows(map.sorted_slots, topk);
    if (probs.defined()) {
      // Values only, as on CUDA.
      map.row_probs = probs.detach().reshape({-1}).index_select(0, map.sorted_slots);
    }
  } else {
    map.row_tokens = map.row_tokens.narrow(0, 0, map.num_rows);
    if (probs.defined()) map.row_probs = map.row_probs.narrow(0, 0, map.num_rows);
  }
  return map;
}

at::Tensor permute_rows(const at::Tensor& tokens, const at::Tensor& row_map,
                        const at::Tensor& sorted_slots, const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::permute_rows";
  check_rows(kOp, "tokens", tokens);
  check_index_tensor(kOp, "row_map", row_map, 2, " [tokens, topk]", tokens);
  check_index_tensor(kOp, "sorted_slots", sorted_slots, 1, "", tokens);
  TORCH_CHECK(row_map.size(0) == tokens.size(0) && row_map.size(1) >= 1, kOp,
              ": row_map must be [tokens=", tokens.size(0), ", topk >= 1], got ", row_map.sizes());
  const int64_t topk = row_map.size(1);
  check_probs(kOp, probs, {tokens.size(0), topk}, tokens);
  const int64_t rows = sorted_slots.size(0);
  switch (select_backend(kOp, tokens)) {
    case PermuteBackend::kReference: {
      // No tokens: every row is padding (there is no slot 0 to read).
      if (tokens.size(0) == 0) return at::zeros({rows, tokens.size(1)}, tokens.options());
      // Rows whose slot is -1 (padding) read slot 0 and are multiplied by 0.
      const at::Tensor has_slot = (sorted_slots >= 0).unsqueeze(1);
      const at::Tensor slots = sorted_slots.clamp_min(0);
      const at::ScalarType compute = compute_type(tokens);
      at::Tensor out = tokens.index_select(0, at::floor_divide(slots, topk)).to(compute);
      if (probs.defined()) {
        out = out * probs.reshape(-1).index_select(0, slots).to(compute).unsqueeze(1);
      }
      return (out * has_slot).to(tokens.scalar_type());
    }
    case PermuteBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(tokens.device());
      at::Tensor output = new_empty({rows, tokens.size(1)}, tokens.options());
      kernels::PermuteParams p =
          kernel_params(tokens.size(0), topk, rows, tokens.size(1), tokens, probs);
      p.row_map = row_map.const_data_ptr<int64_t>();
      p.sorted_slots = sorted_slots.const_data_ptr<int64_t>();
      p.input = tokens.const_data_ptr();
      p.output = output.data_ptr();
      kernels::launch_permute(p, at::cuda::getCurrentCUDAStream().stream());
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled PermuteBackend");
}

at::Tensor slots_of_rows(const at::Tensor& row_map, int64_t num_rows) {
  TORCH_CHECK(num_rows >= 0, "torchmoe::slots_of_rows: num_rows must be non-negative, got ",
              num_rows);
  // Rows no slot names (padding) keep -1; dropped slots (-1) all write one spare element past the
  // end, which is cut off.
  const at::Tensor flat = row_map.reshape(-1);
  const at::Tensor target = at::where(flat >= 0, flat, num_rows);
  return at::full({num_rows + 1}, -1, flat.options())
      .scatter_(0, target, at::arange(flat.numel(), flat.options()))
      .narrow(0, 0, num_rows);
}

at::Tensor tokens_of_rows(const at::Tensor& sorted_slots, int64_t topk) {
  return sorted_slots.div(topk, "floor");
}

void check_row_map(const char* op, const at::Tensor& row_map, int64_t num_rows) {
  if (row_map.numel() == 0) return;
  const at::Tensor flat = row_map.reshape(-1);
  const at::Tensor kept = flat >= 0;
  // Uses of each row; the dropped slots (and any out-of-range entry) land in a spare bin.
  const at::Tensor in_range = kept & (flat < num_rows);
  const at::Tensor uses =
      at::zeros({num_rows + 1}, flat.options())
          .scatter_add_(0, at::where(in_range, flat, num_rows), in_range.to(at::kLong));
  uses.narrow(0, num_rows, 1).zero_();  // the spare bin is no row
  // One device-to-host copy for the three facts.
  const at::Tensor facts =
      at::stack({((flat < -1) | (flat >= num_rows)).sum(), uses.max(), at::argmax(uses)}).cpu();
  const int64_t* f = facts.const_data_ptr<int64_t>();
  TORCH_CHECK(f[0] == 0, op, ": row_map entries must be -1 (dropped) or rows of permuted in [0, ",
              num_rows, "), got ", f[0], " out of range");
  TORCH_CHECK(f[1] <= 1, op, ": row_map must name each row of permuted at most once, got row ",
              f[2], " ", f[1], " times");
}

at::Tensor unpermute_rows(const at::Tensor& permuted, const at::Tensor& row_map,
                          const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::unpermute_rows";
  check_rows(kOp, "permuted", permuted);
  check_index_tensor(kOp, "row_map", row_map, 2, " [tokens, topk]", permuted);
  check_probs(kOp, probs, row_map.sizes(), permuted);
  const int64_t tokens = row_map.size(0), hidden = permuted.size(1);
  switch (select_backend(kOp, permuted)) {
    case PermuteBackend::kReference: {
      const at::ScalarType compute = compute_type(permuted);
      const KeptSlots kept = kept_slots(row_map);
      at::Tensor src = permuted.index_select(0, kept.rows).to(compute);
      if (probs.defined()) {
        src = src * probs.reshape(-1).index_select(0, kept.slots).to(compute).unsqueeze(1);
      }
      return at::zeros({tokens, hidden}, permuted.options().dtype(compute))
          .index_add_(0, kept.tokens, src)
          .to(permuted.scalar_type());
    }
    case PermuteBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(permuted.device());
      at::Tensor output = new_empty({tokens, hidden}, permuted.options());  // every row written
      kernels::PermuteParams p =
          kernel_params(tokens, row_map.size(1), permuted.size(0), hidden, permuted, probs);
      p.row_map = row_map.const_data_ptr<int64_t>();
      p.input = permuted.const_data_ptr();
      p.output = output.data_ptr();
      kernels::launch_unpermute(p, at::cuda::getCurrentCUDAStream().stream());
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled PermuteBackend");
}

UnpermuteGrads unpermute_rows_backward(const at::Tensor& grad_out, const at::Tensor& permuted,
                                       const at::Tensor& sorted_slots, const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::unpermute_rows_backward";
  check_rows(kOp, "permuted", permuted);
  check_index_tensor(kOp, "sorted_slots", sorted_slots, 1, "", permuted);
  TORCH_CHECK(sorted_slots.size(0) == permuted.size(0), kOp, ": sorted_slots must have one entry ",
              "per permuted row (", permuted.size(0), "), got ", sorted_slots.size(0));
  TORCH_CHECK(probs.defined() && probs.dim() == 2, kOp,
              ": needs probs [tokens, topk] (without them the gradient is permute_rows)");
  check_probs(kOp, probs, {probs.size(0), probs.size(1)}, permuted);
  TORCH_CHECK(grad_out.defined() && grad_out.dim() == 2 && grad_out.size(0) == probs.size(0) &&
                  grad_out.size(1) == permuted.size(1),
              kOp, ": grad_out must be [", probs.size(0), ", ", permuted.size(1), "], got ",
              grad_out.defined() ? grad_out.sizes() : at::IntArrayRef{});
  TORCH_CHECK(grad_out.scalar_type() == permuted.scalar_type() &&
                  grad_out.device() == permuted.device() && grad_out.is_contiguous(),
              kOp, ": grad_out must be contiguous with the permuted rows' dtype and device");
  const int64_t topk = probs.size(1);
  UnpermuteGrads grads;
  switch (select_backend(kOp, permuted)) {
    case PermuteBackend::kReference: {
      // Rows whose slot is -1 (padding) get a zero gradient and give none to a probability.
      const at::ScalarType compute = compute_type(permuted);
      const at::Tensor has_slot = sorted_slots >= 0;
      const at::Tensor slots = sorted_slots.clamp_min(0);
      const at::Tensor g = grad_out.index_select(0, at::floor_divide(slots, topk)).to(compute) *
                           has_slot.unsqueeze(1);
      const at::Tensor p = probs.reshape(-1).index_select(0, slots).to(compute);
      grads.grad_permuted = (g * p.unsqueeze(1)).to(permuted.scalar_type());
      const at::Tensor dots = (g * permuted.to(compute)).sum(1);
      const at::Tensor kept = at::nonzero(has_slot).reshape(-1);
      grads.grad_probs =
          at::zeros({probs.numel()}, probs.options().dtype(compute))
              .index_copy_(0, slots.index_select(0, kept), dots.index_select(0, kept))
              .to(probs.scalar_type())
              .view(probs.sizes());
      return grads;
    }
    case PermuteBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(permuted.device());
      grads.grad_permuted = new_empty(permuted.sizes(), permuted.options());
      // Zeros: dropped slots have no row, and nothing is written when H == 0.
      grads.grad_probs = at::zeros_like(probs);
      kernels::PermuteParams p =
          kernel_params(probs.size(0), topk, permuted.size(0), permuted.size(1), permuted, probs);
      p.sorted_slots = sorted_slots.const_data_ptr<int64_t>();
      p.input = grad_out.const_data_ptr();
      p.output = grads.grad_permuted.data_ptr();
      p.permuted = permuted.const_data_ptr();
      p.grad_probs = grads.grad_probs.data_ptr();
      kernels::launch_unpermute_backward(p, at::cuda::getCurrentCUDAStream().stream());
      return grads;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled PermuteBackend");
}

}  // namespace torchmoe::ops
