#!/usr/bin/env bash
# Sets up and builds what ctest runs (the library, which the consumer_find_package test installs;
# the Catch2 tests; the example LM), then runs the whole test suite with ctest. The benchmarks are
# not built. Without a GPU the [cuda] cases are reported as skipped. Installs the Python packages
# the reference models need (test/reference/requirements.txt) beside torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The [hf] cases' reference is Hugging Face transformers' own MoE code (test/reference/).
TORCHMOE_PYTHON_REQUIREMENTS=test/reference/requirements.txt \
  scripts/build.sh torchmoe torchmoe_tests torchmoe_ep_tests moe_lm
exec ctest --test-dir "${TORCHMOE_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)"
