#pragma once
// The PTX wrappers of the sm90 grouped GEMM: mbarriers, TMA loads and stores, wgmma and its
// shared-memory descriptors, bulk async-groups, the proxy fence and named barriers. Each is one
// instruction (or a wait loop around one) and knows nothing of tiles or groups; kept apart so
// that the kernel files read as the algorithm and this one as the sm_90a instruction set.
// Included by grouped_gemm_sm90.cu only (through grouped_gemm_sm90_kernel.cuh).

#include <cuda.h>  // CUtensorMap
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace torchmoe::kernels::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// Every tensor map is 3-D ([groups, rows, inner]; groups = 1 for a matrix): the instruction's rank
// must match the map's.
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(dst)),
      "l"(map), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// 16-byte copy from global to shared memory through L2 (cp.async, not TMA): src_bytes 16 copies,
// 0 writes zeros and reads nothing.
// dst is a shared-memory address (smem_u32).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// One arrival on `bar` once every cp.async this thread issued before has completed. noinc: the
// arrival is one of those the barrier was initialised to expect, not an extra pending one.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
               : "memory");
}

// Waits until this thread's cp.async have completed.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle (PTX ISA, "matrix descriptor format").
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32) |
         (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// The FP8 operand types of the sm90 kernel: one byte per element, named by format so that
// wgmma's type suffix follows from the type.
struct E4M3 {
  uint8_t bits;
};
struct E5M2 {
  uint8_t bits;
};
template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, E4M3> || std::is_same_v<T, E5M2>;

// The 128 accumulator registers of an m64n256 wgmma and its operands. TYPES: the A and B type
// suffixes; TAIL: what follows scale-d (the A/B scale immediates and, for 16-bit types, the
// transpose immediates).
#define TORCHMOE_WGMMA_N256(SHAPE, TYPES, TAIL, ...)                                               \
  asm volatile(                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %130, 0;\n"                                              \
      " wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPES                                         \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "      \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "      \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "      \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "      \
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "      \
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, "        \
      "%103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "       \
      "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},"                         \
      " %128, %129, p, " TAIL ";\n}"                                                               \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
        "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), \
        "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), \
        "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), \
        "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), \
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),          \
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),        \
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),        \
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),        \
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])         \
      : "l"(desc_a), "l"(desc_b), "r"(1), ##__VA_ARGS__)

// d[64 × 256] += A[64 × 16] · B[256 × 16]ᵀ, both from shared memory; kTransA / kTransB select the
// MN-major layouts.
template <typename T, int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t desc_a,
                                                 uint64_t desc_b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    TORCHMOE_WGMMA_N256("m64n256k16", "bf16.bf16", "1, 1, %131, %132", "n"(kTransA), "n"(kTransB));
  } else {
    TORCHMOE_WGMMA_N256("m64n256k16", "f16.f16", "1, 1, %131, %132", "n"(kTransA), "n"(kTransB));
  }
}

// d[64 × 256] += A[64 × 32] · B[256 × 32]ᵀ in FP8, both K-major in shared memory (FP8 wgmma has
// no transposed layouts). The accumulation across the whole reduction is the tensor core's own,
// as cuBLASLt's "fast accumulation" (docs/fp8.md, "Numerics").
template <typename TA, typename TB>
__device__ __forceinline__ void wgmma_m64n256k32(float (&d)[128], uint64_t desc_a,
                                                 uint64_t desc_b) {
  constexpr bool kA4 = std::is_same_v<TA, E4M3>, kB4 = std::is_same_v<TB, E4M3>;
  if constexpr (kA4 && kB4) {
    TORCHMOE_WGMMA_N256("m64n256k32", "e4m3.e4m3", "1, 1");
  } else if constexpr (kA4) {
    TORCHMOE_WGMMA_N256("m64n256k32", "e4m3.e5m2", "1, 1");
  } else if constexpr (kB4) {
    TORCHMOE_WGMMA_N256("m64n256k32", "e5m2.e4m3", "1, 1");
  } else {
    TORCHMOE_WGMMA_N256("m64n256k32", "e5m2.e5m2", "1, 1");
  }
}
#undef TORCHMOE_WGMMA_N256

// d[64 × 128] (+)= A[64 × 32] · B[128 × 32]ᵀ in FP8, both K-major: d = the product alone when
// `accumulate` is 0. The split-accumulation path sums a block's products here and adds them to
// its fp32 accumulators itself (grouped_gemm_sm90_kernel.cuh).
#define TORCHMOE_WGMMA_N128(TYPES)                                                                 \
  asm volatile(                                                                                    \
      "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"                                               \
      " wgmma.mma_async.sync.aligned.m64n128k32.f32." TYPES                                        \
      " {"                                                                                         \
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "      \
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "      \
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "      \
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"                                    \
      " %64, %65, p, 1, 1;\n}"                                                                     \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), \
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), \
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), \
        "+f"(d[63])                                                                                \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))

template <typename TA, typename TB>
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                                 int accumulate) {
  constexpr bool kA4 = std::is_same_v<TA, E4M3>, kB4 = std::is_same_v<TB, E4M3>;
  if constexpr (kA4 && kB4) {
    TORCHMOE_WGMMA_N128("e4m3.e4m3");
  } else if constexpr (kA4) {
    TORCHMOE_WGMMA_N128("e4m3.e5m2");
  } else if constexpr (kB4) {
    TORCHMOE_WGMMA_N128("e5m2.e4m3");
  } else {
    TORCHMOE_WGMMA_N128("e5m2.e5m2");
  }
}
#undef TORCHMOE_WGMMA_N128

// Tensor maps written by a kernel (tensormap.replace) are read by TMA through the tensormap
// proxy: the writer releases its generic-proxy writes, the reader acquires the 128-byte map.
__device__ __forceinline__ void tensormap_release() {
  asm volatile("fence.proxy.tensormap::generic.release.gpu;" ::: "memory");
}
__device__ __forceinline__ void tensormap_acquire(const void* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(map) : "memory");
}

// TMA store (or element-wise add, for fp32 accumulation) of a shared-memory box into a 3-D
// tensor map; tracked per issuing thread as one bulk async-group per commit.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0,
                                             int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
__device__ __forceinline__ void tma_add_3d(const CUtensorMap* map, const void* src, int c0, int c1,
                                           int c2) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group [%0, {%2, %3, %4}], "
      "[%1];" ::"l"(map),
      "r"(smem_u32(src)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// dst[0..7] += eight 16-bit values (four packed pairs), added in L2 with one rounding each
// (red.add .noftz: subnormals kept). bf16 or fp16 by OutT.
template <typename OutT>
__device__ __forceinline__ void red_add8(OutT* dst, uint4 v) {
  static_assert(std::is_same_v<OutT, __nv_bfloat16> || std::is_same_v<OutT, __half>,
                "red_add8: 16-bit outputs only");
  if constexpr (std::is_same_v<OutT, __nv_bfloat16>) {
    asm volatile("red.global.add.noftz.v4.bf16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  } else {
    asm volatile("red.global.add.noftz.v4.f16x2 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(v.x),
                 "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  }
}
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until at most kPending of this thread's bulk groups are still reading shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
// Generic-proxy shared-memory writes become visible to the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives on a named barrier without waiting (the other threads of its count wait with bar.sync).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace torchmoe::kernels::sm90
