#!/usr/bin/env python3
"""torchmoe's GroupedLinear next to TransformerEngine's, in one process, taking turns.

For each shape (an MoE expert fc1: E experts, K = hidden, N = 2*ffn, M = tokens*topk rows in E
uniform splits) and each recipe (bf16, FP8 delayed, current, block), one training step of the
layer (bf16 parameters, no bias, input requiring grad, gradients set to none, weights cast every
step), forward + backward, TFLOP/s = 3 * 2*M*N*K / time, in four columns:

  te          te.GroupedLinear at its defaults (use_grouped_tensor=False, host m_splits)
  te_grouped  te.GroupedLinear(use_grouped_tensor=True) with CUDA int64 m_splits: cuBLASLt's
              grouped matmul where TE supports it (bf16, current and block scaling on Hopper with
              cuBLASLt >= 13.4 / 13.5 / 13.6); elsewhere TE falls back to its split-quantize path
              (delayed scaling always), which the `te_path` field records
  torchmoe    torchmoe::GroupedLinear (libtorchmoe_bench_classes.so), host and device splits
  torchmoe_dev  the same layer given the device splits only (as MoELayer calls it)

and the ceilings of the same FLOPs in the same turns: a dense bf16 torch.mm and a dense FP8
torch._scaled_mm (e4m3, per-tensor scales, fast accumulation) of [M, K] x [K, N]. Each column's
output, input gradient and expert 0's weight gradient are checked against float32 references of
the same weights (the run fails past TOLERANCE). Median of --iters rounds after --warmup: each
round calls every column once, each timed call (CUDA events around it, one wait at the end)
right after an untimed one of the same column, so that it finds the launch queue as its own
steady state leaves it: a host-bound column reads its host time unless the column before left
more GPU work queued than twice this column's host time less its GPU time. Ratios are like for
like: torchmoe with host splits over TE at its defaults, with device splits over TE's grouped
path, and over the dense GEMM of its dtype. Peak memory of one step per column
(torch.cuda.max_memory_allocated above what is allocated once the gradients are set to none; TE
and torchmoe share the caching allocator).

    PYTHONPATH=<TE site> python3 bench/bench_te_grouped_linear.py \
        --library build/bench/libtorchmoe_bench_classes.so [--shapes a,b] [--json PATH]
"""
import argparse
import json
import statistics
import sys
import warnings

import torch

SHAPES = {  # name: (E, hidden, ffn, topk, tokens), as bench/bench_common.h
    "mixtral": (8, 4096, 14336, 2, 8192),
    "deepseek-v3-ep8": (32, 7168, 2048, 8, 8192),
    "qwen3-30b-a3b": (128, 2048, 768, 8, 8192),
    "olmoe": (64, 2048, 1024, 8, 8192),
    "moe-lm": (32, 1024, 1024, 2, 8192),
}
RECIPES = ("bf16", "delayed", "current", "block")
COLUMNS = ("te", "te_grouped", "torchmoe", "torchmoe_dev")
# Relative error against the float32 references past which the run fails: loose enough for bf16
# rounding and for FP8 (e4m3 inputs and weights, e5m2 output gradients: 2 mantissa bits), far
# below what a broken product gives (~1).
TOLERANCE = {"bf16": 2e-2, "delayed": 0.2, "current": 0.2, "block": 0.2}


def median_ms_each(fns, iters, warmup):
    """Medians in ms of each of `fns`, the functions taking turns round by round."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in fns] for _ in range(iters)]
    torch.cuda.synchronize()
    for round_events in events:
        for fn, (start, end) in zip(fns, round_events):
            # Each timed call follows an untimed one of the same column, so that it finds the
            # queue as that column leaves it: the time is its steady state, the larger of its
            # host and GPU times, whichever column came before.
            fn()
            start.record()
            fn()
            end.record()
    torch.cuda.synchronize()
    return [statistics.median(events[r][i][0].elapsed_time(events[r][i][1]) for r in range(iters))
            for i in range(len(fns))]


def peak_gib(fn, clear):
    """The peak memory of one call of `fn` above what is allocated after clear() (the gradients
    set to none)."""
    clear()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def te_recipes(te_recipe):
    return {"delayed": te_recipe.DelayedScaling(), "current": te_recipe.Float8CurrentScaling(),
            "block": te_recipe.Float8BlockScaling()}


def measure_shape(name, args, te, te_recipe, tex):
    e, k, ffn, topk, tokens = SHAPES[name]
    n, m = 2 * ffn, tokens * topk
    host = [m // e] * e
    host[-1] += m - sum(host)
    dev_splits = torch.tensor(host, dtype=torch.int64, device="cuda")
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    flop = 3 * 2.0 * m * n * k

    layers = {}
    for column, grouped in (("te", False), ("te_grouped", True)):
        layer = te.GroupedLinear(e, k, n, bias=False, params_dtype=torch.bfloat16, device="cuda",
                                 use_grouped_tensor=grouped)
        with torch.no_grad():
            for g in range(e):
                getattr(layer, f"weight{g}").copy_(w[g])
        layers[column] = layer
    steps = {}
    for recipe in RECIPES:
        steps[recipe] = torch.classes.torchmoe_bench.GroupedLinearStep(e, k, n, recipe)
        steps[recipe].load_weights(w)
    fp8_recipes = te_recipes(te_recipe)

    def te_step(column, recipe):
        layer = layers[column]
        splits = dev_splits if column == "te_grouped" else host
        rec = fp8_recipes.get(recipe)

        def run():
            x.grad = None
            layer.zero_grad(set_to_none=True)
            with te.autocast(enabled=rec is not None, recipe=rec):
                y = layer(x, splits)
            y.backward(dy)
            return y
        return run

    def ours_step(column, recipe):
        step = steps[recipe]
        host_arg = host if column == "torchmoe" else []
        return lambda: step.forward_backward(x, dev_splits, host_arg, dy)

    def column_step(column, recipe):
        return te_step(column, recipe) if column.startswith("te") else ours_step(column, recipe)

    def weight0_grad(column, recipe):
        if column.startswith("te"):
            return layers[column].weight0.grad
        return steps[recipe].weight_grad(0)

    # Correctness: one step of each column against float32 references of the same weights: the
    # output, the input's gradient and expert 0's weight gradient. A column that TE refuses (any
    # exception in its step) is reported and left out.
    with torch.no_grad():
        xs, dys = torch.split(x.detach(), host), torch.split(dy, host)
        ref_y = torch.cat([xg.float() @ w[g].float().t() for g, xg in enumerate(xs)])
        ref_dx = torch.cat([dg.float() @ w[g].float() for g, dg in enumerate(dys)])
        ref_dw0 = dys[0].float().t() @ xs[0].float()

    def rel(a, ref):
        return ((a.float() - ref).norm() / ref.norm()).item()

    errors, refused = {}, {}
    for recipe in RECIPES:
        for column in COLUMNS:
            try:
                y = column_step(column, recipe)()
            except Exception as error:  # e.g. more experts than TE's grouped GEMM takes
                refused[(column, recipe)] = str(error).strip().splitlines()[-1][-160:]
                continue
            errors[(column, recipe)] = max(rel(y, ref_y), rel(x.grad, ref_dx),
                                           rel(weight0_grad(column, recipe), ref_dw0))

    # The path TE's grouped column takes: its predicate's answer per recipe (else TE runs its
    # split-quantize path), or "refused".
    from transformer_engine.pytorch.module.grouped_linear import (
        is_module_grouped_tensor_path_supported)
    te_path = {r: ("refused" if ("te_grouped", r) in refused
                   else "grouped" if is_module_grouped_tensor_path_supported(fp8_recipes.get(r),
                                                                              torch.bfloat16)
                   else "split-quantize") for r in RECIPES}

    # The ceilings: one dense [M, K] x [K, N] GEMM in bf16 and in FP8 (mat2 column-major).
    xd = x.detach()
    wd = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    x8, wd8 = xd.to(torch.float8_e4m3fn), wd.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    dense = [lambda: torch.mm(xd, wd.t()),
             lambda: torch._scaled_mm(x8, wd8.t(), scale_a=one, scale_b=one,
                                      out_dtype=torch.bfloat16, use_fast_accum=True)]

    fns, labels = [], []
    for recipe in RECIPES:
        for column in COLUMNS:
            if (column, recipe) in refused:
                continue
            fns.append(column_step(column, recipe))
            labels.append((column, recipe))
    fns += dense
    labels += [("dense", "bf16"), ("dense", "fp8")]
    ms = median_ms_each(fns, args.iters, args.warmup)

    def clear():
        x.grad = None
        for layer in layers.values():
            layer.zero_grad(set_to_none=True)
        for step in steps.values():
            step.zero_grad()
    peaks = [peak_gib(fn, clear) for fn in fns]
    record = {"shape": name, "experts": e, "m": m, "n": n, "k": k, "te_path": te_path,
              "cublaslt": tex.get_cublasLt_version(), "recipes": {}}
    for (column, recipe), t, gib in zip(labels, ms, peaks):
        one_flop = flop if column != "dense" else flop / 3
        entry = record["recipes"].setdefault(recipe, {})
        entry[column] = {"ms": t, "tflops": one_flop / (t * 1e-3) / 1e12, "peak_gib": gib,
                         "rel_error": errors.get((column, recipe))}
    for (column, recipe), why in refused.items():
        record["recipes"][recipe][column] = {"refused": why}
    for recipe in RECIPES:
        dense = record["recipes"]["bf16" if recipe == "bf16" else "fp8"]["dense"]["tflops"]
        record["recipes"][recipe]["ratios"] = ratios(record["recipes"][recipe], dense)
    return record


def ratios(row, dense):
    """Like for like: torchmoe with host splits over TE at its defaults, with device splits over
    TE's grouped path; torchmoe (host splits) over the dense GEMM of its dtype."""
    def over(ours, theirs):
        return row[ours]["tflops"] / row[theirs]["tflops"] if "tflops" in row[theirs] else None
    return {"over_te": over("torchmoe", "te"),
            "over_te_grouped": over("torchmoe_dev", "te_grouped"),
            "of_dense": row["torchmoe"]["tflops"] / dense}


def print_record(r):
    print(f"--- {r['shape']}: E={r['experts']} M={r['m']} N={r['n']} K={r['k']} "
          f"cuBLASLt {r['cublaslt']}; fwd+bwd TFLOP/s (peak GiB) max relative error; "
          f"te_grouped's path per recipe: {r['te_path']}")
    dense = {d: r["recipes"][d]["dense"]["tflops"] for d in ("bf16", "fp8")}
    print(f"  dense bf16 {dense['bf16']:7.1f}   dense FP8 {dense['fp8']:7.1f}")
    print(f"  {'recipe':8s}" + "".join(f"{c:>24s}" for c in COLUMNS) +
          "  torchmoe/te  torchmoe_dev/te_grouped  of dense")
    for recipe in RECIPES:
        row = r["recipes"][recipe]
        cells = "".join(
            f"{row[c]['tflops']:9.1f} ({row[c]['peak_gib']:5.2f}) {row[c]['rel_error']:6.0e}"
            if "tflops" in row[c] else f"{'refused':>24s}" for c in COLUMNS)
        q = row["ratios"]
        fmt = lambda v: f"{v:10.2f}x" if v is not None else f"{'-':>11s}"  # noqa: E731
        print(f"  {recipe:8s}{cells}  {fmt(q['over_te'])}  {fmt(q['over_te_grouped']):>22s}"
              f"  {q['of_dense']:8.2f}")
    for recipe in RECIPES:
        for c in COLUMNS:
            if "refused" in r["recipes"][recipe][c]:
                print(f"  {c} {recipe} refused: {r['recipes'][recipe][c]['refused']}")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--library", required=True, help="libtorchmoe_bench_classes.so")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)
    warnings.simplefilter("ignore", FutureWarning)
    torch.ops.load_library(args.library)
    import transformer_engine
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex
    from transformer_engine.common import recipe as te_recipe
    print(f"torch {torch.__version__}, transformer_engine {transformer_engine.__version__}, "
          f"cuBLASLt {tex.get_cublasLt_version()}, {torch.cuda.get_device_name()}", flush=True)
    records, mismatches = [], []
    for name in args.shapes.split(","):
        records.append(measure_shape(name, args, te, te_recipe, tex))
        print_record(records[-1])
        torch.cuda.empty_cache()
        for recipe, row in records[-1]["recipes"].items():
            for column, cell in row.items():
                error = cell.get("rel_error")
                if error is not None and not error <= TOLERANCE[recipe]:  # NaN fails too
                    mismatches.append(f"{name} {column} {recipe}: relative error {error:.3g} > "
                                      f"{TOLERANCE[recipe]}")
        if args.json:  # after every shape, so that a failure later keeps what was measured
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "iters": args.iters,
                           "records": records}, f, indent=1)
    if mismatches:
        print("outputs not near the reference:\n  " + "\n  ".join(mismatches))
        sys.exit(1)


if __name__ == "__main__":
    main()
