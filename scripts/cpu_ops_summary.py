#!/usr/bin/env python3
"""Sums the host time of a Kineto trace's CPU ops by name (inclusive), largest first.

usage: scripts/cpu_ops_summary.py TRACE.json [--steps N] [--top N]

Complements scripts/trace_summary.py (GPU time by part): on a host-bound step the ops listed here
are where the time goes. Times are per step (total / --steps), in microseconds, with call counts.
"""
import argparse
import collections
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    total = collections.Counter()
    count = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    print(f"{'us/step':>10} {'calls/step':>10}  op (inclusive host time)")
    for name, dur in total.most_common(args.top):
        print(f"{dur / args.steps:10.1f} {count[name] / args.steps:10.1f}  {name}")


if __name__ == "__main__":
    main()
