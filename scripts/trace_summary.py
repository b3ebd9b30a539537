#!/usr/bin/env python3
"""Sums the GPU time of a Kineto trace (moe_lm --trace PATH) by part of the model.

usage: scripts/trace_summary.py TRACE.json [--steps N] [--top N] [--json OUT]

Each kernel, copy and fill on the GPU is put in one category by its name (the table below, first
match wins). Printed per step (the trace's span divided by --steps, which should be the number of
steps the trace holds, --trace-steps): wall time, GPU busy time (the union of all GPU intervals),
idle time (wall - busy: the GPU waiting for the host), and each category's time and share of busy;
with --top N, also the N kernels that took the most time.
"""
import argparse
import json
import re
import sys

# (category, regular expression over the kernel name), first match wins.
CATEGORIES = [
    ("expert GEMMs (torchmoe sm90)", r"grouped_gemm_sm90"),
    ("expert wgrad column sums", r"grouped_column_sum"),
    ("scaled SwiGLU", r"glu_(forward|backward)_kernel"),
    ("router (torchmoe)", r"router_(forward|backward)_kernel"),
    ("token permutation", r"routing_keys|row_map_kernel|permute_kernel|unpermute|RadixSort|Onesweep"),
    ("optimizer (FusedAdamW, norm)", r"adamw_kernel|sum_of_squares|finish_norm"),
    ("attention (SDPA)", r"flash|fmha|attention"),
    ("dense GEMMs (cuBLAS)", r"gemm|nvjet|cutlass|xmma|sm90_|Kernel2"),
    ("loss (log-softmax, NLL)", r"softmax|nll_loss"),
    ("embedding", r"embedding|indexSelect|index_select|EmbeddingBag|krn_partial|compute_grad_weight|sum_and_scatter"),
    ("top-k, sort, scatter", r"topk|sort|scatter|gather|bitonic|radix"),
    ("reductions", r"reduce_kernel|Reduce"),
    ("elementwise", r"elementwise|vectorized|unrolled|fill|copy"),
]
COPY = "copies and fills (memcpy/memset)"


def category(name):
    for label, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def union_length(intervals):
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=5, help="steps the trace holds (default 5)")
    p.add_argument("--top", type=int, default=0, help="also list the N most expensive kernels")
    p.add_argument("--json", help="also write the summary as JSON")
    a = p.parse_args()
    events = json.load(open(a.trace))["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        sys.exit(f"{a.trace}: no GPU events (a CPU run, or CUPTI was unavailable)")
    timed = [e for e in events if e.get("ph") == "X" and "dur" in e]
    wall = max(e["ts"] + e["dur"] for e in timed) - min(e["ts"] for e in timed)
    busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    sums, counts = {}, {}
    for e in gpu:
        label = category(e["name"]) if e["cat"] == "kernel" else COPY
        sums[label] = sums.get(label, 0.0) + e["dur"]
        counts[label] = counts.get(label, 0) + 1
    n = a.steps
    kernel_sum = sum(sums.values())
    print(f"per step (of {n}): wall {wall / n / 1e3:.2f} ms, GPU busy {busy / n / 1e3:.2f} ms "
          f"({100 * busy / wall:.1f}%), GPU idle {(wall - busy) / n / 1e3:.2f} ms")
    print(f"{'part':<36}{'ms/step':>10}{'% of busy':>11}{'launches/step':>15}")
    for label, total in sorted(sums.items(), key=lambda kv: -kv[1]):
        # Kernels on several streams can overlap, so the shares are of the summed kernel time.
        print(f"{label:<36}{total / n / 1e3:>10.3f}{100 * total / kernel_sum:>10.1f}%"
              f"{counts[label] / n:>15.0f}")
    if a.top:
        by_name = {}
        for e in gpu:
            by_name.setdefault(e["name"], []).append(e["dur"])
        print(f"{'kernel':<100}{'ms/step':>10}{'calls/step':>12}")
        for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[: a.top]:
            short = name if len(name) <= 98 else name[:95] + "..."
            print(f"{short:<100}{sum(durs) / n / 1e3:>10.3f}{len(durs) / n:>12.0f}")
    if a.json:
        json.dump({"steps": n, "wall_ms": wall / n / 1e3, "busy_ms": busy / n / 1e3,
                   "parts_ms": {k: v / n / 1e3 for k, v in sums.items()},
                   "launches": {k: counts[k] / n for k in counts}}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
