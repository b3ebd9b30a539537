// The sm90 backend: torchmoe's one-launch grouped GEMM (kernels/grouped_gemm_sm90.h) and the
// per-group column sums (kernels/grouped_column_sum.h), reading the split sizes on the device.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/cuda/CUDAGraphsUtils.cuh>

#include <climits>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "torchmoe/kernels/grouped_column_sum.h"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/ops/empty.h"
#include "torchmoe/ops/grouped_gemm_backends.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops::detail {
namespace {

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// What a small device table (a pointer array, or the weights' tensor maps) is made from: its
// kind, the device, and the groups' data pointers; maps also depend on the GEMM kind, dtype and
// shape (tag, dtype, n, k).
struct TableKey {
  int tag = 0;  // 0: a pointer array; 1 + GemmKind: that kind's weight maps
  int device = 0;
  int dtype = 0;
  int64_t n = 0, k = 0;
  std::vector<const void*> pointers;

  bool operator==(const TableKey& o) const {
    return tag == o.tag && device == o.device && dtype == o.dtype && n == o.n && k == o.k &&
           pointers == o.pointers;
  }
};

struct TableKeyHash {
  size_t operator()(const TableKey& key) const {
    // A rotate and xor per pointer (a short dependency chain: 128 pointers cost ~0.1 us), then one
    // multiply to spread the bits; equal keys are compared whole.
    uint64_t h = static_cast<uint64_t>(key.tag) << 56 ^ static_cast<uint64_t>(key.device) << 48 ^
                 static_cast<uint64_t>(key.dtype) << 40 ^ static_cast<uint64_t>(key.n) << 20 ^
                 static_cast<uint64_t>(key.k);
    for (const void* p : key.pointers) {
      h = (h << 7 | h >> 57) ^ static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
    }
    return static_cast<size_t>(h * 0x9E3779B97F4A7C15ull);
  }
};

TableKey pointer_key(int tag, const CheckedGroups& groups) {
  TableKey key;
  key.tag = tag;
  key.device = groups.tensors[0].device().index();
  key.pointers = groups.pointers;
  // A stacked tensor is not spaced only when its groups hold no bytes; its pointers are not kept.
  if (key.pointers.size() != groups.size()) {
    key.pointers.resize(groups.size());
    for (size_t g = 0; g < groups.size(); ++g) key.pointers[g] = groups.data(g);
  }
  return key;
}

// Small device tables, kept per device for the life of the process and keyed by what determines
// their content: the same weights or gradient buffers give the same table on every call, so
// make_bytes() runs and the upload happens once, and a CUDA graph may keep the pointer it captured.
// make_bytes() runs before the key is moved into the table, so it may read the key.
template <typename MakeBytes>
const void* device_table(TableKey&& key, MakeBytes&& make_bytes) {
  static std::mutex mutex;
  static std::unordered_map<TableKey, at::Tensor, TableKeyHash> tables;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = tables.find(key);
  if (it == tables.end()) {
    TORCH_CHECK(at::cuda::currentStreamCaptureStatus() == at::cuda::CaptureStatus::None,
                "torchmoe grouped GEMM: new weight or gradient tensors were seen during CUDA graph "
                "capture; run the step once before capturing (their address table is built then)");
    const std::vector<uint8_t> bytes = make_bytes();
    at::Tensor host = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
    const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(key.device));
    it = tables.emplace(std::move(key), host.to(device)).first;
    if (tables.size() == 4096) {
      TORCH_WARN(
          "torchmoe grouped GEMM: 4096 address tables cached; are weight or gradient "
          "buffers reallocated every step? (each new set adds one)");
    }
  }
  return it->second.const_data_ptr();
}

}  // namespace

// TMA needs 16-byte aligned rows; an activation that starts elsewhere (a view at an odd offset) is
// copied once rather than sending the whole layer to another backend.
at::Tensor aligned_operand(const at::Tensor& t) {
  return aligned16(t) ? t : at::empty_like(t, at::MemoryFormat::Contiguous).copy_(t);
}

// Where each group's tensor lives: one base and a stride when the groups are equally spaced, else
// a cached device table of pointers.
kernels::GroupAddress group_address(const CheckedGroups& groups) {
  if (groups.empty() || !groups.spaced.empty()) return groups.spaced;
  kernels::GroupAddress address;
  TableKey key = pointer_key(0, groups);
  address.table = static_cast<const void* const*>(device_table(std::move(key), [&] {
    const auto* first = reinterpret_cast<const uint8_t*>(key.pointers.data());
    return std::vector<uint8_t>(first, first + key.pointers.size() * sizeof(void*));
  }));
  return address;
}

namespace {

// The weights as the kernel reads them: one 3-D tensor map over equally spaced weights (built per
// launch), or a cached device table of per-group maps. A map depends only on the kind, dtype,
// shape and address, so those are the table's key and its G driver encodes run once per set of
// weights, not on every call.
void set_weights(kernels::Sm90GemmParams& p, const CheckedGroups& weights) {
  TORCH_CHECK(weights.aligned, "torchmoe grouped GEMM: the sm90 backend needs weights that start ",
              "on 16-byte boundaries (plan with GemmShape::aligned false for others)");
  if (!weights.spaced.empty()) {
    p.weight = weights.spaced;
    return;
  }
  TableKey key = pointer_key(1 + static_cast<int>(p.kind), weights);
  key.dtype = static_cast<int>(p.input_type);
  key.n = p.n;
  key.k = p.k;
  p.weight_maps = device_table(std::move(key), [&] {
    return kernels::encode_weight_maps(p.kind, p.input_type, p.n, p.k, key.pointers);
  });
}

// x as the kernel reads it: `input` itself, or its rows through a gather map.
void set_input(kernels::Sm90GemmParams& p, const at::Tensor& x, const at::Tensor& gather_rows) {
  p.input = x.const_data_ptr();
  if (!gather_rows.defined()) return;
  p.gather_rows = gather_rows.const_data_ptr();
  p.gather_rows_int32 = gather_rows.scalar_type() == at::kInt;
  p.gather_source_rows = x.size(0);
}

void set_scatter(kernels::Sm90GemmParams& p, const RowScatter& scatter) {
  if (!scatter.defined()) return;
  p.scatter_rows = scatter.rows.const_data_ptr();
  p.scatter_rows_int32 = scatter.rows.scalar_type() == at::kInt;
  p.scatter_target_rows = scatter.target_rows;
}

void launch(const at::Tensor& like, kernels::Sm90GemmParams params) {
  const c10::cuda::CUDAGuard guard(like.device());
  // wgrad's tile counter: from the caching allocator, so it is stream-ordered (and part of a
  // captured graph's pool) like every other buffer of the call.
  at::Tensor counter;
  if (params.kind == kernels::GemmKind::kWgrad) {
    counter = new_empty({1}, like.options().dtype(at::kInt));
    params.tile_counter = counter.mutable_data_ptr<int>();
  }
  kernels::launch_grouped_gemm_sm90(params, at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace

const char* sm90_refusal(const at::Tensor& input, const GemmShape& shape, int64_t rows, bool fp8) {
  if (!fp8 && input.scalar_type() != at::kBFloat16 && input.scalar_type() != at::kHalf) {
    return "it takes bfloat16 and float16 operands only";
  }
  if (!kernels::sm90_grouped_gemm_available()) {
    return "the device is not sm_90 or the library was built without sm_90a code";
  }
  if (shape.n <= 0 || shape.k <= 0 || shape.n % kernels::kSm90FeatureMultiple != 0 ||
      shape.k % kernels::kSm90FeatureMultiple != 0) {
    return "in_features and out_features must be positive multiples of 8 (16-byte TMA rows)";
  }
  if (shape.groups == 0 || shape.groups > static_cast<size_t>(kernels::kSm90MaxGroups)) {
    return "it takes 1 to 1024 groups";
  }
  if (!shape.aligned)
    return "weights, biases and main-grad buffers must start on 16-byte boundaries";
  if (input.size(0) > INT32_MAX || rows > INT32_MAX) return "it takes fewer than 2^31 rows";
  return nullptr;
}

at::Tensor device_splits(const SplitSizes& m_splits, const at::Tensor& input) {
  if (m_splits.has_device()) return m_splits.device();
  // Through pinned memory, so that the copy is asynchronous (the allocator keeps the block until
  // the copy has run).
  const c10::IntArrayRef host = m_splits.host();
  at::Tensor pinned = at::empty({static_cast<int64_t>(host.size())},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), host.data(), host.size() * sizeof(int64_t));
  return pinned.to(input.device(), /*non_blocking=*/true);
}

void sm90_forward(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& gather_rows,
                  const CheckedGroups& weights, const CheckedGroups& biases, at::Tensor& output,
                  const RowScatter& scatter) {
  if (plan.rows == 0) return;
  const at::Tensor x = aligned_operand(input);
  auto p = device_split_params<kernels::Sm90GemmParams>(kernels::GemmKind::kFprop, plan);
  set_input(p, x, gather_rows);
  set_scatter(p, scatter);
  p.output = output.data_ptr();
  set_weights(p, weights);
  p.bias = group_address(biases);
  launch(x, p);
}

void sm90_dgrad(const GemmPlan& plan, const at::Tensor& grad_output, const CheckedGroups& weights,
                at::Tensor& grad_input, const RowScatter& scatter) {
  if (plan.rows == 0) return;
  const at::Tensor dy = aligned_operand(grad_output);
  auto p = device_split_params<kernels::Sm90GemmParams>(kernels::GemmKind::kDgrad, plan);
  p.grad_output = dy.const_data_ptr();
  set_scatter(p, scatter);
  p.output = grad_input.data_ptr();
  set_weights(p, weights);
  launch(dy, p);
}

void sm90_wgrad(const GemmPlan& plan, const at::Tensor& input, const at::Tensor& gather_rows,
                const at::Tensor& grad_output, const CheckedGroups& weight_grads, bool accumulate) {
  TORCH_CHECK(weight_grads.aligned, "torchmoe grouped GEMM: the sm90 backend needs weight ",
              "gradient buffers that start on 16-byte boundaries");
  if (plan.rows == 0) {  // nothing to read: every group is empty
    if (!accumulate) {
      for (size_t g = 0; g < weight_grads.size(); ++g) weight_grads.tensors[g].zero_();
    }
    return;
  }
  const at::Tensor x = aligned_operand(input), dy = aligned_operand(grad_output);
  auto p = device_split_params<kernels::Sm90GemmParams>(kernels::GemmKind::kWgrad, plan);
  p.output_type = kernel_type(weight_grads.tensors[0].scalar_type());
  set_input(p, x, gather_rows);
  p.grad_output = dy.const_data_ptr();
  p.weight_grad = group_address(weight_grads);
  p.accumulate = accumulate;
  launch(x, p);
}

void sm90_fp8(const at::Tensor& like, kernels::Sm90Fp8GemmParams p) {
  const c10::cuda::CUDAGuard guard(like.device());
  // wgrad's group maps and tile counter: one buffer from the caching allocator, as launch()'s
  // counter. The allocator's blocks start 512-byte aligned, as the maps need.
  at::Tensor workspace;
  if (p.kind == kernels::GemmKind::kWgrad) {
    const int64_t map_bytes = p.num_groups * static_cast<int64_t>(kernels::kSm90Fp8MapBytes);
    workspace =
        new_empty({map_bytes + static_cast<int64_t>(sizeof(int))}, like.options().dtype(at::kByte));
    p.group_maps = workspace.data_ptr();
    p.tile_counter = reinterpret_cast<int*>(workspace.data_ptr<uint8_t>() + map_bytes);
  }
  kernels::launch_grouped_gemm_sm90_fp8(p, at::cuda::getCurrentCUDAStream().stream());
}

void device_bias_grad(const GemmPlan& plan, const at::Tensor& grad_output,
                      const CheckedGroups& bias_grads) {
  const c10::cuda::CUDAGuard guard(grad_output.device());
  const at::Tensor& splits = plan.m_splits.device();
  kernels::GroupedColumnSumParams p;
  p.type = kernel_type(grad_output.scalar_type());
  p.num_groups = static_cast<int>(bias_grads.size());
  p.rows = grad_output.size(0);
  p.n = grad_output.size(1);
  p.m_splits = splits.const_data_ptr();
  p.splits_int32 = splits.scalar_type() == at::kInt;
  p.grad_output = grad_output.const_data_ptr();
  p.bias_grad = group_address(bias_grads);
  kernels::launch_grouped_column_sum(p, at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace torchmoe::ops::detail
