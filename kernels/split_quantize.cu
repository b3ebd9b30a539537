// Split-quantize; contract and layouts in split_quantize.h. The kernel here is the steps of a tile;
// each step is a piece of its own:
//
//   split_quantize_layout.cuh     the block's shape, the split layout, units and tiles, where a
//                                 tile lies
//   split_quantize_sources.cuh    the input pieces: the tensor (optionally gathered rows), or a
//                                 GLU's output or input gradient computed on the fly
//   split_quantize_math.cuh       amax, amax → scale, the e4m3/e5m2 cast
//   split_quantize_scheduler.cuh  current scaling's scheduler (amax visits, stash, polls) and
//                                 why it cannot deadlock
//   split_quantize_outputs.cuh    the amax report, block scales, the rowwise and columnwise copies
//   quantize_delayed_update.cu    the delayed-scaling amax-history update (its own launch)
//
// One kernel walks 128×128 tiles of the input, each tile inside one split (a split's row tiles
// start at its first row, so block scales never straddle splits). A persistent grid of one wave
// takes tiles in a grid-stride loop, adjacent blocks on adjacent column tiles of the same rows
// (kCurrent: in ticket order instead, the scheduler's). Every block first derives the split layout
// (clamped starts and the prefix sums that place each split's scales) from the device split sizes
// into shared memory, with a warp scan: no setup launch and no host copy.
//
// Per tile each thread loads P consecutive rows × V columns with 16-byte loads straight into
// registers (V = 16 / sizeof(T); 16 threads per row for 16-bit types, 32 for fp32), so the input
// is read once and never staged (a GLU source: two loads, a and b, and the activation's math give
// the same piece; a GLU gradient source three, a, b and dy, for the pieces of both a and b), and
// works on them as 32-bit words: amaxes of 16-bit inputs stay packed (two elements per
// instruction), casts produce four FP8 bytes per word. Each warp maxes its part of a tile into the
// split's amax (no barrier). The rowwise copy is stored from registers; the columnwise copy goes
// through a swizzled 128×128-byte shared tile (split_quantize_outputs.cuh).

#include "torchmoe/kernels/split_quantize.h"

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "torchmoe/kernels/device_types.cuh"
#include "torchmoe/kernels/split_quantize_layout.cuh"
#include "torchmoe/kernels/split_quantize_math.cuh"
#include "torchmoe/kernels/split_quantize_outputs.cuh"
#include "torchmoe/kernels/split_quantize_scheduler.cuh"
#include "torchmoe/kernels/split_quantize_sources.cuh"

namespace torchmoe::kernels {
namespace split_quantize {
namespace {

// Blocks per SM. Three (at most 80 registers; unbounded, ptxas took ~128, two blocks): up to 96 KB
// of 16-bit input loads in flight per SM. Four for a 16-bit GLU forward source under delayed
// scaling (64 registers, 16 bytes of spills): its pieces' math runs between their loads, and a
// fourth block overlaps that with another block's loads (H100, taking turns: 59-81% of copy
// against 56-77% with three, 51-64% with two). Not measured under the other scalings, where the
// cap spills more (current: 114 bytes) or fp32 pieces alone would fill the 64 registers.
template <typename T, QuantizeScaling S, Source kSource>
constexpr int blocks_per_sm() {
  return kSource == Source::kGluForward && S == QuantizeScaling::kDelayed && sizeof(T) == 2 ? 4 : 3;
}

// Whether a launch has a stash (kStashBytes): 16-bit pieces, and a GLU gradient source (the b
// tile of a paired unit) or kCurrent (the kept unit).
template <typename T, QuantizeScaling S, Source kSource>
constexpr bool has_stash() {
  return sizeof(T) == 2 && (kSource == Source::kGluBackward || S == QuantizeScaling::kCurrent);
}

// Block 0: one scale_inv per split. kDelayed: all here. kCurrent: the splits without a tile here
// (empty, or K = 0: their amax is the launch's zero), the others by the cast of their first tile,
// once their amax is complete.
template <bool kCurrent>
__device__ __forceinline__ void write_split_scale_invs(const SplitQuantizeParams& p,
                                                       const SplitLayout& layout, int groups,
                                                       int64_t col_tiles, float max_fp8,
                                                       float value_for_inf) {
  if (blockIdx.x == 0) {
    for (int g = threadIdx.x; g < groups; g += kThreads) {
      if (kCurrent && layout.start[g + 1] > layout.start[g] && col_tiles > 0) continue;
      const float scale =
          kCurrent ? scale_from_amax(0.0f, max_fp8, p.power_of_2_scales, p.epsilon, value_for_inf)
                   : p.scale[g];
      p.scale_inv[g] = __frcp_rn(scale);
    }
  }
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, Source kSource>
__global__ void __launch_bounds__(kThreads, blocks_per_sm<T, S, kSource>())
    split_quantize_kernel(const SplitQuantizeParams p, float max_fp8) {
  constexpr int V = PieceShape<T>::kVector;  // elements per 16-byte load
  constexpr int P = PieceShape<T>::kRows;    // rows per thread: 8 or 16
  constexpr bool kPerTensor = S == QuantizeScaling::kCurrent || S == QuantizeScaling::kDelayed;
  constexpr bool kCurrent = S == QuantizeScaling::kCurrent;
  // kCurrent keeps a unit's pieces in the stash between its amax visit and its cast, where a unit
  // is one tile of a 16-bit type.
  constexpr bool kHasSlot = kCurrent && sizeof(T) == 2;
  static_assert(P % 8 == 0 && V % 2 == 0, "whole 8-byte chunks and fp8 pairs");
  // Current scaling's scheduling counts tiles as units (its amax_complete): no paired GLU units.
  static_assert(!(kCurrent && kSource == Source::kGluBackward),
                "no GLU gradient source in kCurrent");
  static_assert(sizeof(T) != 2 || P * kThreads * sizeof(uint4) == kStashBytes, "stash size");

  extern __shared__ __align__(16) char dynamic_shared[];
  __shared__ __align__(16) uint8_t transposed[kTile * kTile];
  __shared__ __align__(16) float column_partial[kWarps][kTile];
  __shared__ __align__(16) float column_scale[kTile];
  __shared__ float scratch[kWarps];
  // kCurrent: the step and amax outcome of this iteration, by its parity (so that one barrier
  // each suffices), and the scale of the cast unit's split (thread 0 writes it before a barrier
  // that precedes its reads, and after the next iteration's first barrier).
  __shared__ Step step[2];
  __shared__ AmaxOutcome outcome[2];
  // kCurrent: the warps' amaxes of the tile of an amax visit, for thread 0.
  __shared__ float warp_amaxes[kWarps];
  __shared__ int held[kHeldDrops];  // kCurrent, thread 0's: CurrentScheduler::held
  __shared__ float split_scale;

  const int groups = p.num_groups;
  const SplitLayout layout = build_layout(p, dynamic_shared);
  const float value_for_inf = kPerTensor ? FLT_MAX : InputLimits<T>::kMax;

  const int64_t k = p.k;
  const int64_t col_tiles = (k + kTile - 1) / kTile;
  if constexpr (kPerTensor) {
    write_split_scale_invs<kCurrent>(p, layout, groups, col_tiles, max_fp8, value_for_inf);
  }
  const bool writes_amax = !kCurrent && p.amax != nullptr;

  uint8_t* rowwise = static_cast<uint8_t*>(p.rowwise);
  uint8_t* columnwise = static_cast<uint8_t*>(p.columnwise);
  const ThreadPlace t = thread_place<T>();

  [[maybe_unused]] uint4* stash = nullptr;  // [P][kThreads]: the b tile's or the kept unit's pieces
  if constexpr (has_stash<T, S, kSource>()) {
    stash = reinterpret_cast<uint4*>(dynamic_shared + stash_offset(groups));
  }
  int64_t block = 0;  // a paired GLU gradient source's a (or b) block of columns
  const UnitGrid grid = unit_grid<T, kSource>(p, layout, groups, col_tiles, block);

  // kCurrent's scheduling: thread 0 decides, the block follows (split_quantize_scheduler.cuh).
  CurrentScheduler<kHasSlot> scheduler(p, layout, groups, grid, max_fp8, value_for_inf, held,
                                       split_scale);
  if (kCurrent && threadIdx.x == 0) scheduler.claim_first_ticket();

  int64_t next = blockIdx.x;  // every scaling but kCurrent: a grid-stride loop over the units
  for (int parity = 0;; parity ^= 1) {
    int64_t unit = next;
    Visit visit = Visit::kOnly;
    if constexpr (kCurrent) {
      if (threadIdx.x == 0) step[parity] = scheduler.next_step();
      __syncthreads();
      unit = step[parity].unit;
      visit = step[parity].visit;
      if (visit == Visit::kDone) break;
    } else {
      if (next >= grid.units) break;
      next += gridDim.x;
    }
    for (int half = 0; half < (grid.paired ? 2 : 1); ++half) {
      TileSpot<T> spot = locate<T>(p, layout, grid.tile(unit, half), col_tiles);
      bool col_ok = t.c0 < spot.cols_valid;  // k % 16 == 0: a piece is wholly in or out
      uint32_t x[P][4];
      [[maybe_unused]] float scale_grad[P];  // kGluBackward: each row's scale-gradient share
      if (kCurrent && visit == Visit::kCastStashed) {
        exchange_pieces(stash, x, true, false);
      } else {
        load_source_pieces<T, kSource>(p, spot, t, k, col_ok, grid.paired, half, block, stash, x,
                                       scale_grad);
      }
      if (kCurrent && kHasSlot && visit == Visit::kAmax && threadIdx.x == 0) {
        scheduler.poll_stash_early();
      }
      if constexpr (kSource == Source::kGluBackward) {
        if (p.glu_grad_scales_partial != nullptr && half == 0) {
          store_scale_grad_partials<T>(p, spot, t, scale_grad);
        }
      }

      const bool reports_amax = (kCurrent && visit == Visit::kAmax) || writes_amax;
      const float tile_amax =
          reduce_tile_amax<T, S>(p, spot.g, x, reports_amax, scratch, warp_amaxes, t.warp);
      if (kCurrent && visit == Visit::kAmax) {
        // Thread 0 decides what becomes of the pieces, then announces the tile's amax after the
        // barrier.
        if (threadIdx.x == 0) outcome[parity] = scheduler.keep_or_drop(unit);
        __syncthreads();
        if (threadIdx.x == 0) scheduler.announce_tile(spot.g, warp_amaxes);
        const AmaxOutcome o = outcome[parity];
        if (o.keep == Keep::kDrop) continue;
        exchange_pieces(stash, x, o.keep == Keep::kSwap, true);
        if (o.keep == Keep::kStash) continue;
        spot = locate<T>(p, layout, o.cast_unit, col_tiles);  // kSwap: cast the unit that left
        col_ok = t.c0 < spot.cols_valid;                      // the stash
      }

      const float tensor_scale =
          tile_scale<T, S>(p, layout, spot, visit, scheduler, split_scale, col_tiles, rowwise,
                           columnwise, tile_amax, max_fp8, value_for_inf);
      uint32_t q[P][V / 4];  // the rowwise bytes (also the columnwise ones but for kBlock1x128)
      if (rowwise != nullptr || S != QuantizeScaling::kBlock1x128) {
        [[maybe_unused]] float row_amax[P];  // kBlock1x128: own_row_amax's scratch
        cast_rowwise<T, F, S>(p, layout, spot, t, k, rowwise, col_ok, col_tiles, tensor_scale,
                              max_fp8, value_for_inf, x, row_amax, q);
      }
      if (columnwise == nullptr) continue;

      // The columnwise copy into the shared tile, then its rows. The loops that read x or q stay
      // in the kernel: moved into functions taking x or q by reference they compiled to the same
      // PTX instructions but other virtual registers, and ptxas then spilled differently (fp32,
      // kBlock1x128) or moved a store of the load loop (16-bit GLU gradient sources).
      if constexpr (S == QuantizeScaling::kBlock1x128) {
        // Each column cast with its own scale: column amaxes, packed over this thread's rows, then
        // over the row groups of its warp that hold the same columns, then over the warps.
        AbsMax<T> col[4];
#pragma unroll
        for (int i = 0; i < P; ++i) {
#pragma unroll
          for (int w = 0; w < 4; ++w) col[w].add(x[i][w]);
        }
        float col_amax[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          float a;
          if constexpr (std::is_same_v<T, float>) {
            a = col[j].value();
          } else {
            a = j % 2 == 0 ? col[j / 2].lo() : col[j / 2].hi();
          }
#pragma unroll
          for (int offset = PieceShape<T>::kRowThreads; offset < kWarpSize; offset *= 2) {
            a = fmaxf(a, __shfl_xor_sync(kFullMask, a, offset));
          }
          col_amax[j] = a;
        }
        float col_scale[V];
        column_scales<T>(p, layout, spot, t, k, max_fp8, value_for_inf, col_amax, column_partial,
                         column_scale, col_scale);
#pragma unroll
        for (int j = 0; j < V; ++j) {
          const float scale = col_scale[j];
#pragma unroll
          for (int h = 0; h < P / 8; ++h) {
            uint32_t word[2];
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              word[half] = cast_column_word<T, F>(x, 8 * h + 4 * half, j, scale);
            }
            store_chunk<V>(transposed, t, j, h, word[0], word[1]);
          }
        }
      } else {
        // The rowwise bytes transposed, four rows by four columns at a time.
#pragma unroll
        for (int h = 0; h < P / 8; ++h) {
#pragma unroll
          for (int w = 0; w < V / 4; ++w) {
            uint32_t top[4], bottom[4];  // rows 8h .. 8h + 3 and 8h + 4 .. 8h + 7
            transpose4x4(q[8 * h][w], q[8 * h + 1][w], q[8 * h + 2][w], q[8 * h + 3][w], top);
            transpose4x4(q[8 * h + 4][w], q[8 * h + 5][w], q[8 * h + 6][w], q[8 * h + 7][w],
                         bottom);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              store_chunk<V>(transposed, t, 4 * w + j, h, top[j], bottom[j]);
            }
          }
        }
      }
      __syncthreads();
      store_columnwise(layout, spot, k, columnwise, transposed);
      __syncthreads();  // the next tile rewrites `transposed`
    }
  }
}

// The kernel a launch of `p` runs, and its dynamic shared memory (the stash, or the layout
// alone), which the kernel is allowed: its static shared memory (about 21 KB) plus the layout may
// pass the 48 KB default.
struct SelectedKernel {
  void (*kernel)(SplitQuantizeParams, float);
  size_t shared;
};

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S, Source kSource>
SelectedKernel select_source(const SplitQuantizeParams& p) {
  SelectedKernel selected{split_quantize_kernel<T, F, S, kSource>,
                          has_stash<T, S, kSource>() ? stash_offset(p.num_groups) + kStashBytes
                                                     : layout_bytes(p.num_groups)};
  allow_dynamic_shared(reinterpret_cast<const void*>(selected.kernel), selected.shared);
  return selected;
}

template <typename T, __nv_fp8_interpretation_t F, QuantizeScaling S>
SelectedKernel select_scaling(const SplitQuantizeParams& p) {
  if (p.glu.input == nullptr) return select_source<T, F, S, Source::kTensor>(p);
  if (p.glu.grad_output == nullptr) return select_source<T, F, S, Source::kGluForward>(p);
  if constexpr (S == QuantizeScaling::kCurrent) {
    TORCH_INTERNAL_ASSERT(false, "launch_split_quantize: no GLU gradient source with kCurrent");
  } else {
    return select_source<T, F, S, Source::kGluBackward>(p);
  }
}

template <typename T, __nv_fp8_interpretation_t F>
SelectedKernel select_format(const SplitQuantizeParams& p) {
  switch (p.scaling) {
    case QuantizeScaling::kCurrent:
      return select_scaling<T, F, QuantizeScaling::kCurrent>(p);
    case QuantizeScaling::kDelayed:
      return select_scaling<T, F, QuantizeScaling::kDelayed>(p);
    case QuantizeScaling::kBlock1x128:
      return select_scaling<T, F, QuantizeScaling::kBlock1x128>(p);
    case QuantizeScaling::kBlock128x128:
      return select_scaling<T, F, QuantizeScaling::kBlock128x128>(p);
  }
  TORCH_INTERNAL_ASSERT(false, "launch_split_quantize: unknown scaling");
}

SelectedKernel select_kernel(const SplitQuantizeParams& p) {
  return dispatch_type(p.input_type, [&](auto tag) {
    using T = decltype(tag);
    return p.format == Fp8Format::kE4M3 ? select_format<T, __NV_E4M3>(p)
                                        : select_format<T, __NV_E5M2>(p);
  });
}

}  // namespace
}  // namespace split_quantize

void launch_split_quantize(const SplitQuantizeParams& p, cudaStream_t stream) {
  if (p.num_groups == 0) return;
  TORCH_INTERNAL_ASSERT(p.k % kQuantizeFeatureMultiple == 0,
                        "launch_split_quantize: k must be a multiple of 16");
  TORCH_INTERNAL_ASSERT(p.scaling != QuantizeScaling::kDelayed || p.scale != nullptr,
                        "launch_split_quantize: kDelayed needs scale");
  TORCH_INTERNAL_ASSERT(is_block_scaling(p.scaling) || p.amax != nullptr,
                        "launch_split_quantize: kCurrent and kDelayed need amax");
  TORCH_INTERNAL_ASSERT(p.scale_inv != nullptr || (is_block_scaling(p.scaling) && !p.rowwise),
                        "launch_split_quantize: scale_inv is required");
  TORCH_INTERNAL_ASSERT(!is_block_scaling(p.scaling) || !p.columnwise || p.columnwise_scale_inv,
                        "launch_split_quantize: columnwise block scales are required");
  TORCH_INTERNAL_ASSERT(aligned16({p.input, p.glu.input, p.rowwise, p.columnwise}),
                        "launch_split_quantize: buffers must be 16-byte aligned");
  const int64_t glu_width = p.glu.grad_output != nullptr ? p.k / 2 : p.k;
  TORCH_INTERNAL_ASSERT(
      p.glu.input == nullptr ||
          (p.glu.rows == p.rows && p.glu.hidden == glu_width && p.glu.data_type == p.input_type &&
           p.split_inputs.empty() && p.glu.interleave % kQuantizeFeatureMultiple == 0),
      "launch_split_quantize: a GLU source must be [rows, 2 * hidden] of the input type, with k ",
      "= hidden (its output) or 2 * hidden (its input's gradient)");
  TORCH_INTERNAL_ASSERT(p.glu.grad_output == nullptr || p.glu.input != nullptr,
                        "launch_split_quantize: a GLU gradient source needs the GLU input");
  TORCH_INTERNAL_ASSERT(
      p.gather_rows == nullptr || (p.glu.input == nullptr && p.split_inputs.base == nullptr &&
                                   p.split_inputs.table == nullptr),
      "launch_split_quantize: gathered rows come from `input` only");
  TORCH_INTERNAL_ASSERT(p.glu_grad_scales_partial == nullptr || p.glu.grad_output != nullptr,
                        "launch_split_quantize: scale-gradient sums need a GLU gradient source");
  TORCH_INTERNAL_ASSERT(aligned16({p.glu.grad_output}),
                        "launch_split_quantize: glu.grad_output must be 16-byte aligned");
  TORCH_INTERNAL_ASSERT(p.scaling != QuantizeScaling::kCurrent || p.workspace != nullptr,
                        "launch_split_quantize: kCurrent needs a workspace");
  if (p.amax != nullptr && !(p.scaling == QuantizeScaling::kDelayed && p.accumulate_amax)) {
    TORCHMOE_CUDA_CHECK(
        cudaMemsetAsync(p.amax, 0, static_cast<size_t>(p.num_groups) * sizeof(float), stream));
  }
  if (p.scaling == QuantizeScaling::kCurrent) {
    TORCHMOE_CUDA_CHECK(cudaMemsetAsync(
        p.workspace, 0,
        (split_quantize::kCounters + static_cast<size_t>(p.num_groups)) * sizeof(int32_t), stream));
  }
  if (is_block_scaling(p.scaling)) {
    // The layouts' padding entries are never written: zeros keep the buffers deterministic.
    const auto zero = [&](float* scales, int64_t count) {
      if (scales != nullptr && count > 0) {
        TORCHMOE_CUDA_CHECK(
            cudaMemsetAsync(scales, 0, static_cast<size_t>(count) * sizeof(float), stream));
      }
    };
    if (p.rowwise) zero(p.scale_inv, rowwise_block_scales(p.scaling, p.rows, p.k, p.num_groups));
    if (p.columnwise) {
      zero(p.columnwise_scale_inv, columnwise_block_scales(p.scaling, p.rows, p.k, p.num_groups));
    }
  }
  const split_quantize::SelectedKernel selected = split_quantize::select_kernel(p);
  const int64_t tiles_bound = split_quantize_tiles_bound(p.num_groups, p.rows, p.k);
  // Tile indices are divided in 32 bits, and kCurrent counts in ints its tickets (one per unit and
  // per block), its units and a split's announced tiles: 2^27 tiles (2·10^12 elements) leave room
  // for all.
  TORCH_INTERNAL_ASSERT(tiles_bound < (int64_t{1} << 27), "launch_split_quantize: too many tiles");
  const unsigned grid =
      one_wave_grid(selected.kernel, split_quantize::kThreads, selected.shared, tiles_bound);
  selected.kernel<<<grid, split_quantize::kThreads, selected.shared, stream>>>(p,
                                                                               fp8_max(p.format));
  TORCHMOE_CUDA_CHECK(cudaGetLastError());
}

int64_t split_quantize_wave_blocks(const SplitQuantizeParams& p) {
  const split_quantize::SelectedKernel selected = split_quantize::select_kernel(p);
  return wave_blocks(selected.kernel, split_quantize::kThreads, selected.shared);
}

}  // namespace torchmoe::kernels
