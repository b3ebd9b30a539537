// GroupedTensors and the checks of per-group tensor lists and host split sizes that every grouped
// GEMM op shares (ops/grouped_gemm_backends.h).

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "torchmoe/ops/grouped_gemm.h"
#include "torchmoe/ops/grouped_gemm_backends.h"

namespace torchmoe::ops {

GroupedTensors GroupedTensors::stacked(const at::Tensor& all) {
  TORCH_CHECK(all.defined() && all.dim() >= 1, "GroupedTensors::stacked: needs a [G, ...] tensor");
  GroupedTensors tensors;
  tensors.stacked_ = all;
  return tensors;
}

size_t GroupedTensors::size() const {
  return is_stacked() ? static_cast<size_t>(stacked_.size(0)) : separate_.size();
}

at::Tensor GroupedTensors::operator[](size_t g) const {
  return is_stacked() ? stacked_.select(0, static_cast<int64_t>(g)) : separate_[g];
}

namespace detail {

// A row map's entries (gather_rows, scatter.rows; its shape checked by the caller): int32/int64,
// contiguous, on the input's device, as the kernels read them.
void check_row_index(const char* op, const char* name, const at::Tensor& map,
                     const c10::Device& device) {
  TORCH_CHECK(map.scalar_type() == at::kInt || map.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", map.scalar_type());
  TORCH_CHECK(map.device() == device, op, ": ", name, " must be on ", device,
              " like the input, got ", map.device());
  TORCH_CHECK(map.is_contiguous(), op, ": ", name, " must be contiguous");
}

// The row map of a gathered input: [rows] int32/int64, contiguous, on the input's device.
void check_gather_rows(const char* op, const at::Tensor& gather_rows, const at::Tensor& input) {
  TORCH_CHECK(gather_rows.dim() == 1, op, ": gather_rows must be a 1-D tensor, got ",
              gather_rows.dim(), "-D");
  check_row_index(op, "gather_rows", gather_rows, input.device());
}

int64_t split_sum_within(const char* op, c10::IntArrayRef m_splits, int64_t bound) {
  int64_t sum = 0;
  bool above = false;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    TORCH_CHECK(m_splits[g] >= 0, op, ": m_splits[", g, "] must be non-negative, got ",
                m_splits[g]);
    above = above || m_splits[g] > bound - sum;
    if (!above) sum += m_splits[g];
  }
  return above ? -1 : sum;
}

void check_host_splits(const char* op, c10::IntArrayRef m_splits, int64_t rows) {
  const int64_t sum = split_sum_within(op, m_splits, rows);
  TORCH_CHECK(sum == rows, op, ": m_splits must sum to the number of rows (", rows, "), got ",
              m_splits, sum < 0 ? " (sum above it)" : " (sum " + std::to_string(sum) + ")");
}

const void* CheckedGroups::data(size_t g) const {
  if (tensors.is_stacked()) {
    return static_cast<const char*>(tensors.stacked_tensor().const_data_ptr()) + g * group_bytes;
  }
  return pointers[g];
}

void* CheckedGroups::mutable_data(size_t g) const { return const_cast<void*>(data(g)); }

// Tensor g of a per-group list named `what`. The common case is read straight from the tensor
// (the checks' calls, and comparing shapes through memcmp, were most of a 128-expert call's
// checks); the messages name it `what[g]` and are only formatted on failure.
void check_group_tensor(const char* op, const char* what, size_t g, const at::Tensor& t,
                        const at::Tensor& like, c10::IntArrayRef shape, at::ScalarType dtype,
                        const char* dtype_rule) {
  if (t.defined() && t.scalar_type() == dtype) {
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    const c10::IntArrayRef sizes = impl->sizes();
    bool expected =
        impl->device() == like.device() && impl->is_contiguous() && sizes.size() == shape.size();
    for (size_t d = 0; expected && d < shape.size(); ++d) expected = sizes[d] == shape[d];
    if (expected) return;
  }
  TORCH_CHECK(t.defined(), op, ": ", what, "[", g, "] must be a defined tensor");
  TORCH_CHECK(t.device() == like.device(), op, ": ", what, "[", g, "] must be on ", like.device(),
              " like the input, got ", t.device());
  TORCH_CHECK(t.sizes() == shape, op, ": ", what, "[", g, "] must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, "[", g, "] must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", what, "[", g, "] must have ", dtype_rule, " ",
              dtype, ", got ", t.scalar_type());
}

// Checks the G tensors of `tensors` against shape and dtype and finds their layout in the same
// pass: with 128 experts, separate passes over the list were a visible part of a call's host time.
CheckedGroups check_groups(const char* op, const char* what, const GroupedTensors& tensors,
                           size_t groups, const at::Tensor& like, c10::IntArrayRef shape,
                           at::ScalarType dtype, const char* dtype_rule) {
  TORCH_CHECK(tensors.size() == groups, op, ": ", what, " must hold one tensor per group (", groups,
              "), got ", tensors.size());
  CheckedGroups checked;
  checked.tensors = tensors;
  if (tensors.is_stacked()) {
    const at::Tensor& all = tensors.stacked_tensor();
    std::vector<int64_t> stacked_shape{static_cast<int64_t>(groups)};
    stacked_shape.insert(stacked_shape.end(), shape.begin(), shape.end());
    check_group_tensor(op, what, 0, all, like, stacked_shape, dtype, dtype_rule);
    checked.group_bytes = all.numel() / static_cast<int64_t>(groups) * all.element_size();
    checked.aligned = reinterpret_cast<uintptr_t>(all.const_data_ptr()) % 16 == 0 &&
                      checked.group_bytes % 16 == 0;
    if (checked.group_bytes > 0) {
      checked.spaced.base = all.const_data_ptr();
      checked.spaced.group_stride = static_cast<int64_t>(checked.group_bytes) / all.element_size();
    }
    return checked;
  }
  const at::TensorList list = tensors.separate();
  intptr_t base = 0, step = 0;
  bool spaced = true;
  checked.pointers.resize(list.size());
  for (size_t g = 0; g < list.size(); ++g) {
    check_group_tensor(op, what, g, list[g], like, shape, dtype, dtype_rule);
    checked.pointers[g] = list[g].const_data_ptr();
    const auto address = reinterpret_cast<intptr_t>(checked.pointers[g]);
    checked.aligned &= address % 16 == 0;
    if (g == 0) {
      base = address;
      checked.group_bytes = list[0].numel() * list[0].element_size();
      step = list.size() > 1 ? 0 : static_cast<intptr_t>(checked.group_bytes);
    } else if (g == 1) {
      step = address - base;
    }
    spaced &= address == base + static_cast<intptr_t>(g) * step;
  }
  if (spaced && step > 0 && step % 16 == 0) {
    checked.spaced.base = list[0].const_data_ptr();
    checked.spaced.group_stride = step / list[0].element_size();
  }
  return checked;
}

}  // namespace detail

}  // namespace torchmoe::ops
