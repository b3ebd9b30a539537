#!/usr/bin/env python3
"""Sustained dense GEMM throughput next to the SM clock and power it ran at (torch's cuBLAS).

usage: scripts/dense_gemm_clocks.py [--m M] [--n N] [--k K] [--seconds S] [--reps R]

Runs y = a·bᵀ for S seconds per variant (bf16; FP8 e4m3 through torch._scaled_mm with cuBLAS's
split accumulation and with fast accumulation), R rounds, while nvidia-smi samples the SM clock,
the power draw and the throttle reasons every 20 ms, and prints per run the TFLOP/s and the
samples' clock, power and how many had the power-cap reason set. The default shape is mixtral's
fc1 (docs/performance.md): the ratio of the FP8 rows to the bf16 row is what the dense reference
reaches when both run at the board's power limit.
"""
import argparse
import statistics
import subprocess
import tempfile
import time

import torch

POWER_CAP = 0x4  # clocks_throttle_reasons: SW power cap


def sample_rows(path):
    rows = []
    for line in open(path):
        fields = [f.strip() for f in line.split(",")]
        try:
            stamp = time.mktime(time.strptime(fields[0][:19], "%Y/%m/%d %H:%M:%S"))
            rows.append((stamp + float("0." + fields[0][20:23]), float(fields[1]),
                         float(fields[2]), int(fields[3], 16)))
        except (ValueError, IndexError):
            continue  # a partial last line
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=16384)
    parser.add_argument("--n", type=int, default=28672)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.k, device="cuda", dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    variants = {
        "bf16": lambda: a @ b.t(),
        "fp8": lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16),
        "fp8 fast acc": lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16,
                                                 use_fast_accum=True),
    }
    log = tempfile.NamedTemporaryFile(suffix=".csv")
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active",
         "--format=csv,noheader,nounits", "-lms", "20"], stdout=open(log.name, "w"))
    time.sleep(1.0)
    runs = []
    for _ in range(args.reps):
        for name, fn in variants.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin = time.time()
            start.record()
            calls = 0
            while time.time() - begin < args.seconds:
                for _ in range(10):
                    fn()
                calls += 10
                torch.cuda.synchronize()
            stop.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(stop) / calls
            # The first half second is left out of the samples: the clock settles.
            runs.append((name, begin + 0.5, time.time(), 2.0 * args.m * args.n * args.k / ms * 1e-9))
            time.sleep(1.0)
    smi.terminate()
    smi.wait()
    rows = sample_rows(log.name)
    print(f"y = a·bᵀ, m {args.m}, n {args.n}, k {args.k}, {torch.cuda.get_device_name()}")
    for name, begin, end, tflops in runs:
        s = [r for r in rows if begin <= r[0] <= end]
        if not s:
            print(f"{name:13s} {tflops:7.1f} TFLOP/s  (no clock samples)")
            continue
        clocks, power = [r[1] for r in s], [r[2] for r in s]
        capped = sum(1 for r in s if r[3] & POWER_CAP)
        print(f"{name:13s} {tflops:7.1f} TFLOP/s  clock {statistics.median(clocks):.0f} MHz "
              f"(min {min(clocks):.0f})  power {statistics.median(power):.0f} W  "
              f"power-capped {capped}/{len(s)} samples")


if __name__ == "__main__":
    main()
