#!/usr/bin/env bash
# Trains the example LM from C++ (build/examples/moe_lm: eager, then --cuda-graph) and the same
# model in PyTorch Python (examples/moe_lm/reference.py: eager, then torch.compile) on one GPU, with
# the same config, data and seed, and prints tokens/s side by side (each C++ run's speed over each
# column) and the loss curves every STEPS/10 steps.
#   scripts/compare_python.sh [STEPS] [OUT_DIR]     (defaults: 200, build/compare)
# Environment: TORCHMOE_BUILD_DIR (default build), PYTHON (a python with torch 2.11; default
# .venv/bin/python, which scripts/build.sh makes, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-200}
out=${2:-build/compare}
build=${TORCHMOE_BUILD_DIR:-build}
default_python=python3
[ -x .venv/bin/python ] && default_python=.venv/bin/python
python=${PYTHON:-$default_python}
# Checked before the C++ runs, which take minutes.
"$python" -c 'import torch' 2>/dev/null || {
  echo "compare_python.sh: '$python' cannot import torch; set PYTHON to a python with torch 2.11" >&2
  exit 1
}
mkdir -p "$out"
# docs/performance.md's config: 8 layers, hidden 1024, 32 experts top-2, ffn 1024, seq 1024 x 8.
config=(--layers 8 --hidden 1024 --heads 16 --experts 32 --topk 2 --ffn 1024 --seq 1024 --batch 8
  --steps "$steps" --warmup 20 --lr 1e-3 --log-every "$steps")
"$build/examples/moe_lm" "${config[@]}" --eval-every 0 --csv "$out/cpp.csv" | tail -2
"$build/examples/moe_lm" "${config[@]}" --eval-every 0 --cuda-graph --csv "$out/cpp_graph.csv" |
  tail -2 || echo "compare_python.sh: the --cuda-graph run failed (its column is left out)"
"$python" examples/moe_lm/reference.py "${config[@]}" --csv "$out/eager.csv" | tail -1
"$python" examples/moe_lm/reference.py "${config[@]}" --compile --csv "$out/compile.csv" | tail -1 ||
  echo "compare_python.sh: the torch.compile run failed (its column is left out)"
"$python" - "$out" "$steps" <<'PY'
import csv, sys
out, steps = sys.argv[1], int(sys.argv[2])
runs = {}
for name in ("cpp", "cpp_graph", "eager", "compile"):
    try:
        rows = list(csv.DictReader(open(f"{out}/{name}.csv")))
    except OSError:
        continue
    if len(rows) == steps:
        runs[name] = rows
print(f"{'':>12}" + "".join(f"{name:>12}" for name in runs))
print(f"{'avg tok/s':>12}" + "".join(f"{float(r[-1]['avg_tokens_per_s']):>12.0f}" for r in runs.values()))
for base in ("cpp", "cpp_graph"):
    if base not in runs:
        continue
    cpp = float(runs[base][-1]["avg_tokens_per_s"])
    print(f"{base + ' x':>12}" + "".join(f"{cpp / float(r[-1]['avg_tokens_per_s']):>12.2f}" for r in runs.values()))
for step in range(max(1, steps // 10), steps + 1, max(1, steps // 10)):
    print(f"{'loss @' + str(step):>12}" + "".join(f"{float(r[step - 1]['loss']):>12.4f}" for r in runs.values()))
PY
