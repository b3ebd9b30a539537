#!/usr/bin/env bash
# One device call: build, run the sm90 + graph tests and the CUDA GEMM tests, then the GEMM benchmark
# (BENCH=1) and compute-sanitizer memcheck + racecheck on the sm90 kernel tests (SANITIZE=1).
# Run from the repository root; Catch2 and fmt travel in .device/ (see docs/build.md).
#   device run: [TESTS=filter] [BENCH=1 [BENCH_SHAPES=a,b]] [SANITIZE=1 [SANITIZE_ONLY=memcheck|racecheck]]
#               bash scripts/device/gpu_sm90.sh     (carry: .device)
set -uo pipefail
torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTORCHMOE_BUILD_EXAMPLES=OFF \
  -DCMAKE_PREFIX_PATH="$torch_cmake;$PWD/.device/catch2;$PWD/.device/fmt" > $OUT/cmake.log 2>&1 || { tail -30 $OUT/cmake.log; exit 1; }
cmake --build build-gpu -j 16 > $OUT/build.log 2>&1 || { grep -E "error|FAILED" -A3 $OUT/build.log | head -60; exit 1; }
echo "build ok"
cuobjdump -sass build-gpu/libtorchmoe.so 2>/dev/null | grep -c HGMMA
cd build-gpu
timeout 300 ./test/torchmoe_tests "${TESTS:-[sm90],[graph],[ops][cuda]}" 2>&1 | tail -60
if [ -n "${BENCH:-}" ]; then
  timeout 200 ./bench/bench_grouped_linear --json $OUT/bench_grouped_linear.json --iters 10 --warmup 3 ${BENCH_SHAPES:+--shapes $BENCH_SHAPES} 2>&1 | tail -50
fi
if [ -n "${SANITIZE:-}" ]; then
  # racecheck is slow: it runs the hidden small-case test (every kernel path, no 160k-row case).
  for run in "memcheck|[sm90]" "racecheck|[sm90-small]" "racecheck|*clamps device splits*"; do
    tool=${run%%|*} filter=${run#*|}
    [ -n "${SANITIZE_ONLY:-}" ] && [ "$tool" != "$SANITIZE_ONLY" ] && continue
    echo "compute-sanitizer --tool $tool on $filter:"
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 ./test/torchmoe_tests "$filter" 2>&1 | tail -6
    echo "rc=${PIPESTATUS[0]}"
  done
fi
