// One-launch grouped GEMM for sm_90a; see grouped_gemm_sm90.h for the problem and the contract.
// This file is the host side: tensor maps (encoded through the driver, reached at run time), the
// per-device shared-memory opt-in, the availability check and the launch. The device code is in
// grouped_gemm_sm90_kernel.cuh and the headers it includes (_layout: block shape and shared
// memory; _schedule: tile order; _epilogue: scaling, bias and stores; _ptx: instruction
// wrappers), compiled in this file only.

#include "torchmoe/kernels/grouped_gemm_sm90.h"

#include <cuda.h>  // CUtensorMap and the encode signature only; the driver is reached at run time
#include <cudaTypedefs.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <unordered_map>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_kernel.cuh"
#include "torchmoe/kernels/grouped_gemm_sm90_layout.cuh"
#include "torchmoe/kernels/split_quantize.h"

namespace torchmoe::kernels {
namespace {

// The device side's names that the launcher uses.
using sm90::Accumulation;
using sm90::E4M3;
using sm90::E5M2;
using sm90::grouped_gemm_sm90_kernel;
using sm90::kBlockKBytes;
using sm90::kBlockKOf;
using sm90::kBlockM;
using sm90::kBlockN;
using sm90::kEpilogueRowBytes;
using sm90::KernelArgs;
using sm90::kThreads;
using sm90::Smem;

// A driver entry point, resolved once through the runtime (the library never links libcuda).
void* driver_entry_point(const char* name, int version) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  TORCHMOE_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &found));
  TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
              "torchmoe sm90 grouped GEMM: the CUDA driver has no ", name);
  return fn;
}

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(
      driver_entry_point("cuTensorMapEncodeTiled", 12000));
  return encode;
}

// cuTensorMapEncodeTiled needs a current context (else CUresult 201). The runtime binds the
// device's primary context to a thread lazily, on the first call that needs one, so a thread that
// so far made none (a new std::thread or an autograd worker whose tensors came from the caching
// allocator) has none yet; cudaSetDevice binds it.
void bind_current_context() {
  static const auto get_current =
      reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(driver_entry_point("cuCtxGetCurrent", 4000));
  CUcontext context = nullptr;
  TORCH_CHECK(get_current(&context) == CUDA_SUCCESS, "sm90 grouped GEMM: cuCtxGetCurrent failed");
  if (context != nullptr) return;
  int device = 0;
  TORCHMOE_CUDA_CHECK(cudaGetDevice(&device));
  TORCHMOE_CUDA_CHECK(cudaSetDevice(device));
}

// A tensor map's element type and its size in bytes.
struct MapType {
  CUtensorMapDataType type;
  int64_t bytes;
};

MapType map_type(ScalarType type) {
  switch (type) {
    case ScalarType::kBFloat16:
      return {CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2};
    case ScalarType::kFloat16:
      return {CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2};
    case ScalarType::kFloat32:
      return {CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4};
  }
  TORCH_INTERNAL_ASSERT(false, "sm90 grouped GEMM: unknown element type");
}

// FP8 operands are moved as bytes: TMA does not look at the values.
constexpr MapType kFp8MapType{CU_TENSOR_MAP_DATA_TYPE_UINT8, 1};

// Operand boxes are 128 bytes wide (128-byte swizzle, as wgmma reads them); epilogue boxes are
// 64 bytes wide (64-byte swizzle, as the consumers write them).
struct MapBox {
  int inner, rows;
  CUtensorMapSwizzle swizzle;
};

MapBox operand_box(MapType type, int rows) {
  return {kBlockKBytes / static_cast<int>(type.bytes), rows, CU_TENSOR_MAP_SWIZZLE_128B};
}

MapBox output_box(ScalarType type) {
  return {kEpilogueRowBytes / static_cast<int>(element_size(type)), 64, CU_TENSOR_MAP_SWIZZLE_64B};
}

// A row-major [groups, rows, inner] tensor (groups = 1 for a matrix) in boxes of
// {box.inner, box.rows, 1}; out-of-range elements read as zero and are not written.
CUtensorMap encode_map(MapType type, const void* base, int64_t inner, int64_t rows, int64_t groups,
                       int64_t group_stride, MapBox box) {
  const int64_t bytes = type.bytes;
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(base) % 16 == 0 && inner * bytes % 16 == 0 &&
                            group_stride * bytes % 16 == 0,
                        "sm90 grouped GEMM: tensors must be 16-byte aligned");
  bind_current_context();
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(groups)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(inner * bytes),
                                 static_cast<cuuint64_t>(group_stride * bytes)};
  const cuuint32_t box_dims[3] = {static_cast<cuuint32_t>(box.inner),
                                  static_cast<cuuint32_t>(box.rows), 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult status =
      tensor_map_encoder()(&map, type.type, 3, const_cast<void*>(base), dims, strides, box_dims,
                           element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, box.swizzle,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(status == CUDA_SUCCESS, "sm90 grouped GEMM: cuTensorMapEncodeTiled failed (CUresult ",
              static_cast<int>(status), ") for a [", groups, ", ", rows, ", ", inner, "] tensor");
  return map;
}

// Everything a tensor map is a function of.
struct MapKey {
  CUtensorMapDataType type;
  const void* base;
  int64_t inner, rows, groups, group_stride;
  int box_inner, box_rows;
  CUtensorMapSwizzle swizzle;

  auto fields() const {
    return std::tie(type, base, inner, rows, groups, group_stride, box_inner, box_rows, swizzle);
  }
  bool operator==(const MapKey& other) const { return fields() == other.fields(); }
};

struct MapKeyHash {
  size_t operator()(const MapKey& k) const {
    size_t h = std::hash<const void*>()(k.base);
    for (const int64_t v : {k.inner, k.rows, k.groups, k.group_stride, static_cast<int64_t>(k.type),
                            static_cast<int64_t>(k.box_inner), static_cast<int64_t>(k.box_rows),
                            static_cast<int64_t>(k.swizzle)}) {
      h = h * 1000003u ^ std::hash<int64_t>()(v);
    }
    return h;
  }
};

// encode_map through a per-thread table of the maps already encoded. Every launch needs two or
// three maps and an encode is a driver call; training passes the same tensors every step
// (parameters, and activations in the caching allocator's recycled blocks), so after the first
// step the launches find their maps here. The table is dropped whole at kMaxCachedMaps entries,
// which bounds it when addresses keep changing.
CUtensorMap cached_map(MapType type, const void* base, int64_t inner, int64_t rows, int64_t groups,
                       int64_t group_stride, MapBox box) {
  constexpr size_t kMaxCachedMaps = 4096;
  thread_local std::unordered_map<MapKey, CUtensorMap, MapKeyHash> maps;
  const MapKey key{type.type,    base,      inner,    rows,       groups,
                   group_stride, box.inner, box.rows, box.swizzle};
  if (const auto it = maps.find(key); it != maps.end()) return it->second;
  const CUtensorMap map = encode_map(type, base, inner, rows, groups, group_stride, box);
  if (maps.size() == kMaxCachedMaps) maps.clear();
  maps.emplace(key, map);
  return map;
}

// The weight box: K-major {64 k, 256 n} for fprop, MN-major {64 k, 64 n} for dgrad.
MapBox weight_box(GemmKind kind, MapType type) {
  return operand_box(type, kind == GemmKind::kFprop ? kBlockN : 64);
}

// The kernel's dynamic shared memory is above the default limit: the opt-in is per kernel and
// per device.
template <GemmKind kKind, typename TA, typename TB, typename OutT,
          Accumulation kAcc = Accumulation::kWhole>
auto* configured_kernel() {
  auto* kernel = grouped_gemm_sm90_kernel<kKind, TA, TB, OutT, kAcc>;
  allow_dynamic_shared(reinterpret_cast<const void*>(kernel),
                       Smem<kKind, kAcc == Accumulation::kBlockScaled>::kBytes);
  return kernel;
}

template <GemmKind kKind>
void zero_tile_counter(int* counter, cudaStream_t stream) {
  if constexpr (kKind == GemmKind::kWgrad) {
    TORCHMOE_CUDA_CHECK(cudaMemsetAsync(counter, 0, sizeof(int), stream));
  }
}

template <GemmKind kKind, typename T, typename OutT>
void launch(const Sm90GemmParams& p, cudaStream_t stream) {
  auto* kernel = configured_kernel<kKind, T, T, OutT>();
  KernelArgs args;
  std::memset(&args, 0, sizeof(args));
  args.p = p;
  const MapType in = map_type(p.input_type);
  // Gathered x is loaded a row per box from its source (the kernel's gather_stage).
  const bool gather = p.gather_rows != nullptr;
  const CUtensorMap gather_map =
      gather ? cached_map(in, p.input, p.k, p.gather_source_rows, 1, 0, operand_box(in, 1))
             : CUtensorMap{};
  // Scattered rows are added from the epilogue's threads: no map for the output.
  const bool scatter = p.scatter_rows != nullptr;
  if constexpr (kKind == GemmKind::kFprop) {
    args.a_map =
        gather ? gather_map : cached_map(in, p.input, p.k, p.rows, 1, 0, operand_box(in, kBlockM));
    args.out_tma = !scatter;
    if (!scatter)
      args.out_map = cached_map(in, p.output, p.n, p.rows, 1, 0, output_box(p.input_type));
  } else if constexpr (kKind == GemmKind::kDgrad) {
    args.a_map = cached_map(in, p.grad_output, p.n, p.rows, 1, 0, operand_box(in, kBlockM));
    args.out_tma = !scatter;
    if (!scatter)
      args.out_map = cached_map(in, p.output, p.k, p.rows, 1, 0, output_box(p.input_type));
  } else {
    const int block_k = kBlockKOf<T>;
    args.a_map = cached_map(in, p.grad_output, p.n, p.rows, 1, 0, operand_box(in, block_k));
    args.b_map =
        gather ? gather_map : cached_map(in, p.input, p.k, p.rows, 1, 0, operand_box(in, block_k));
    // Equally spaced gradients are one 3-D map; a pointer table's are stored from registers.
    args.out_tma = p.weight_grad.table == nullptr;
    if (args.out_tma) {
      args.out_map = cached_map(map_type(p.output_type), p.weight_grad.base, p.k, p.n, p.num_groups,
                                p.weight_grad.group_stride, output_box(p.output_type));
    }
  }
  if constexpr (kKind != GemmKind::kWgrad) {
    if (p.weight_maps == nullptr) {
      args.b_map = cached_map(in, p.weight.base, p.k, p.n, p.num_groups, p.weight.group_stride,
                              weight_box(kKind, in));
    }
  }
  zero_tile_counter<kKind>(p.tile_counter, stream);
  if (scatter) {  // the epilogue adds the rows into zeros
    const int64_t cols = kKind == GemmKind::kFprop ? p.n : p.k;
    TORCHMOE_CUDA_CHECK(cudaMemsetAsync(
        p.output, 0, static_cast<size_t>(p.scatter_target_rows * cols) * element_size(p.input_type),
        stream));
  }
  kernel<<<sm_count(), kThreads, Smem<kKind>::kBytes, stream>>>(args);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

// FP8 wgrad's per-group maps: a warp scans the clamped split sizes as split_quantize places the
// columnwise blocks (kernels/split_quantize.h) and writes, for group g, the templates with the
// block's address, width r16(m_g) and row stride (maps 2g: dyᵀ [n, ·], 2g + 1: xᵀ [k, ·]). A map
// is edited in shared memory (tensormap.replace) and copied out whole; the release fence orders
// the copies before the GEMM's TMA reads them through the tensormap proxy.
__global__ void build_wgrad_maps(const __grid_constant__ CUtensorMap a_template,
                                 const __grid_constant__ CUtensorMap b_template,
                                 const void* m_splits, bool splits_int32, int num_groups,
                                 int64_t rows, const uint8_t* a, const uint8_t* b, int64_t n,
                                 int64_t k, CUtensorMap* maps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __shared__ alignas(128) CUtensorMap edit[kWarpSize];
  const int lane = threadIdx.x;
  const int per_lane = (num_groups + kWarpSize - 1) / kWarpSize;
  const int first = min(num_groups, lane * per_lane), last = min(num_groups, first + per_lane);
  // Exclusive scans of the raw sizes (for the clamping) and of the padded widths.
  int64_t raw = 0;
  for (int g = first; g < last; ++g) raw += split_at(m_splits, splits_int32, g, rows);
  const int64_t raw_start = warp_inclusive_scan(raw) - raw;
  int64_t start = raw_start;
  int64_t width = 0;
  for (int g = first; g < last; ++g) {
    const int64_t split = split_at(m_splits, splits_int32, g, rows);
    const int64_t begin = min(start, rows);
    width += round_up_columnwise(min(split, rows - begin));
    start += split;
  }
  int64_t column = warp_inclusive_scan(width) - width;
  start = raw_start;
  const uint64_t edit_address = reinterpret_cast<uint64_t>(&edit[lane]);
  for (int g = first; g < last; ++g) {
    const int64_t split = split_at(m_splits, splits_int32, g, rows);
    const int64_t begin = min(start, rows);
    const int64_t padded = round_up_columnwise(min(split, rows - begin));
    start += split;
    // An empty group's maps are never read; they still get a valid width.
    const uint32_t dim = static_cast<uint32_t>(max(padded, int64_t{16}));
    for (int which = 0; which < 2; ++which) {
      edit[lane] = which == 0 ? a_template : b_template;
      const uint8_t* base = which == 0 ? a + n * column : b + k * column;
      asm volatile(
          "tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;\n"
          "tensormap.replace.tile.global_dim.shared::cta.b1024.b32 [%0], 0, %2;\n"
          "tensormap.replace.tile.global_stride.shared::cta.b1024.b64 [%0], 0, %3;" ::"l"(
              edit_address),
          "l"(reinterpret_cast<uint64_t>(base)), "r"(dim), "l"(static_cast<uint64_t>(dim))
          : "memory");
      maps[2 * g + which] = edit[lane];
    }
    column += padded;
  }
  sm90::tensormap_release();
#else
  __trap();
#endif
}

template <GemmKind kKind, typename TA, typename TB, typename OutT, Accumulation kAcc>
void launch_fp8(const Sm90Fp8GemmParams& f, cudaStream_t stream) {
  auto* kernel = configured_kernel<kKind, TA, TB, OutT, kAcc>();
  KernelArgs args;
  std::memset(&args, 0, sizeof(args));
  Sm90GemmParams& p = args.p;
  p.kind = kKind;
  p.output_type = f.output_type;
  p.num_groups = f.num_groups;
  p.rows = f.rows;
  p.n = f.n;
  p.k = f.k;
  p.m_splits = f.m_splits;
  p.splits_int32 = f.splits_int32;
  p.output = f.output;
  p.bias = f.bias;
  p.weight_grad = f.weight_grad;
  p.accumulate = f.accumulate;
  p.tile_counter = f.tile_counter;
  args.a_scale_inv = f.a_scale_inv;
  args.b_scale_inv = f.b_scale_inv;
  const MapBox out_box = output_box(f.output_type);
  if constexpr (kKind == GemmKind::kFprop) {
    args.a_map = cached_map(kFp8MapType, f.a, f.k, f.rows, 1, 0, operand_box(kFp8MapType, kBlockM));
    args.b_map = cached_map(kFp8MapType, f.b, f.k, f.n, f.num_groups, f.n * f.k,
                            weight_box(GemmKind::kFprop, kFp8MapType));
    args.out_map = cached_map(map_type(f.output_type), f.output, f.n, f.rows, 1, 0, out_box);
    args.out_tma = true;
  } else {
    // Templates: a block of width 16 at the copy's start; build_wgrad_maps sets each group's.
    const CUtensorMap a_template =
        cached_map(kFp8MapType, f.a, 16, f.n, 1, 0, operand_box(kFp8MapType, kBlockM));
    const CUtensorMap b_template =
        cached_map(kFp8MapType, f.b, 16, f.k, 1, 0, operand_box(kFp8MapType, kBlockN));
    auto* maps = static_cast<CUtensorMap*>(f.group_maps);
    build_wgrad_maps<<<1, kWarpSize, 0, stream>>>(
        a_template, b_template, f.m_splits, f.splits_int32, f.num_groups, f.rows,
        static_cast<const uint8_t*>(f.a), static_cast<const uint8_t*>(f.b), f.n, f.k, maps);
    TORCHMOE_CUDA_CHECK(cudaGetLastError());
    args.group_maps = maps;
    args.out_tma = f.weight_grad.table == nullptr;
    if (args.out_tma) {
      args.out_map = cached_map(map_type(f.output_type), f.weight_grad.base, f.k, f.n, f.num_groups,
                                f.weight_grad.group_stride, out_box);
    }
  }
  zero_tile_counter<kKind>(f.tile_counter, stream);
  kernel<<<sm_count(), kThreads, Smem<kKind, kAcc == Accumulation::kBlockScaled>::kBytes, stream>>>(
      args);
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

constexpr int kMaxDevices = 64;

}  // namespace

bool sm90_grouped_gemm_available() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();  // no usable device: not an error for a capability query
    return false;
  }
  if (device >= kMaxDevices) return false;
  // Asked before every grouped GEMM: the answer per device is computed once.
  static std::once_flag checked[kMaxDevices];
  static bool available[kMaxDevices] = {};
  std::call_once(checked[device], [&] {
    int major = 0, minor = 0;
    TORCHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    TORCHMOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major != 9 || minor != 0) return;
    cudaFuncAttributes attributes{};
    if (cudaFuncGetAttributes(
            &attributes, grouped_gemm_sm90_kernel<GemmKind::kFprop, __nv_bfloat16, __nv_bfloat16,
                                                  __nv_bfloat16>) != cudaSuccess) {
      (void)cudaGetLastError();  // no sm_90a image in this build (not a sticky error)
      return;
    }
    available[device] = true;
  });
  return available[device];
}

std::vector<uint8_t> encode_weight_maps(GemmKind kind, ScalarType input_type, int64_t n, int64_t k,
                                        const std::vector<const void*>& weights) {
  TORCH_INTERNAL_ASSERT(kind != GemmKind::kWgrad, "encode_weight_maps: fprop or dgrad only");
  std::vector<uint8_t> bytes(weights.size() * sizeof(CUtensorMap));
  for (size_t g = 0; g < weights.size(); ++g) {
    const MapType type = map_type(input_type);
    const CUtensorMap map = encode_map(type, weights[g], k, n, 1, n * k, weight_box(kind, type));
    std::memcpy(bytes.data() + g * sizeof(CUtensorMap), &map, sizeof(CUtensorMap));
  }
  return bytes;
}

void launch_grouped_gemm_sm90(const Sm90GemmParams& p, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT((p.kind != GemmKind::kWgrad || p.tile_counter != nullptr) &&
                            p.num_groups > 0 && p.num_groups <= kSm90MaxGroups && p.rows > 0 &&
                            p.rows <= INT_MAX && p.n % kSm90FeatureMultiple == 0 &&
                            p.k % kSm90FeatureMultiple == 0 &&
                            (p.gather_rows == nullptr || p.kind != GemmKind::kDgrad),
                        "launch_grouped_gemm_sm90: unchecked arguments");
  const bool bf16 = p.input_type == ScalarType::kBFloat16;
  TORCH_INTERNAL_ASSERT(bf16 || p.input_type == ScalarType::kFloat16);
  auto with_type = [&](auto tag) {
    using T = decltype(tag);
    switch (p.kind) {
      case GemmKind::kFprop:
        return launch<GemmKind::kFprop, T, T>(p, stream);
      case GemmKind::kDgrad:
        return launch<GemmKind::kDgrad, T, T>(p, stream);
      case GemmKind::kWgrad:
        if (p.output_type == ScalarType::kFloat32)
          return launch<GemmKind::kWgrad, T, float>(p, stream);
        TORCH_INTERNAL_ASSERT(p.output_type == p.input_type && !p.accumulate);
        return launch<GemmKind::kWgrad, T, T>(p, stream);
    }
  };
  bf16 ? with_type(__nv_bfloat16{}) : with_type(__half{});
}

void launch_grouped_gemm_sm90_fp8(const Sm90Fp8GemmParams& p, cudaStream_t stream) {
  const bool wgrad = p.kind == GemmKind::kWgrad;
  const bool block = is_block_scaling(p.a_scaling);
  // Per-tensor scales on both operands, or a 1x128 A with a 128x128 B (fprop) or 1x128 B (wgrad),
  // whose buffers the producer copies in 16-byte chunks.
  const bool scalings_taken = block ? p.a_scaling == QuantizeScaling::kBlock1x128 &&
                                          p.b_scaling == (wgrad ? QuantizeScaling::kBlock1x128
                                                                : QuantizeScaling::kBlock128x128) &&
                                          reinterpret_cast<uintptr_t>(p.a_scale_inv) % 16 == 0 &&
                                          reinterpret_cast<uintptr_t>(p.b_scale_inv) % 16 == 0
                                    : !is_block_scaling(p.b_scaling);
  TORCH_INTERNAL_ASSERT(
      scalings_taken && (p.kind == GemmKind::kFprop || p.kind == GemmKind::kWgrad) &&
          p.num_groups > 0 && p.num_groups <= kSm90MaxGroups && p.rows > 0 && p.rows <= INT_MAX &&
          p.n % 16 == 0 && p.k % 16 == 0 && p.b_format == Fp8Format::kE4M3 &&
          (!wgrad || (p.tile_counter != nullptr && p.group_maps != nullptr &&
                      reinterpret_cast<uintptr_t>(p.group_maps) % 128 == 0)) &&
          (!p.accumulate || p.output_type == ScalarType::kFloat32),
      "launch_grouped_gemm_sm90_fp8: unchecked arguments");
  // The B operand is e4m3 in every recipe (weights, and x in wgrad): two A formats.
  auto with_output = [&](auto a_tag, auto out_tag) {
    using TA = decltype(a_tag);
    using OutT = decltype(out_tag);
    auto with_kind = [&](auto kind_tag) {
      constexpr GemmKind kKind = decltype(kind_tag)::value;
      if (block) return launch_fp8<kKind, TA, E4M3, OutT, Accumulation::kBlockScaled>(p, stream);
      if (!p.split_accumulator) {
        return launch_fp8<kKind, TA, E4M3, OutT, Accumulation::kWhole>(p, stream);
      }
      return launch_fp8<kKind, TA, E4M3, OutT, Accumulation::kSplit>(p, stream);
    };
    if (wgrad) return with_kind(std::integral_constant<GemmKind, GemmKind::kWgrad>{});
    return with_kind(std::integral_constant<GemmKind, GemmKind::kFprop>{});
  };
  auto with_a = [&](auto a_tag) {
    switch (p.output_type) {
      case ScalarType::kBFloat16:
        return with_output(a_tag, __nv_bfloat16{});
      case ScalarType::kFloat16:
        return with_output(a_tag, __half{});
      case ScalarType::kFloat32:
        return with_output(a_tag, float{});
    }
  };
  p.a_format == Fp8Format::kE4M3 ? with_a(E4M3{}) : with_a(E5M2{});
}

}  // namespace torchmoe::kernels
