#pragma once
// Current scaling's scheduler (split_quantize.cu's kernel under kCurrent): which unit a block
// works on next and what it does with it, so that each split's amax is complete before any of
// its elements is cast, within the one launch and without a host sync. Kept apart from the
// kernel because this is the scheduling policy and its deadlock argument, not the data path.
// Included by split_quantize.cu only.

#include <cstdint>

#include "torchmoe/kernels/split_quantize.h"
#include "torchmoe/kernels/split_quantize_layout.cuh"
#include "torchmoe/kernels/split_quantize_math.cuh"
#include "torchmoe/kernels/split_quantize_sources.cuh"

namespace torchmoe::kernels::split_quantize {

// What a block does with a unit in an iteration.
enum class Visit : int {
  kOnly,         // every scaling but kCurrent: the unit's one visit
  kAmax,         // load, max into the split's amax, then keep, swap or drop the pieces
  kCastStashed,  // cast the pieces the block's stash holds
  kCastReload,   // load again and cast (a dropped unit)
  kDone,
};
struct Step {
  int64_t unit;
  Visit visit;
};
// After an amax visit: the pieces go to the empty stash, or are exchanged for the stash's (whose
// split has become complete: those are cast now), or are dropped (cast again from the input).
enum class Keep : int { kStash, kSwap, kDrop };
struct AmaxOutcome {
  Keep keep;
  int64_t cast_unit;  // kSwap: the unit that left the stash
};
// kCurrent's workspace: four counters, then a count of announced tiles per split, then the
// list of dropped units.
enum Counter : int { kTickets, kRetired, kDropped, kDropClaims, kCounters };
static_assert(kCounters == 4, "split_quantize_workspace_ints counts four counters");
// Polls of a stashed unit's split, larger than the stashes hold, after the next unit's amax
// visit before that unit is dropped: the split usually completes while the next unit loads.
constexpr int kStashPolls = 4;
constexpr unsigned kPollNanoseconds = 128;
// Dropped units a block holds for itself (thread 0's, in shared memory).
constexpr int kHeldDrops = 4;

// An add that publishes this thread's earlier writes to whoever reads the count with
// load_acquire (lighter than __threadfence's sequentially consistent fence).
__device__ __forceinline__ void add_release(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ int load_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Exchanges this thread's pieces with its places in a stash: x gets the stash's when `load`, the
// stash gets x's when `store`.
template <int P>
__device__ __forceinline__ void exchange_pieces(uint4* stash, uint32_t (&x)[P][4], bool load,
                                                bool store) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    uint4& slot = stash_piece(stash, i);
    const uint4 kept = load ? slot : make_uint4(0, 0, 0, 0);
    if (store) slot = pack_words(x[i]);
    if (load) set_words(x[i], kept);
  }
}

// kCurrent needs each split's amax before any of its elements can be cast. Each block takes units
// in order from a ticket counter and visits each first for its split's amax, keeping the loaded
// pieces in shared memory (the stash: one unit per block, 32 KB for a 16-bit tile, `kHasSlot`)
// until the split's amax is complete, so a tile is usually read from HBM once: the block loads its
// next unit while the kept one's split completes (thread 0 asks while the loads are in flight,
// poll_stash_early), then casts the kept one, exchanging the two units' pieces. Thread 0
// announces each tile's amax with one release (a max, then a count per split) after the block's
// barrier, so one warp, not every warp, waits for its earlier stores to be visible. Where the
// stash's split is one that the stashes can hold whole, the block waits for it to complete. A unit
// that finds the stash still waiting on a larger split, or no stash (fp32 pieces: a 64 KB stash
// would cost a block per SM), is dropped after its amax visit and loaded again for its cast: by
// the same block as soon as its split is complete (a few held per block), or once every unit has
// had its amax visit. (The earlier scheme, the amax visits a split and a wave ahead of separate
// cast visits, found most second reads in HBM: 61-67% of copy.) kCurrent has no GLU gradient
// source (ops/quantize.h says why), so its units are tiles.
//
// Why it cannot deadlock, whatever is resident:
//  - Amax visits are handed out in ticket order, i.e. split by split, and an amax visit waits, if
//    at all, only for an earlier split (keep_or_drop). Thread 0 claims each ticket an iteration
//    before it is used (the claim's round trip overlaps the iteration's work), but a block holding
//    a valid ticket never waits without bound before using it: its next visit is that amax visit.
//  - A cast waits only for amax visits that running blocks hold: a held unit is cast (next_step)
//    once its split is complete, without waiting; the stash's cast, the held casts after the
//    tickets run out, and the list's come only once every amax visit has been handed out.
//  - keep_or_drop waits for the stash's split only when the stashes can hold it whole (at most
//    gridDim.x tiles): then every ticket of that split is claimed (this unit's split is later),
//    and a block holding one of them unannounced, or claimed ahead, waits, if at all, for an
//    earlier split. For a larger split, a few polls, then the unit is dropped (waiting idled the
//    blocks while its last tiles loaded: docs/experiments.md).
//  - The list of dropped units is read only once every amax visit has retired (kRetired ==
//    units): it is complete, and each entry is visible before its count (add_release).
//
// Thread 0 runs the scheduler and the block follows it through shared memory (the kernel's
// step/outcome slots, by iteration parity, so that one barrier each suffices). The members are
// thread 0's: `stashed` is the unit whose pieces the stash holds, or -1.
template <bool kHasSlot>
struct CurrentScheduler {
  const SplitQuantizeParams& p;
  const SplitLayout& layout;
  int groups;
  const UnitGrid& grid;
  float max_fp8, value_for_inf;
  int* counters;            // the workspace's Counter entries
  int* amax_done;           // announced tiles per split
  int* dropped;             // the list of dropped units
  int (&held)[kHeldDrops];  // shared: thread 0's last few dropped units, a ring
  float& split_scale;       // shared: the scale of the cast unit's split
  int64_t stashed = -1;
  bool exhausted = false;
  int pending_ticket = 0;
  // Thread 0's last few dropped units, in order, held to be cast as soon as their split is
  // complete (their second read may still find them in L2); more go to the workspace's list.
  int held_first = 0, held_count = 0;
  // Whether the stash's split was found complete while the next unit's loads were in flight.
  bool stash_ready = false;

  __device__ __forceinline__ CurrentScheduler(const SplitQuantizeParams& params,
                                              const SplitLayout& split_layout, int num_groups,
                                              const UnitGrid& unit_grid, float fp8_max,
                                              float inf_scale, int (&held_units)[kHeldDrops],
                                              float& scale)
      : p(params),
        layout(split_layout),
        groups(num_groups),
        grid(unit_grid),
        max_fp8(fp8_max),
        value_for_inf(inf_scale),
        counters(params.workspace),
        amax_done(params.workspace + kCounters),
        dropped(params.workspace + kCounters + num_groups),
        held(held_units),
        split_scale(scale) {}

  // Thread 0, once: the first ticket (claimed ahead, as every later one).
  __device__ __forceinline__ void claim_first_ticket() {
    pending_ticket = atomicAdd(counters + kTickets, 1);
  }

  __device__ __forceinline__ int split_of_unit(int64_t unit) const {
    return split_of_tile(layout, groups, static_cast<int32_t>(unit / grid.unit_cols));
  }
  __device__ __forceinline__ bool amax_complete(int g) const {
    const int needed = (layout.tiles[g + 1] - layout.tiles[g]) * static_cast<int>(grid.col_tiles);
    return load_acquire(amax_done + g) >= needed;
  }
  __device__ __forceinline__ float complete_split_scale(int g) const {  // once amax_complete(g)
    return scale_from_amax(__ldcg(p.amax + g), max_fp8, p.power_of_2_scales, p.epsilon,
                           value_for_inf);
  }

  __device__ __forceinline__ Step pop_held() {
    const int unit = held[held_first];
    held_first = (held_first + 1) % kHeldDrops;
    --held_count;
    return {unit, Visit::kCastReload};
  }

  // Thread 0: a held unit whose split is complete; else the next unit's amax visit while tickets
  // last; then the stash's cast, the held units' casts, and the list's once every amax visit has
  // retired (the list is complete).
  __device__ __forceinline__ Step next_step() {
    if (held_count > 0 && amax_complete(split_of_unit(held[held_first]))) return pop_held();
    if (!exhausted) {
      const int ticket = pending_ticket;
      if (ticket < grid.units) {
        pending_ticket = atomicAdd(counters + kTickets, 1);
        return {ticket, Visit::kAmax};
      }
      exhausted = true;
    }
    if (stashed >= 0) {
      const Step cast{stashed, Visit::kCastStashed};
      stashed = -1;
      return cast;
    }
    if (held_count > 0) return pop_held();  // every amax visit is handed out: waiting is safe
    while (load_acquire(counters + kRetired) < grid.units) __nanosleep(kPollNanoseconds);
    const int claim = atomicAdd(counters + kDropClaims, 1);
    if (claim < __ldcg(counters + kDropped)) return {__ldcg(dropped + claim), Visit::kCastReload};
    return {0, Visit::kDone};
  }

  // Whether the stash's split is complete; if so, split_scale gets its scale.
  __device__ __forceinline__ bool stash_split_complete() {
    const int g = split_of_unit(stashed);
    if (!amax_complete(g)) return false;
    split_scale = complete_split_scale(g);
    return true;
  }

  // Thread 0, right after an amax visit's loads are issued: asks first while they are in flight
  // (then keep_or_drop asks again).
  __device__ __forceinline__ void poll_stash_early() {
    if (stashed >= 0) stash_ready = stash_split_complete();  // overlaps the loads just issued
  }

  // Thread 0, after `unit`'s amax visit: what becomes of its pieces; retires the visit.
  __device__ __forceinline__ AmaxOutcome keep_or_drop(int64_t unit) {
    AmaxOutcome o{Keep::kDrop, stashed};
    if (kHasSlot && stashed < 0) {
      o.keep = Keep::kStash;
    } else if (kHasSlot && split_of_unit(unit) != split_of_unit(stashed)) {
      // (The stash's split cannot be complete before this unit of it is announced.) A split that
      // the stashes can hold whole completes within the amax visits in flight: wait for it rather
      // than read this unit twice (the argument above).
      const int g = split_of_unit(stashed);
      const bool wait = (layout.tiles[g + 1] - layout.tiles[g]) * grid.col_tiles <= gridDim.x;
      for (int poll = 0; !stash_ready && (wait || poll < kStashPolls); ++poll) {
        __nanosleep(kPollNanoseconds);
        stash_ready = stash_split_complete();
      }
      if (stash_ready) o.keep = Keep::kSwap;
    }
    stash_ready = false;
    if (o.keep == Keep::kDrop && held_count == kHeldDrops) {
      dropped[atomicAdd(counters + kDropped, 1)] = static_cast<int>(unit);
      add_release(counters + kRetired, 1);  // the entry is visible before the count
      return o;
    }
    if (o.keep == Keep::kDrop) {
      held[(held_first + held_count++) % kHeldDrops] = static_cast<int>(unit);
    } else {
      stashed = unit;
    }
    atomicAdd(counters + kRetired, 1);
    return o;
  }

  // Thread 0, after the barrier that follows keep_or_drop: announces the tile's amax (the warps'
  // parts) to split g. The release waits for thread 0's earlier stores while the other warps go
  // on (one warp's wait per tile; a release per warp stalled every warp, ncu).
  __device__ __forceinline__ void announce_tile(int g, const float (&warp_amaxes)[kWarps]) {
    float amax = warp_amaxes[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) amax = fmaxf(amax, warp_amaxes[w]);
    atomic_max_nonnegative(p.amax + g, amax);
    add_release(amax_done + g, 1);  // the max is visible before the count
  }

  // Every thread, before a cast of split g that no swap has found complete: thread 0 waits until
  // every tile of the split has been announced (a unit retires before its announcement; the
  // stash's split may be complete already) and leaves its scale in split_scale.
  __device__ __forceinline__ void await_split_scale(int g) {
    if (threadIdx.x == 0) {
      while (!amax_complete(g)) __nanosleep(kPollNanoseconds);
      split_scale = complete_split_scale(g);
    }
    __syncthreads();
  }
};

}  // namespace torchmoe::kernels::split_quantize
