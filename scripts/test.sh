#!/usr/bin/env bash
# Sets up and builds if needed, then runs the whole test suite with ctest. Without a GPU the
# [cuda] cases are reported as skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
exec ctest --test-dir "${TORCHMOE_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
