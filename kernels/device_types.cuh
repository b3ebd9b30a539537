#pragma once
// Device-side helpers shared by torchmoe's kernels: the CUDA type of a kernels::ScalarType, fp32
// conversions, 16-byte vector access, the grouped kernels' split sizes, group addresses and paired
// stores, warp reduction, and the grid of one wave for grid-stride loops. Included by .cu files
// only.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "torchmoe/kernels/cuda_check.h"
#include "torchmoe/kernels/occupancy.h"
#include "torchmoe/kernels/types.h"

namespace torchmoe::kernels {

constexpr int kWarpSize = 32;
// CUDA's limit on gridDim.y: kernels with a block row per group take the groups past it in turn.
constexpr int kMaxGridY = 65535;
// CUDA's limit on gridDim.x: kernels with a block per few work items loop over those past it.
constexpr int64_t kMaxGridX = 2147483647;

// A grid of one block per `items_per_block` work items over all of them, at least one block and at
// most kMaxGridX (the kernel's grid-stride loop takes the rest). For kernels whose items are
// independent and short: every block starts at once instead of a one-wave grid's warps looping.
inline unsigned full_grid(int64_t items, int64_t items_per_block) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((items + items_per_block - 1) / items_per_block, 1, kMaxGridX));
}

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Vec<T, V>& x) {
  *reinterpret_cast<Vec<T, V>*>(p) = x;
}

// Group g's size from a device array of int32 or int64 split sizes, clamped to [0, rows] (the
// rows of the buffer): sums of clamped sizes over any number of groups that fits memory cannot
// wrap, so garbage sizes clamp at the buffer's end instead of giving negative starts.
__device__ __forceinline__ int64_t split_at(const void* splits, bool int32, int g, int64_t rows) {
  const int64_t v =
      int32 ? static_cast<const int32_t*>(splits)[g] : static_cast<const int64_t*>(splits)[g];
  return v > 0 ? (v < rows ? v : rows) : 0;
}

// Group g's tensor: table[g] when the groups have a pointer table, else base + g · group_stride.
template <typename T>
__device__ __forceinline__ const T* group_ptr(const GroupAddress& a, int g) {
  if (a.table != nullptr) return static_cast<const T*>(a.table[g]);
  return static_cast<const T*>(a.base) + static_cast<int64_t>(g) * a.group_stride;
}

// Stores a and b to p[0] and p[1] with one vector store (16-bit types: rounded to nearest even).
__device__ __forceinline__ void store2(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
__device__ __forceinline__ void store2(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void store2(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kRedux = std::is_same_v<T, int32_t> || std::is_same_v<T, uint32_t>;
#else
  constexpr bool kRedux = false;
#endif
  if constexpr (kRedux) {
    // 32-bit integers in one redux.sync instead of five dependent shuffles.
    return __reduce_add_sync(0xffffffffu, v);
  } else {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
      v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
  }
}

// The max over the warp (fmaxf: a NaN lane is ignored unless every lane is NaN); every lane gets
// it.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The sum of v over lanes 0..this lane (all 32 lanes take part).
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const T other = __shfl_up_sync(0xffffffffu, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

// A warp covers a row in chunks of 32·V elements; chunk c of row `row` starts at the returned
// element. Each row starts at a different chunk: with every warp at the same in-row offset, rows
// of a power-of-two (or otherwise unlucky) byte stride put all warps on the same DRAM partitions
// (measured on the H100 with a warp per row: GLU forward at 40-46% of copy bandwidth, permute at
// 15-20%).
template <int V>
__host__ __device__ __forceinline__ int64_t chunk_count(int64_t row_length) {
  return (row_length + kWarpSize * V - 1) / (kWarpSize * V);
}

template <int V>
__device__ __forceinline__ int64_t chunk_start(int64_t c, int64_t row, int64_t chunks) {
  return ((c + row) % chunks) * kWarpSize * V;
}

// Calls fn(T{}) with the CUDA type of `type` and returns what it returns.
template <typename Fn>
auto dispatch_type(ScalarType type, Fn&& fn) -> decltype(fn(float{})) {
  switch (type) {
    case ScalarType::kFloat32:
      return fn(float{});
    case ScalarType::kFloat16:
      return fn(__half{});
    case ScalarType::kBFloat16:
      return fn(__nv_bfloat16{});
  }
  TORCH_INTERNAL_ASSERT(false, "dispatch_type: unknown ScalarType ", static_cast<int>(type));
}

__host__ __device__ inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Every pointer that is set starts on a 16-byte boundary (null ones are optional operands).
inline bool aligned16(std::initializer_list<const void*> pointers) {
  for (const void* p : pointers) {
    if (p != nullptr && !aligned16(p)) return false;
  }
  return true;
}

// Programmatic dependent launch (sm_90 and newer; elsewhere both are no-ops). A kernel launched
// by launch_dependent may start while the kernel ahead of it in the stream still runs: it calls
// wait_for_prior_grid before touching global memory, which returns once that kernel has finished
// and its writes are visible, so only the launch's latency overlaps. A kernel calls
// allow_dependent_launch to let the one behind it start that early (else at its own end).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, shared, stream>>>(args...) with programmatic stream serialization: the
// kernel must call wait_for_prior_grid before its first global memory access.
template <typename... Params, typename... Args>
void launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared,
                      cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = 1;
  TORCHMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

// Blocks of `kernel` that run at once on the device (at least one per SM), given its registers
// and shared memory (asked once per kernel and device: occupancy.h).
template <typename Kernel>
int64_t wave_blocks(Kernel* kernel, int threads, size_t shared_bytes) {
  return resident_blocks(reinterpret_cast<const void*>(kernel), threads, shared_bytes);
}

// Blocks for a grid-stride loop that needs `blocks_needed`: at most one wave of `kernel`, i.e. as
// many blocks as fit on the SMs at once given its registers and shared memory. Each block of such
// a loop gets the same share of the work, so a grid of 1.33 waves runs its last part on a third of
// the SMs: counting 2048 threads per SM whatever the registers did that to ScaledSwiGLU's forward
// when it looped (40 registers, so 6 blocks of 256 fit, not 8), ncu: 67% of DRAM peak.
template <typename Kernel>
unsigned one_wave_grid(Kernel* kernel, int threads, size_t shared_bytes, int64_t blocks_needed) {
  return static_cast<unsigned>(
      std::clamp<int64_t>(blocks_needed, 1, wave_blocks(kernel, threads, shared_bytes)));
}

}  // namespace torchmoe::kernels
