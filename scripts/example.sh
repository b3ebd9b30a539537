#!/usr/bin/env bash
# Sets up and builds if needed, then runs the example training loop (CUDA when a GPU is present,
# else CPU). Extra arguments go to the example, e.g. scripts/example.sh --steps 500.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
exec "${TORCHMOE_BUILD_DIR:-build}/examples/grouped_linear_regression" "$@"
