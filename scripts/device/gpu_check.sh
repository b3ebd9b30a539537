#!/usr/bin/env bash
# One device-machine call: build with the machine's own torch, run the whole test suite (CUDA cases
# included), the example LM at the measured config, and the benchmarks (grouped GEMM with 4 and
# with 1 cuBLASLt stream, ScaledSwiGLU, GroupedMLP, MoELayer by part). Logs and JSON go to $OUT (8 files: the
# device tool returns at most 8); tables go to stdout.
# Catch2 and fmt travel in .device/ (the GPU machine has no package registry).
#   device run: bash scripts/device/gpu_check.sh [tests] [example] [bench]     (carry: .device)
# With no arguments it does all three.
set -uo pipefail
out=${OUT:-/tmp/torchmoe-out}
mkdir -p "$out"
steps=${*:-tests example bench}
torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
set -e
{
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake;$PWD/.device/catch2;$PWD/.device/fmt" &&
    cmake --build build-gpu -j 16
} > "$out/build.log" 2>&1 || { grep -B2 -A8 -i error "$out/build.log" | head -60; exit 1; }
set +e
if [[ " $steps " == *" tests "* ]]; then
  ctest --test-dir build-gpu --output-on-failure -j 4 > "$out/ctest.log" 2>&1
  echo "ctest rc=$?"; grep -E "tests passed|Failed|\*\*\*" "$out/ctest.log" | tail -15
fi
if [[ " $steps " == *" example "* ]]; then
  # docs/performance.md's MoE LM config: 8 layers, hidden 1024, 32 experts top-2, ffn 1024,
  # seq 1024, 8 sequences per step.
  build-gpu/examples/moe_lm --layers 8 --hidden 1024 --heads 16 --experts 32 --topk 2 --ffn 1024 \
    --seq 1024 --batch 8 --steps 200 --warmup 20 --lr 1e-3 --log-every 20 --eval-every 100 \
    --csv "$out/moe_lm.csv" --profile-moe 20 > "$out/example.log" 2>&1
  echo "example rc=$?"; tail -8 "$out/example.log"
fi
if [[ " $steps " == *" bench "* ]]; then
  build-gpu/bench/bench_grouped_linear --json "$out/bench_streams4.json"
  # The 1-stream run's table is on stdout; its JSON stays on the machine (8 returned files).
  TORCHMOE_CUBLASLT_STREAMS=1 build-gpu/bench/bench_grouped_linear --json build-gpu/bench_streams1.json
  build-gpu/bench/bench_glu --json "$out/bench_glu.json"
  build-gpu/bench/bench_grouped_mlp --json "$out/bench_grouped_mlp.json"
  build-gpu/bench/bench_moe_layer --json "$out/bench_moe_layer.json"
fi
