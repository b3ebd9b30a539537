#!/usr/bin/env python3
"""Plots a moe_lm training CSV (--csv) as a PNG: train/validation loss and the expert load range.

usage: scripts/plot_training.py TRAIN.csv [OUT.png]      (needs matplotlib: pip install matplotlib)
"""
import csv
import sys


def main(argv):
    if len(argv) not in (2, 3) or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    path = argv[1]
    out = argv[2] if len(argv) == 3 else path.rsplit(".", 1)[0] + ".png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_training.py needs matplotlib: python3 -m pip install matplotlib", file=sys.stderr)
        return 1
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        print(f"plot_training.py: cannot read {path}: {e.strerror}", file=sys.stderr)
        return 1
    if not rows or "loss" not in rows[0]:
        print(f"plot_training.py: {path} is not a moe_lm CSV (no rows or no 'loss' column)", file=sys.stderr)
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
