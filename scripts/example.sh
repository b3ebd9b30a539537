#!/usr/bin/env bash
# Sets up and builds if needed, then trains the example MoE language model (examples/moe_lm) from
# its C++ loop: CUDA (bf16, fp32 masters) when a GPU is present, else CPU (about a minute on two
# cores). It builds only the library and the example (not the tests or benchmarks). The per-step
# log goes to build/moe_lm.csv (plot: scripts/plot_training.py). Extra arguments go to the
# example, e.g. scripts/example.sh --steps 1000 --save build/moe_lm.pt
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh moe_lm
build_dir=${TORCHMOE_BUILD_DIR:-build}
if [ ! -x "$build_dir/examples/moe_lm" ]; then
  echo "example.sh: $build_dir/examples/moe_lm was not built (is TORCHMOE_BUILD_EXAMPLES OFF?)" >&2
  exit 1
fi
exec "$build_dir/examples/moe_lm" --csv "$build_dir/moe_lm.csv" "$@"
