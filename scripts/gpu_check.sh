#!/usr/bin/env bash
# One device-machine call: build with the machine's own torch, run the whole test suite (CUDA cases
# included), the example, and the benchmarks (grouped GEMM with 4 and with 1 cuBLASLt stream,
# ScaledSwiGLU, GroupedMLP). Logs and JSON go to $OUT (8 files: the
# device tool returns at most 8); tables go to stdout.
# Catch2 travels in .device/catch2 (the GPU machine has no package registry).
#   device run: bash scripts/gpu_check.sh        (carry: .device)
set -uo pipefail
out=${OUT:-/tmp/torchmoe-out}
mkdir -p "$out"
torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
set -e
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_cmake;$PWD/.device/catch2" > "$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j 16 > "$out/build.log" 2>&1 || { grep -B2 -A8 error "$out/build.log" | head -60; exit 1; }
set +e
ctest --test-dir build-gpu --output-on-failure -j 4 > "$out/ctest.log" 2>&1
echo "ctest rc=$?"; tail -15 "$out/ctest.log"
build-gpu/examples/grouped_linear_regression --steps 150 > "$out/example.log" 2>&1
echo "example rc=$?"; tail -4 "$out/example.log"
build-gpu/bench/bench_grouped_linear --json "$out/bench_streams4.json"
TORCHMOE_CUBLASLT_STREAMS=1 build-gpu/bench/bench_grouped_linear --json "$out/bench_streams1.json"
build-gpu/bench/bench_glu --json "$out/bench_glu.json"
build-gpu/bench/bench_grouped_mlp --json "$out/bench_grouped_mlp.json"
