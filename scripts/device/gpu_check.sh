#!/usr/bin/env bash
# The GPU machine's script: builds with the machine's own torch, then runs the steps asked for, in
# order. Run from the repository root with .device carried (Catch2, fmt and gloo's headers: the
# machine has no package registry; docs/build.md says how to fill it):
#   device run: bash scripts/device/gpu_check.sh [tests] [sanitize] [example] [bench] [te] ...
# With no arguments it does tests, example and bench.
#   tests     ctest, every case (CUDA included); CTEST_ARGS narrows it (e.g. "-R sm90")
#   sanitize  compute-sanitizer memcheck on the sm90 GEMM, token-permutation, optimizer, router and
#             CUDA-graph cases, racecheck on the sm90 small cases (every kernel path);
#             SANITIZE_ONLY=memcheck or racecheck runs one tool, SANITIZE_RUNS="tool|filter ..."
#             replaces the list
#   blocks    the example LM with every --moe-block, captured, in bf16 and FP8 (small config)
#   example   the example LM at docs/performance.md's config, eager and with --cuda-graph, each with
#             a trace of 5 steps summed by part (scripts/trace_summary.py)
#   compare   scripts/compare_python.sh: the example next to the same model in PyTorch Python
#   bench     the benchmark programs; BENCHES narrows them (e.g. "grouped_linear glu"),
#             BENCH_SHAPES the shapes (e.g. "qwen3-30b-a3b,olmoe")
#   te        bench/bench_te_grouped_linear.py: the GroupedLinear module next to TransformerEngine
#             2.20.2's, in one process taking turns (TE's wheels carried in .te/wheels-sm90, from
#             ../shared/device/te; installed into /tmp/te-site once per machine)
#   baseline  BASELINE=<tar of another tree, e.g. git archive of the previous commit>: builds it
#             into build-base (its library and BENCHES' programs), then runs each of BENCHES on
#             both builds taking turns, BASELINE_ROUNDS times (default 2); the tables go to stdout
# CUBLAS13=1: after the build, every step runs with cuBLAS 13.10 preloaded (carried to the machine
# as ../shared/device/cublas13/README.md says), so the cuBLASLt grouped backend is available.
# Logs and JSON go to $OUT (the device tool returns at most 8 files); tables go to stdout.
set -uo pipefail
out=${OUT:-/tmp/torchmoe-out}
mkdir -p "$out"
steps=${*:-tests example bench}
torch_cmake=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
start=$SECONDS
{
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_cmake;$PWD/.device/catch2;$PWD/.device/fmt;$PWD/.device/gloo;$PWD/.device/nlohmann" &&
    cmake --build build-gpu -j 16
} > "$out/build.log" 2>&1 || { grep -B2 -A8 -E "error|FAILED" "$out/build.log" | head -60; exit 1; }
echo "build ok ($((SECONDS - start)) s)"
if [ -n "${CUBLAS13:-}" ]; then
  export LD_PRELOAD="/root/cublas13/lib/libcublasLt.so.13 /root/cublas13/lib/libcublas.so.13"
  echo "preloading cuBLAS 13.10 (torchmoe_tests sees: $(build-gpu/test/torchmoe_tests \
    'the loaded cuBLASLt is reported' -s 2>&1 | grep -m1 -o 'cuBLASLt [0-9]* from .*'))"
fi

# The [hf] cases' reference data, made here by test/reference/hf_moe_blocks.py (the machine has no
# transformers): ctest then runs them without their fixture.
hf_args=()
if [ -d .device/hf_reference ]; then
  mkdir -p build-gpu/test/hf_reference && cp .device/hf_reference/*.safetensors build-gpu/test/hf_reference/
  hf_args=(--fixture-exclude-setup hf_reference)
fi

if [[ " $steps " == *" tests "* ]]; then
  # shellcheck disable=SC2086
  ctest --test-dir build-gpu --output-on-failure -j 8 --timeout 400 "${hf_args[@]}" ${CTEST_ARGS:-} \
    > "$out/ctest.log" 2>&1
  echo "ctest rc=$?"
  grep -E "tests passed|Failed|\*\*\*|Not Run" "$out/ctest.log" | grep -v Skipped | tail -15
fi

if [[ " $steps " == *" sanitize "* ]]; then
  # racecheck is slow: it runs the hidden small-case test (no 160k-row case).
  n=0
  # shellcheck disable=SC2206
  runs=(${SANITIZE_RUNS:-"memcheck|[sm90]" "memcheck|[permutation][cuda]" "memcheck|[optim][cuda]"
    "memcheck|[router][cuda]" "memcheck|[graph]" "racecheck|[sm90-small]"
    "racecheck|*clamps device splits*"})
  for run in "${runs[@]}"; do
    tool=${run%%|*} filter=${run#*|} n=$((n + 1))
    [ -n "${SANITIZE_ONLY:-}" ] && [ "$tool" != "$SANITIZE_ONLY" ] && continue
    echo "compute-sanitizer --tool $tool on $filter:"
    timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      build-gpu/test/torchmoe_tests "$filter" > "$out/sanitize$n.log" 2>&1
    echo "rc=$?"; tail -3 "$out/sanitize$n.log"
  done
fi

if [[ " $steps " == *" example "* ]]; then
  # docs/performance.md's MoE LM config: 8 layers, hidden 1024, 32 experts top-2, ffn 1024,
  # seq 1024, 8 sequences per step.
  for mode in eager graph; do
    extra=(--profile-moe 20)
    [ "$mode" = graph ] && extra=(--cuda-graph)
    build-gpu/examples/moe_lm --layers 8 --hidden 1024 --heads 16 --experts 32 --topk 2 \
      --ffn 1024 --seq 1024 --batch 8 --steps 200 --warmup 20 --lr 1e-3 --log-every 20 \
      --eval-every 100 --csv "$out/moe_lm_$mode.csv" --trace "$out/trace_$mode.json" \
      "${extra[@]}" > "$out/example_$mode.log" 2>&1
    echo "example ($mode) rc=$?"; tail -6 "$out/example_$mode.log"
    python3 scripts/trace_summary.py "$out/trace_$mode.json" --steps 5 --top "${TRACE_TOP:-0}" \
      --json "$out/trace_summary_$mode.json"
    rm -f "$out/trace_$mode.json"  # tens of MB; the summary is what is kept
  done
fi

if [[ " $steps " == *" blocks "* ]]; then
  # Every --moe-block trains with --cuda-graph (and FP8 delayed) at a small config: its last
  # logged loss and tokens/s.
  for block in mixtral olmoe qwen3 qwen2 deepseek-v3 gpt-oss llama4; do
    for fp8 in "" delayed; do
      build-gpu/examples/moe_lm --layers 2 --hidden 256 --heads 4 --experts 8 --topk 2 --ffn 256 \
        --seq 256 --batch 16 --steps 60 --warmup 10 --log-every 20 --eval-every 0 --cuda-graph \
        --moe-block "$block" ${fp8:+--fp8 $fp8} > "$out/block_${block}_${fp8:-bf16}.log" 2>&1
      echo "moe_lm --moe-block $block ${fp8:+--fp8 $fp8} --cuda-graph rc=$? | $(grep -E '^step' \
        "$out/block_${block}_${fp8:-bf16}.log" | tail -1)"
    done
  done
fi

if [[ " $steps " == *" compare "* ]]; then
  TORCHMOE_BUILD_DIR=build-gpu scripts/compare_python.sh 200 "$out/compare" 2>&1 | tail -20
fi

if [[ " $steps " == *" bench "* ]]; then
  for bench in ${BENCHES:-grouped_linear glu grouped_mlp moe_layer optimizer}; do
    build-gpu/bench/bench_$bench --json "$out/bench_$bench.json" \
      ${BENCH_SHAPES:+--shapes $BENCH_SHAPES}
    echo "bench_$bench rc=$?"
  done
fi

if [[ " $steps " == *" te "* ]]; then
  site=/tmp/te-site
  [ -d "$site/transformer_engine" ] || python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target "$site" .te/wheels-sm90/*.whl > "$out/te_install.log" 2>&1 ||
    echo "TE's install failed: $out/te_install.log"
  PYTHONPATH=$site NVTE_FRAMEWORK=pytorch python3 -W ignore bench/bench_te_grouped_linear.py \
    --library build-gpu/bench/libtorchmoe_bench_classes.so --json "$out/bench_te_grouped_linear.json" \
    ${BENCH_SHAPES:+--shapes $BENCH_SHAPES}
  echo "bench_te_grouped_linear rc=$?"
fi

if [[ " $steps " == *" baseline "* ]]; then
  # Extracted once: a second extraction would date every file anew and rebuild build-base whole.
  base_src=/tmp/torchmoe-base
  [ -d "$base_src" ] || { mkdir -p "$base_src" && tar -xf "$BASELINE" -C "$base_src"; }
  base_targets=()
  for bench in ${BENCHES:-split_quantize glu}; do base_targets+=("bench_$bench"); done
  start=$SECONDS
  {
    cmake -S "$base_src" -B build-base -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$torch_cmake;$PWD/.device/catch2;$PWD/.device/fmt;$PWD/.device/gloo;$PWD/.device/nlohmann" &&
      cmake --build build-base -j 16 --target "${base_targets[@]}"
  } > "$out/build_base.log" 2>&1 || { grep -B2 -A8 -E "error|FAILED" "$out/build_base.log" | head -40; exit 1; }
  echo "baseline build ok ($((SECONDS - start)) s)"
  for round in $(seq "${BASELINE_ROUNDS:-2}"); do
    for bench in ${BENCHES:-split_quantize glu}; do
      for build in build-gpu build-base; do
        echo "== round $round: $build bench_$bench"
        "$build/bench/bench_$bench" --json "/tmp/${bench}_${build}_$round.json" \
          ${BENCH_SHAPES:+--shapes $BENCH_SHAPES} 2>&1 | tail -n "${BASELINE_TAIL:-12}"
      done
    done
  done
fi
