#include "torchmoe/ops/grouped_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/cuda/CUDAGraphsUtils.cuh>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "torchmoe/kernels/grouped_gemm_cublaslt.h"
#include "torchmoe/kernels/grouped_gemm_sm90.h"
#include "torchmoe/ops/kernel_types.h"

namespace torchmoe::ops {
namespace {

// ---- validation shared by every backend --------------------------------------------------------

void check_host_splits(const char* op, c10::IntArrayRef m_splits, size_t num_groups, int64_t rows) {
  TORCH_CHECK(m_splits.size() == num_groups, op, ": m_splits must have one entry per group (",
              num_groups, "), got ", m_splits.size());
  int64_t sum = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    TORCH_CHECK(m_splits[g] >= 0, op, ": m_splits[", g, "] must be non-negative, got ",
                m_splits[g]);
    sum += m_splits[g];
  }
  TORCH_CHECK(sum == rows, op, ": m_splits must sum to the number of rows (", rows, "), got ",
              m_splits, " (sum ", sum, ")");
}

// Device sizes can only be checked for what the host knows without a copy.
void check_device_splits(const char* op, const at::Tensor& m_splits, size_t num_groups,
                         const at::Tensor& like) {
  TORCH_CHECK(m_splits.device() == like.device(), op, ": m_splits must be on ", like.device(),
              " like the input, or on the host, got ", m_splits.device());
  TORCH_CHECK(static_cast<size_t>(m_splits.numel()) == num_groups, op,
              ": m_splits must have one entry per group (", num_groups, "), got ",
              m_splits.numel());
}

// Tensor g of a per-group list named `what`. The messages name it `what[g]` and are only
// formatted on failure: building names for 128 experts on every call cost microseconds.
void check_group_tensor(const char* op, const char* what, size_t g, const at::Tensor& t,
                        const at::Tensor& like, c10::IntArrayRef shape, at::ScalarType dtype,
                        const char* dtype_rule) {
  TORCH_CHECK(t.defined(), op, ": ", what, "[", g, "] must be a defined tensor");
  TORCH_CHECK(t.device() == like.device(), op, ": ", what, "[", g, "] must be on ", like.device(),
              " like the input, got ", t.device());
  TORCH_CHECK(t.sizes() == shape, op, ": ", what, "[", g, "] must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", what, "[", g, "] must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", what, "[", g, "] must have ", dtype_rule, " ",
              dtype, ", got ", t.scalar_type());
}

void check_rows_operand(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined() && t.dim() == 2, op, ": ", name, " must be a 2-D [rows, features] tensor",
              t.defined() ? ", got " + std::to_string(t.dim()) + "-D" : std::string());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), op, ": ", name,
              " must have a floating dtype, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// What the checking pass over a per-group tensor list also finds: whether every tensor starts on a
// 16-byte boundary, and whether they are equally spaced (views of one buffer), which lets the sm90
// kernel address them by a base and a stride.
struct GroupLayout {
  bool aligned = true;
  kernels::GroupAddress spaced;  // base and group_stride when equally spaced, else empty
};

// Checks every tensor of `tensors` (check_group_tensor) and finds their layout in the same pass:
// with 128 experts, separate passes over the list were a visible part of a forward's host time.
GroupLayout check_group_list(const char* op, const char* what, at::TensorList tensors,
                             const at::Tensor& like, c10::IntArrayRef shape, at::ScalarType dtype,
                             const char* dtype_rule) {
  GroupLayout layout;
  intptr_t base = 0, step = 0;
  bool spaced = true;
  for (size_t g = 0; g < tensors.size(); ++g) {
    check_group_tensor(op, what, g, tensors[g], like, shape, dtype, dtype_rule);
    const auto address = reinterpret_cast<intptr_t>(tensors[g].const_data_ptr());
    layout.aligned &= address % 16 == 0;
    if (g == 0) {
      base = address;
      step = tensors.size() > 1 ? 0 : tensors[0].numel() * tensors[0].element_size();
    } else if (g == 1) {
      step = address - base;
    }
    spaced &= address == base + static_cast<intptr_t>(g) * step;
  }
  if (!tensors.empty() && spaced && step > 0 && step % 16 == 0) {
    layout.spaced.base = tensors[0].const_data_ptr();
    layout.spaced.group_stride = step / tensors[0].element_size();
  }
  return layout;
}

// Weights: G tensors [n, k] of the operand's dtype and device.
struct CheckedWeights {
  int64_t n, k;
  GroupLayout layout;
};

CheckedWeights check_weights(const char* op, at::TensorList weights, const at::Tensor& like) {
  TORCH_CHECK(!weights.empty(), op, ": weights must hold at least one tensor");
  TORCH_CHECK(weights[0].defined() && weights[0].dim() == 2, op,
              ": weights must be 2-D [out_features, in_features] tensors");
  const int64_t n = weights[0].size(0), k = weights[0].size(1);
  return {n, k,
          check_group_list(op, "weights", weights, like, {n, k}, like.scalar_type(),
                           "the input's dtype")};
}

GroupLayout check_vectors(const char* op, const char* what, at::TensorList vectors,
                          size_t num_groups, int64_t n, const at::Tensor& like) {
  if (vectors.empty()) return {};
  TORCH_CHECK(vectors.size() == num_groups, op, ": ", what,
              " must be empty or hold one tensor per ", "group (", num_groups, "), got ",
              vectors.size());
  return check_group_list(op, what, vectors, like, {n}, like.scalar_type(), "the input's dtype");
}

// ---- CUDA: cuBLASLt ---------------------------------------------------------------------------

// Streams a grouped GEMM may spread over (the caller's plus side streams). TE uses 4; measured
// trade-offs are in docs/performance.md. TORCHMOE_CUBLASLT_STREAMS overrides (1 = no side streams).
size_t cublaslt_stream_count() {
  static const size_t count = [] {
    const char* env = std::getenv("TORCHMOE_CUBLASLT_STREAMS");
    if (env == nullptr) return size_t{4};
    const long value = std::strtol(env, nullptr, 10);
    TORCH_CHECK(value >= 1 && value <= 32, "TORCHMOE_CUBLASLT_STREAMS must be in [1, 32], got '",
                env, "'");
    return static_cast<size_t>(value);
  }();
  return count;
}

// Runs the groups through cuBLASLt on the current stream of the operands' device. The workspace is
// taken from the caching allocator, so it is recycled between calls and stream-ordered.
kernels::GroupedGemmResult run_cublaslt(const at::Tensor& like, kernels::GroupedGemmParams params) {
  const c10::cuda::CUDAGuard guard(like.device());
  params.allow_tf32 = at::globalContext().allowTF32CuBLAS();
  size_t nonempty = 0;
  for (const auto& g : params.groups) nonempty += g.rows > 0;
  const size_t num_streams = std::max<size_t>(1, std::min(cublaslt_stream_count(), nonempty));

  kernels::CublasLtEnv env;
  env.handle = at::cuda::getCurrentCUDABlasLtHandle();
  env.stream = at::cuda::getCurrentCUDAStream().stream();
  for (size_t i = 1; i < num_streams; ++i) {
    env.side_streams.push_back(at::cuda::getStreamFromPool(false, like.device().index()).stream());
  }
  // cuBLASLt's Hopper kernels want up to 32 MiB each; older GPUs need far less.
  const size_t per_stream =
      at::cuda::getCurrentDeviceProperties()->major >= 9 ? (32u << 20) : (4u << 20);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(per_stream * num_streams)}, like.options().dtype(at::kByte));
  env.workspace = workspace.data_ptr();
  env.workspace_bytes = per_stream * num_streams;
  return kernels::run_grouped_gemm_cublaslt(params, env);
}

const void* rows_at(const at::Tensor& t, int64_t row) {
  return static_cast<const char*>(t.const_data_ptr()) + row * t.size(1) * t.element_size();
}

void* mutable_rows_at(at::Tensor& t, int64_t row) {
  return static_cast<char*>(t.data_ptr()) + row * t.size(1) * t.element_size();
}

// Calls fn(g, first_row, rows) for every group, in order.
template <typename Fn>
void for_each_group(c10::IntArrayRef m_splits, Fn&& fn) {
  int64_t first_row = 0;
  for (size_t g = 0; g < m_splits.size(); ++g) {
    fn(g, first_row, m_splits[g]);
    first_row += m_splits[g];
  }
}

kernels::GroupedGemmParams gemm_params(kernels::GemmKind kind, int64_t n, int64_t k,
                                       at::ScalarType input_type, at::ScalarType output_type) {
  kernels::GroupedGemmParams params;
  params.kind = kind;
  params.n = n;
  params.k = k;
  params.input_type = kernel_type(input_type);
  params.output_type = kernel_type(output_type);
  return params;
}

// ---- CUDA: torchmoe's sm90 kernel -------------------------------------------------------------

GemmBackendChoice env_backend_choice() {
  static const GemmBackendChoice choice = [] {
    const char* env = std::getenv("TORCHMOE_GROUPED_GEMM_BACKEND");
    if (env == nullptr || std::strcmp(env, "auto") == 0) return GemmBackendChoice::kAuto;
    if (std::strcmp(env, "cublaslt") == 0) return GemmBackendChoice::kCublasLt;
    if (std::strcmp(env, "sm90") == 0) return GemmBackendChoice::kSm90;
    TORCH_CHECK(false, "TORCHMOE_GROUPED_GEMM_BACKEND must be auto, cublaslt or sm90, got '", env,
                "'");
  }();
  return choice;
}

// Why the sm90 kernel cannot take this call, or nullptr when it can.
const char* sm90_refusal(const at::Tensor& operand, const GemmShape& shape) {
  if (operand.scalar_type() != at::kBFloat16 && operand.scalar_type() != at::kHalf) {
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
  if (!shape.aligned) return "every operand must start on a 16-byte boundary";
  if (operand.size(0) > INT32_MAX) return "it takes fewer than 2^31 rows";
  return nullptr;
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

// The tensors' data pointers as bytes: what identifies a per-group table of them.
std::string pointer_bytes(at::TensorList tensors) {
  std::string bytes(tensors.size() * sizeof(void*), '\0');
  for (size_t g = 0; g < tensors.size(); ++g) {
    const void* p = tensors[g].const_data_ptr();
    std::memcpy(bytes.data() + g * sizeof(void*), &p, sizeof(void*));
  }
  return bytes;
}

// Small device tables (tensor maps, pointer arrays), kept per device for the life of the process
// and keyed by what determines their content: the same weights or gradient buffers give the same
// table on every call, so make_bytes() runs and the upload happens once, and a CUDA graph may keep
// the pointer it captured.
template <typename MakeBytes>
const void* device_table(const std::string& key, const at::Device& device, MakeBytes&& make_bytes) {
  static std::mutex mutex;
  static std::unordered_map<std::string, at::Tensor> tables;
  const std::string device_key = std::to_string(device.index()) + ":" + key;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = tables.find(device_key);
  if (it == tables.end()) {
    TORCH_CHECK(at::cuda::currentStreamCaptureStatus() == at::cuda::CaptureStatus::None,
                "torchmoe grouped GEMM: new weight or gradient tensors were seen during CUDA graph "
                "capture; run the step once before capturing (their address table is built then)");
    const std::string bytes = make_bytes();
    at::Tensor host = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
    it = tables.emplace(device_key, host.to(device)).first;
    if (tables.size() == 4096) {
      TORCH_WARN(
          "torchmoe grouped GEMM: 4096 address tables cached; are weight or gradient "
          "buffers reallocated every step? (each new set adds one)");
    }
  }
  return it->second.const_data_ptr();
}

// Where each group's tensor lives: one base and a stride when the tensors are equally spaced
// (views of one buffer; `layout` from check_group_list), else a device table of pointers.
kernels::GroupAddress group_address(at::TensorList tensors, const GroupLayout& layout) {
  if (tensors.empty() || layout.spaced.base != nullptr) return layout.spaced;
  const std::string bytes = pointer_bytes(tensors);
  kernels::GroupAddress address;
  address.table = static_cast<const void* const*>(
      device_table("pointers " + bytes, tensors[0].device(), [&] { return bytes; }));
  return address;
}

// The split sizes as the kernel reads them: int32 or int64 on the operands' device.
at::Tensor kernel_splits(const GroupSplits& m_splits, const at::Tensor& like) {
  if (m_splits.on_device()) {
    const at::Tensor& d = m_splits.device();
    return d.scalar_type() == at::kInt || d.scalar_type() == at::kLong ? d : d.to(at::kLong);
  }
  // Through pinned memory, so that the copy is asynchronous (the allocator keeps the block until
  // the copy has run).
  at::Tensor pinned = at::empty({static_cast<int64_t>(m_splits.size())},
                                at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), m_splits.host().data(), m_splits.size() * sizeof(int64_t));
  return pinned.to(like.device(), /*non_blocking=*/true);
}

// The sizes on the host (one copy for device sizes), checked: for the backends that loop over
// groups on the host.
std::vector<int64_t> checked_host_splits(const char* op, const GroupSplits& m_splits,
                                         size_t num_groups, int64_t rows) {
  std::vector<int64_t> host = m_splits.to_host();
  check_host_splits(op, host, num_groups, rows);
  return host;
}

// Checks the sizes for an sm90 call and returns them as the kernel reads them.
at::Tensor checked_kernel_splits(const char* op, const GroupSplits& m_splits, size_t num_groups,
                                 const at::Tensor& like) {
  if (m_splits.on_device()) {
    check_device_splits(op, m_splits.device(), num_groups, like);
  } else {
    check_host_splits(op, m_splits.host(), num_groups, like.size(0));
  }
  return kernel_splits(m_splits, like);
}

kernels::Sm90GemmParams sm90_params(kernels::GemmKind kind, const at::Tensor& like, int64_t n,
                                    int64_t k, size_t groups, const at::Tensor& splits) {
  kernels::Sm90GemmParams p;
  p.kind = kind;
  p.input_type = kernel_type(like.scalar_type());
  p.output_type = p.input_type;
  p.num_groups = static_cast<int>(groups);
  p.rows = like.size(0);
  p.n = n;
  p.k = k;
  p.m_splits = splits.const_data_ptr();
  p.splits_int32 = splits.scalar_type() == at::kInt;
  return p;
}

// The weights as the kernel reads them: one 3-D tensor map over equally spaced weights (built per
// launch), or a cached device table of per-group maps. A map depends only on the kind, dtype,
// shape and address, so those are the table's key and its G driver encodes run once per set of
// weights, not on every call.
void set_weights(kernels::Sm90GemmParams& p, at::TensorList weights, const GroupLayout& layout) {
  if (layout.spaced.base != nullptr) {
    p.weight = layout.spaced;
    return;
  }
  const std::string key = "weight maps " + std::to_string(static_cast<int>(p.kind)) + " " +
                          std::to_string(static_cast<int>(p.input_type)) + " " +
                          std::to_string(p.n) + " " + std::to_string(p.k) + " " +
                          pointer_bytes(weights);
  p.weight_maps = device_table(key, weights[0].device(), [&] {
    std::vector<const void*> pointers;
    for (const at::Tensor& w : weights) pointers.push_back(w.const_data_ptr());
    const std::vector<uint8_t> maps =
        kernels::encode_weight_maps(p.kind, p.input_type, p.n, p.k, pointers);
    return std::string(maps.begin(), maps.end());
  });
}

void run_sm90(const at::Tensor& like, kernels::Sm90GemmParams params) {
  const c10::cuda::CUDAGuard guard(like.device());
  // wgrad's tile counter: from the caching allocator, so it is stream-ordered (and part of a
  // captured graph's pool) like every other buffer of the call.
  at::Tensor counter;
  if (params.kind == kernels::GemmKind::kWgrad) {
    counter = at::empty({1}, like.options().dtype(at::kInt));
    params.tile_counter = counter.mutable_data_ptr<int>();
  }
  kernels::launch_grouped_gemm_sm90(params, at::cuda::getCurrentCUDAStream().stream());
}

void column_sums_sm90(const at::Tensor& grad_output, const at::Tensor& splits,
                      at::TensorList bias_grads_out, const GroupLayout& layout) {
  const c10::cuda::CUDAGuard guard(grad_output.device());
  kernels::GroupedColumnSumParams p;
  p.type = kernel_type(grad_output.scalar_type());
  p.num_groups = static_cast<int>(bias_grads_out.size());
  p.rows = grad_output.size(0);
  p.n = grad_output.size(1);
  p.m_splits = splits.const_data_ptr();
  p.splits_int32 = splits.scalar_type() == at::kInt;
  p.grad_output = grad_output.const_data_ptr();
  p.bias_grad = group_address(bias_grads_out, layout);
  kernels::launch_grouped_column_sum(p, at::cuda::getCurrentCUDAStream().stream());
}

}  // namespace

GemmBackend select_backend(const at::Tensor& operand, const GemmShape& shape,
                           GemmBackendChoice choice) {
  const at::ScalarType dtype = operand.scalar_type();
  if (choice == GemmBackendChoice::kAuto) choice = env_backend_choice();
  if (operand.is_cpu() && at::isFloatingType(dtype)) {
    TORCH_CHECK_NOT_IMPLEMENTED(choice == GemmBackendChoice::kAuto, "torchmoe grouped GEMM: the ",
                                choice == GemmBackendChoice::kSm90 ? "sm90" : "cublaslt",
                                " backend runs on CUDA tensors only, got ", operand.device());
    return GemmBackend::kReference;
  }
  if (operand.is_cuda() && (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16)) {
    if (choice == GemmBackendChoice::kCublasLt) return GemmBackend::kCublasLt;
    const char* refusal = sm90_refusal(operand, shape);
    if (refusal == nullptr) return GemmBackend::kSm90;
    TORCH_CHECK_NOT_IMPLEMENTED(choice == GemmBackendChoice::kAuto,
                                "torchmoe grouped GEMM: the sm90 backend cannot run this call: ",
                                refusal, " (dtype ", dtype, ", out_features ", shape.n,
                                ", in_features ", shape.k, ", ", shape.groups, " groups)");
    return GemmBackend::kCublasLt;
  }
  TORCH_CHECK_NOT_IMPLEMENTED(false, "torchmoe grouped GEMM: no backend for ", operand.device(),
                              " tensors of dtype ", dtype,
                              " (supported: CPU floating dtypes; CUDA float32, float16, bfloat16)");
}

GroupSplits::GroupSplits(const at::Tensor& sizes) {
  TORCH_CHECK(sizes.defined(), "m_splits must be a defined tensor");
  TORCH_CHECK(sizes.dim() == 1, "m_splits must be a 1-D tensor, got ", sizes.dim(), "-D");
  TORCH_CHECK(at::isIntegralType(sizes.scalar_type(), /*includeBool=*/false),
              "m_splits must have an integer dtype, got ", sizes.scalar_type());
  if (sizes.is_cuda()) {
    device_ = sizes.contiguous();
    return;
  }
  const at::Tensor host = sizes.to(at::kLong).contiguous();
  const int64_t* data = host.const_data_ptr<int64_t>();
  host_.assign(data, data + host.numel());
}

size_t GroupSplits::size() const {
  return on_device() ? static_cast<size_t>(device_.numel()) : host_.size();
}

c10::IntArrayRef GroupSplits::host() const {
  TORCH_INTERNAL_ASSERT(!on_device(), "GroupSplits::host: the sizes are on the device");
  return host_;
}

std::vector<int64_t> GroupSplits::to_host() const {
  if (!on_device()) return host_;
  const at::Tensor host = device_.to(at::kCPU, at::kLong);
  const int64_t* data = host.const_data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + host.numel());
}

GroupSplits resolve_splits(const GroupSplits& m_splits, const at::Tensor& input,
                           at::TensorList weights, GemmBackendChoice choice) {
  if (!m_splits.on_device() || weights.empty()) return m_splits;
  bool aligned = aligned16(input);
  for (const at::Tensor& w : weights) aligned &= aligned16(w);
  const GemmShape shape{weights[0].size(0), weights[0].size(1), weights.size(), aligned};
  if (select_backend(input, shape, choice) == GemmBackend::kSm90) return m_splits;
  return GroupSplits(m_splits.to_host());
}

at::Tensor grouped_linear_forward(const at::Tensor& input, const GroupSplits& m_splits,
                                  at::TensorList weights, at::TensorList biases,
                                  GemmBackendChoice choice) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_forward";
  check_rows_operand(op, "input", input);
  const auto [n, k, weight_layout] = check_weights(op, weights, input);
  TORCH_CHECK(input.size(1) == k, op, ": input must have ", k, " features (weights are [", n, ", ",
              k, "]), got ", input.size(1));
  const GroupLayout bias_layout = check_vectors(op, "biases", biases, weights.size(), n, input);

  at::Tensor output = at::empty({input.size(0), n}, input.options());
  const GemmShape shape{n, k, weights.size(), aligned16(input) && weight_layout.aligned};
  switch (select_backend(input, shape, choice)) {
    case GemmBackend::kSm90: {
      const at::Tensor splits = checked_kernel_splits(op, m_splits, weights.size(), input);
      if (input.size(0) == 0) return output;
      kernels::Sm90GemmParams p =
          sm90_params(kernels::GemmKind::kFprop, input, n, k, weights.size(), splits);
      p.input = input.const_data_ptr();
      p.output = output.data_ptr();
      set_weights(p, weights, weight_layout);
      p.bias = group_address(biases, bias_layout);
      run_sm90(input, p);
      return output;
    }
    case GemmBackend::kReference: {
      const auto host = checked_host_splits(op, m_splits, weights.size(), input.size(0));
      for_each_group(host, [&](size_t g, int64_t first, int64_t rows) {
        if (rows == 0) return;
        at::Tensor out_g = output.narrow(0, first, rows);
        const at::Tensor in_g = input.narrow(0, first, rows);
        if (biases.empty()) {
          at::mm_out(out_g, in_g, weights[g].t());
        } else {
          at::addmm_out(out_g, biases[g], in_g, weights[g].t());
        }
      });
      return output;
    }
    case GemmBackend::kCublasLt: {
      const auto host = checked_host_splits(op, m_splits, weights.size(), input.size(0));
      auto params =
          gemm_params(kernels::GemmKind::kFprop, n, k, input.scalar_type(), input.scalar_type());
      for_each_group(host, [&](size_t g, int64_t first, int64_t rows) {
        kernels::GemmGroup group;
        group.rows = rows;
        group.input = rows_at(input, first);
        group.weight = weights[g].const_data_ptr();
        group.output = mutable_rows_at(output, first);
        group.bias = biases.empty() ? nullptr : biases[g].const_data_ptr();
        params.groups.push_back(group);
      });
      run_cublaslt(input, std::move(params));
      return output;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GemmBackend");
}

at::Tensor grouped_linear_dgrad(const at::Tensor& grad_output, const GroupSplits& m_splits,
                                at::TensorList weights, GemmBackendChoice choice) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_dgrad";
  check_rows_operand(op, "grad_output", grad_output);
  const auto [n, k, weight_layout] = check_weights(op, weights, grad_output);
  TORCH_CHECK(grad_output.size(1) == n, op, ": grad_output must have ", n,
              " features (weights are [", n, ", ", k, "]), got ", grad_output.size(1));

  at::Tensor grad_input = at::empty({grad_output.size(0), k}, grad_output.options());
  const GemmShape shape{n, k, weights.size(), aligned16(grad_output) && weight_layout.aligned};
  switch (select_backend(grad_output, shape, choice)) {
    case GemmBackend::kSm90: {
      const at::Tensor splits = checked_kernel_splits(op, m_splits, weights.size(), grad_output);
      if (grad_output.size(0) == 0) return grad_input;
      kernels::Sm90GemmParams p =
          sm90_params(kernels::GemmKind::kDgrad, grad_output, n, k, weights.size(), splits);
      p.grad_output = grad_output.const_data_ptr();
      p.output = grad_input.data_ptr();
      set_weights(p, weights, weight_layout);
      run_sm90(grad_output, p);
      return grad_input;
    }
    case GemmBackend::kReference: {
      const auto host = checked_host_splits(op, m_splits, weights.size(), grad_output.size(0));
      for_each_group(host, [&](size_t g, int64_t first, int64_t rows) {
        if (rows == 0) return;
        at::Tensor out_g = grad_input.narrow(0, first, rows);
        at::mm_out(out_g, grad_output.narrow(0, first, rows), weights[g]);
      });
      return grad_input;
    }
    case GemmBackend::kCublasLt: {
      const auto host = checked_host_splits(op, m_splits, weights.size(), grad_output.size(0));
      auto params = gemm_params(kernels::GemmKind::kDgrad, n, k, grad_output.scalar_type(),
                                grad_output.scalar_type());
      for_each_group(host, [&](size_t g, int64_t first, int64_t rows) {
        kernels::GemmGroup group;
        group.rows = rows;
        group.grad_output = rows_at(grad_output, first);
        group.weight = weights[g].const_data_ptr();
        group.output = mutable_rows_at(grad_input, first);
        params.groups.push_back(group);
      });
      run_cublaslt(grad_output, std::move(params));
      return grad_input;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GemmBackend");
}

void grouped_bias_grad(const at::Tensor& grad_output, const GroupSplits& m_splits,
                       at::TensorList bias_grads_out) {
  constexpr const char* op = "torchmoe::ops::grouped_bias_grad";
  check_rows_operand(op, "grad_output", grad_output);
  TORCH_CHECK(!bias_grads_out.empty(), op, ": bias_grads_out must hold one tensor per group");
  const GroupLayout layout = check_vectors(op, "bias_grads_out", bias_grads_out,
                                           bias_grads_out.size(), grad_output.size(1), grad_output);
  if (m_splits.on_device()) {
    // Device sizes (the sm90 path): one kernel reads them; fp32 sums, one rounding, zeros for an
    // empty group, as below.
    TORCH_CHECK(grad_output.size(1) % 2 == 0 && grad_output.scalar_type() != at::kDouble, op,
                ": device m_splits need an even number of bfloat16/float16/float32 features");
    const at::Tensor splits =
        checked_kernel_splits(op, m_splits, bias_grads_out.size(), grad_output);
    column_sums_sm90(grad_output, splits, bias_grads_out, layout);
    return;
  }
  check_host_splits(op, m_splits.host(), bias_grads_out.size(), grad_output.size(0));
  // One reduction per group on every backend: at::sum accumulates in fp32 for 16-bit inputs and
  // rounds once, and returns zeros for an empty group.
  for_each_group(m_splits.host(), [&](size_t g, int64_t first, int64_t rows) {
    at::Tensor out_g = bias_grads_out[g];
    at::sum_out(out_g, grad_output.narrow(0, first, rows), {0});
  });
}

void grouped_linear_wgrad(const at::Tensor& input, const at::Tensor& grad_output,
                          const GroupSplits& m_splits, at::TensorList weight_grads_out,
                          bool accumulate, at::TensorList bias_grads_out,
                          GemmBackendChoice choice) {
  constexpr const char* op = "torchmoe::ops::grouped_linear_wgrad";
  check_rows_operand(op, "input", input);
  check_rows_operand(op, "grad_output", grad_output);
  TORCH_CHECK(grad_output.device() == input.device(), op, ": grad_output must be on ",
              input.device(), " like the input, got ", grad_output.device());
  TORCH_CHECK(grad_output.scalar_type() == input.scalar_type(), op,
              ": grad_output must have the input's dtype ", input.scalar_type(), ", got ",
              grad_output.scalar_type());
  TORCH_CHECK(grad_output.size(0) == input.size(0), op, ": grad_output must have the input's ",
              input.size(0), " rows, got ", grad_output.size(0));
  TORCH_CHECK(!weight_grads_out.empty(), op, ": weight_grads_out must hold one tensor per group");
  const int64_t n = grad_output.size(1), k = input.size(1);
  const at::ScalarType grad_type = weight_grads_out[0].scalar_type();
  TORCH_CHECK(grad_type == input.scalar_type() || grad_type == at::kFloat, op,
              ": weight_grads_out must have the input's dtype ", input.scalar_type(),
              " or float32, got ", grad_type);
  // Adding into a 16-bit buffer would round twice (cuBLASLt's beta = 1 epilogue was measured
  // rounding the product before the add); accumulation is for fp32 main-grad buffers.
  TORCH_CHECK(!accumulate || grad_type == at::kFloat || grad_type == at::kDouble, op,
              ": accumulate requires float32 (or float64) weight_grads_out, got ", grad_type);
  const GroupLayout grad_layout =
      check_group_list(op, "weight_grads_out", weight_grads_out, input, {n, k}, grad_type,
                       "weight_grads_out[0]'s dtype");
  const GroupLayout bias_layout =
      check_vectors(op, "bias_grads_out", bias_grads_out, weight_grads_out.size(), n, input);

  const GemmShape shape{n, k, weight_grads_out.size(),
                        aligned16(input) && aligned16(grad_output) && grad_layout.aligned};
  switch (select_backend(input, shape, choice)) {
    case GemmBackend::kSm90: {
      const at::Tensor splits = checked_kernel_splits(op, m_splits, weight_grads_out.size(), input);
      if (input.size(0) == 0) {  // no rows at all: nothing to read, every group is empty
        if (!accumulate) {
          for (const at::Tensor& out : weight_grads_out) out.zero_();
        }
      } else {
        kernels::Sm90GemmParams p =
            sm90_params(kernels::GemmKind::kWgrad, input, n, k, weight_grads_out.size(), splits);
        p.output_type = kernel_type(grad_type);
        p.input = input.const_data_ptr();
        p.grad_output = grad_output.const_data_ptr();
        p.weight_grad = group_address(weight_grads_out, grad_layout);
        p.accumulate = accumulate;
        run_sm90(input, p);
      }
      if (!bias_grads_out.empty()) {
        column_sums_sm90(grad_output, splits, bias_grads_out, bias_layout);
      }
      return;
    }
    case GemmBackend::kReference: {
      const auto host = checked_host_splits(op, m_splits, weight_grads_out.size(), input.size(0));
      // Multiply in the wider of the operand and buffer types, so that fp32 main-grad receives
      // one rounding, as on the GPU.
      const at::ScalarType compute_type = at::promote_types(input.scalar_type(), grad_type);
      for_each_group(host, [&](size_t g, int64_t first, int64_t rows) {
        if (rows == 0 && accumulate) return;
        at::Tensor out_g = weight_grads_out[g];
        const at::Tensor product = at::mm(grad_output.narrow(0, first, rows).t().to(compute_type),
                                          input.narrow(0, first, rows).to(compute_type));
        accumulate ? out_g.add_(product) : out_g.copy_(product);
      });
      if (!bias_grads_out.empty()) grouped_bias_grad(grad_output, host, bias_grads_out);
      return;
    }
    case GemmBackend::kCublasLt: {
      const auto host = checked_host_splits(op, m_splits, weight_grads_out.size(), input.size(0));
      auto params = gemm_params(kernels::GemmKind::kWgrad, n, k, input.scalar_type(), grad_type);
      params.accumulate = accumulate;
      for_each_group(host, [&](size_t g, int64_t first, int64_t rows) {
        kernels::GemmGroup group;
        group.rows = rows;
        group.input = rows_at(input, first);
        group.grad_output = rows_at(grad_output, first);
        group.output = weight_grads_out[g].data_ptr();
        group.bias_grad = bias_grads_out.empty() ? nullptr : bias_grads_out[g].data_ptr();
        params.groups.push_back(group);
      });
      const kernels::GroupedGemmResult result = run_cublaslt(input, std::move(params));
      if (!bias_grads_out.empty() && !result.bias_grad_computed) {
        grouped_bias_grad(grad_output, host, bias_grads_out);
      }
      return;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled GemmBackend");
}

}  // namespace torchmoe::ops
