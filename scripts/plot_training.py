#!/usr/bin/env python3
"""Plots a moe_lm training CSV (--csv) as a PNG: train/validation loss and the expert load range;
or, with --compare, the losses of several runs (e.g. bf16 and each --fp8 recipe) in one PNG, each
run labelled by its file name.

usage: scripts/plot_training.py TRAIN.csv [OUT.png]
       scripts/plot_training.py --compare OUT.png A.csv B.csv ...
(needs matplotlib: apt-get install python3-matplotlib)
"""
import csv
import sys


def read_rows(path):
    """The CSV's rows, or None after printing why not."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        print(f"plot_training.py: cannot read {path}: {e.strerror}", file=sys.stderr)
        return None
    if not rows or "loss" not in rows[0]:
        print(f"plot_training.py: {path} is not a moe_lm CSV (no rows or no 'loss' column)", file=sys.stderr)
        return None
    return rows


def compare(plt, out, paths, window=50):
    """Train loss (mean over `window` steps) and validation loss of each run on one axis."""
    fig, ax = plt.subplots(figsize=(9, 5))
    for path in paths:
        rows = read_rows(path)
        if rows is None:
            return 1
        label = path.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        step = [int(r["step"]) for r in rows]
        loss = [float(r["loss"]) for r in rows]
        mean = [sum(loss[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(loss))]
        line = ax.plot(step, mean, label=f"{label}: train (mean of {window} steps)", linewidth=1)[0]
        val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{label}: validation")
    ax.set_xlabel("step")
    ax.set_ylabel("nats/byte")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle("moe_lm: loss per run")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


def main(argv):
    comparing = len(argv) >= 4 and argv[1] == "--compare"
    if not comparing and (len(argv) not in (2, 3) or argv[1] in ("-h", "--help", "--compare")):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_training.py needs matplotlib: apt-get install python3-matplotlib, or"
              " .venv/bin/pip install matplotlib and run it with .venv/bin/python", file=sys.stderr)
        return 1
    if comparing:
        return compare(plt, argv[2], argv[3:])
    path = argv[1]
    out = argv[2] if len(argv) == 3 else path.rsplit(".", 1)[0] + ".png"
    rows = read_rows(path)
    if rows is None:
        return 1

    step = [int(r["step"]) for r in rows]
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r["val_loss"]]
    fig, (ax_loss, ax_load) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ax_loss.plot(step, [float(r["loss"]) for r in rows], label="train loss", linewidth=1)
    if val:
        ax_loss.plot(*zip(*val), "o-", label="validation loss")
    ax_loss.plot(step, [float(r["aux_loss"]) for r in rows], label="router aux loss", linewidth=1)
    ax_loss.set_ylabel("nats/byte")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(True, alpha=0.3)
    ax_load.plot(step, [float(r["load_max"]) for r in rows], label="max expert load", linewidth=1)
    ax_load.plot(step, [float(r["load_min"]) for r in rows], label="min expert load", linewidth=1)
    ax_load.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="uniform")
    ax_load.set_ylabel("tokens / uniform share")
    ax_load.set_xlabel("step")
    ax_load.legend()
    ax_load.grid(True, alpha=0.3)
    fig.suptitle(f"moe_lm training: {path}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
