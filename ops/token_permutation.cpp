#include "torchmoe/ops/token_permutation.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <limits>

#include "torchmoe/kernels/token_permutation.h"
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

void check_row_map(const char* op, const at::Tensor& row_map, const at::Tensor& data) {
  TORCH_CHECK(row_map.defined() && row_map.dim() == 2 && row_map.scalar_type() == at::kLong, op,
              ": row_map must be a 2-D int64 tensor [tokens, topk], got ",
              row_map.defined() ? row_map.sizes() : at::IntArrayRef{}, " ",
              row_map.defined() ? row_map.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK(row_map.device() == data.device(), op, ": row_map must be on ", data.device(),
              ", got ", row_map.device());
  TORCH_CHECK(row_map.is_contiguous(), op, ": row_map must be contiguous");
}

void check_probs(const char* op, const at::Tensor& probs, const at::Tensor& row_map,
                 const at::Tensor& data) {
  if (!probs.defined()) return;
  TORCH_CHECK(probs.sizes() == row_map.sizes(), op, ": probs must have shape ", row_map.sizes(),
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

kernels::PermuteParams kernel_params(const at::Tensor& row_map, int64_t hidden,
                                     const at::Tensor& data, const at::Tensor& probs) {
  kernels::PermuteParams p;
  p.tokens = row_map.size(0);
  p.topk = row_map.size(1);
  p.hidden = hidden;
  p.data_type = kernel_type(data.scalar_type());
  p.prob_type = probs.defined() ? kernel_type(probs.scalar_type()) : kernels::ScalarType::kFloat32;
  p.row_map = row_map.const_data_ptr<int64_t>();
  p.probs = probs.defined() ? probs.const_data_ptr() : nullptr;
  return p;
}

}  // namespace

RoutingMap make_routing_map(const at::Tensor& indices, int64_t num_experts) {
  constexpr const char* kOp = "torchmoe::make_routing_map";
  TORCH_CHECK(indices.defined() && indices.dim() == 2, kOp,
              ": indices must be 2-D [tokens, topk], got ",
              indices.defined() ? indices.sizes() : at::IntArrayRef{});
  TORCH_CHECK(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt, kOp,
              ": indices must be int64 or int32, got ", indices.scalar_type());
  TORCH_CHECK(num_experts > 0 && num_experts < std::numeric_limits<int32_t>::max() - 2, kOp,
              ": num_experts must be positive, got ", num_experts);
  TORCH_CHECK(indices.numel() < std::numeric_limits<int32_t>::max(), kOp,
              ": at most 2^31 - 1 (token, expert) slots, got ", indices.numel());
  const int64_t tokens = indices.size(0), topk = indices.size(1);
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
    const at::Tensor idx = indices.contiguous();
    const int64_t slots = tokens * topk;
    map.row_map = at::empty({slots}, long_options);
    map.sorted_slots = at::empty({slots}, long_options);
    const at::Tensor counts = at::empty({num_experts + 2}, indices.options().dtype(at::kInt));
    const size_t workspace_bytes = kernels::routing_map_workspace_bytes(slots, num_experts);
    const at::Tensor workspace =
        at::empty({static_cast<int64_t>(workspace_bytes)}, indices.options().dtype(at::kByte));
    kernels::RoutingMapParams p;
    p.tokens = tokens;
    p.topk = topk;
    p.experts = num_experts;
    p.indices = idx.const_data_ptr();
    p.indices_int32 = idx.scalar_type() == at::kInt;
    p.row_map = map.row_map.data_ptr<int64_t>();
    p.sorted_slots = map.sorted_slots.data_ptr<int64_t>();
    p.counts = counts.data_ptr<int32_t>();
    p.workspace = workspace.data_ptr();
    p.workspace_bytes = workspace_bytes;
    kernels::launch_routing_map(p, at::cuda::getCurrentCUDAStream().stream());
    map.m_splits = counts.narrow(0, 0, num_experts).to(at::kLong);
    host_counts = counts.to(at::kCPU).to(at::kLong);  // the one device-to-host copy
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
  }
  map.row_map = map.row_map.view({tokens, topk});
  map.sorted_slots = map.sorted_slots.narrow(0, 0, map.num_rows);
  return map;
}

at::Tensor permute_rows(const at::Tensor& tokens, const at::Tensor& row_map, int64_t num_rows,
                        const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::permute_rows";
  check_rows(kOp, "tokens", tokens);
  check_row_map(kOp, row_map, tokens);
  TORCH_CHECK(row_map.size(0) == tokens.size(0), kOp, ": row_map must have one row per token (",
              tokens.size(0), "), got ", row_map.size(0));
  TORCH_CHECK(num_rows >= 0 && num_rows <= row_map.numel(), kOp, ": num_rows must be in [0, ",
              row_map.numel(), "], got ", num_rows);
  check_probs(kOp, probs, row_map, tokens);
  switch (select_backend(kOp, tokens)) {
    case PermuteBackend::kReference: {
      const KeptSlots kept = kept_slots(row_map);
      TORCH_CHECK(kept.rows.numel() == num_rows, kOp, ": row_map keeps ", kept.rows.numel(),
                  " slots but num_rows is ", num_rows);
      at::Tensor src = tokens.index_select(0, kept.tokens);
      if (probs.defined()) {
        const at::ScalarType compute = compute_type(tokens);
        src = (src.to(compute) *
               probs.reshape(-1).index_select(0, kept.slots).to(compute).unsqueeze(1))
                  .to(tokens.scalar_type());
      }
      return at::empty({num_rows, tokens.size(1)}, tokens.options()).index_copy_(0, kept.rows, src);
    }
    case PermuteBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(tokens.device());
      at::Tensor output = at::empty({num_rows, tokens.size(1)}, tokens.options());
      kernels::PermuteParams p = kernel_params(row_map, tokens.size(1), tokens, probs);
      p.input = tokens.const_data_ptr();
      p.output = output.data_ptr();
      kernels::launch_permute(p, at::cuda::getCurrentCUDAStream().stream());
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled PermuteBackend");
}

at::Tensor unpermute_rows(const at::Tensor& permuted, const at::Tensor& row_map,
                          const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::unpermute_rows";
  check_rows(kOp, "permuted", permuted);
  check_row_map(kOp, row_map, permuted);
  check_probs(kOp, probs, row_map, permuted);
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
      at::Tensor output = at::empty({tokens, hidden}, permuted.options());  // every row written
      kernels::PermuteParams p = kernel_params(row_map, hidden, permuted, probs);
      p.input = permuted.const_data_ptr();
      p.output = output.data_ptr();
      kernels::launch_unpermute(p, at::cuda::getCurrentCUDAStream().stream());
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled PermuteBackend");
}

UnpermuteGrads unpermute_rows_backward(const at::Tensor& grad_out, const at::Tensor& permuted,
                                       const at::Tensor& row_map, const at::Tensor& probs) {
  constexpr const char* kOp = "torchmoe::unpermute_rows_backward";
  check_rows(kOp, "permuted", permuted);
  check_row_map(kOp, row_map, permuted);
  TORCH_CHECK(probs.defined(), kOp, ": needs probs (without them the gradient is permute_rows)");
  check_probs(kOp, probs, row_map, permuted);
  TORCH_CHECK(grad_out.defined() && grad_out.dim() == 2 && grad_out.size(0) == row_map.size(0) &&
                  grad_out.size(1) == permuted.size(1),
              kOp, ": grad_out must be [", row_map.size(0), ", ", permuted.size(1), "], got ",
              grad_out.defined() ? grad_out.sizes() : at::IntArrayRef{});
  TORCH_CHECK(grad_out.scalar_type() == permuted.scalar_type() &&
                  grad_out.device() == permuted.device() && grad_out.is_contiguous(),
              kOp, ": grad_out must be contiguous with the permuted rows' dtype and device");
  UnpermuteGrads grads;
  switch (select_backend(kOp, permuted)) {
    case PermuteBackend::kReference: {
      const at::ScalarType compute = compute_type(permuted);
      const KeptSlots kept = kept_slots(row_map);
      const at::Tensor g = grad_out.index_select(0, kept.tokens).to(compute);
      const at::Tensor p = probs.reshape(-1).index_select(0, kept.slots).to(compute);
      grads.grad_permuted = at::empty_like(permuted).index_copy_(
          0, kept.rows, (g * p.unsqueeze(1)).to(permuted.scalar_type()));
      const at::Tensor dots = (g * permuted.index_select(0, kept.rows).to(compute)).sum(1);
      grads.grad_probs = at::zeros({row_map.numel()}, probs.options().dtype(compute))
                             .index_copy_(0, kept.slots, dots)
                             .to(probs.scalar_type())
                             .view(row_map.sizes());
      return grads;
    }
    case PermuteBackend::kCuda: {
      const c10::cuda::CUDAGuard guard(permuted.device());
      grads.grad_permuted = at::empty_like(permuted);
      // Zeros: the kernel writes nothing when H == 0 or T == 0.
      grads.grad_probs = at::zeros_like(probs);
      kernels::PermuteParams p = kernel_params(row_map, permuted.size(1), permuted, probs);
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
