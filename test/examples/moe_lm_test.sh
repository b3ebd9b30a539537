#!/usr/bin/env bash
# The example LM end to end on the CPU with a tiny config: the loss falls by a clear margin, a run
# split by a checkpoint gives the same next-step loss as an unbroken one, generation from the
# checkpoint prints text, progress reaches a pipe while the run goes on, and bad flags, data or
# output paths fail with a message (every stderr line starting "moe_lm: ") and a non-zero exit.
# usage: moe_lm_test.sh MOE_LM_BINARY WORK_DIR
set -euo pipefail
bin=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
fail() { echo "FAIL: $*" >&2; exit 1; }

tiny=(--device cpu --layers 1 --hidden 32 --heads 2 --experts 4 --topk 2 --ffn 64 --seq 32
      --batch 8 --warmup 5 --lr 1e-2 --eval-every 0 --eval-batches 2 --log-every 10)

echo "== the loss falls"
"$bin" "${tiny[@]}" --steps 40 --csv "$work/train.csv"
awk -F, 'NR == 2 { first = $2 } NR > 31 { sum += $2; n++ }
         END { last = sum / n; printf "first loss %.4f, mean of the last 10 steps %.4f\n", first, last
               exit !(first - last > 1.0) }' "$work/train.csv" || fail "loss did not fall by > 1.0 nat"

echo "== checkpoint and resume give the same next step"
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --csv "$work/straight.csv"
"$bin" "${tiny[@]}" --steps 30 --stop-at 20 --save "$work/ckpt.pt"
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --resume "$work/ckpt.pt" --csv "$work/resumed.csv"
straight=$(awk -F, '$1 == 21 { print $2 }' "$work/straight.csv")
resumed=$(awk -F, '$1 == 21 { print $2 }' "$work/resumed.csv")
echo "step 21 loss: unbroken $straight, resumed $resumed"
[ -n "$straight" ] && [ "$straight" = "$resumed" ] || fail "resumed step 21 loss differs"
# Resumed into the CSV of a run that went past the checkpoint: the rows after step 20 are
# replaced, not repeated.
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --resume "$work/ckpt.pt" --csv "$work/straight.csv"
rows=$(awk -F, 'NR > 1 { n[$1]++ } END { for (s in n) if (n[s] != 1) bad++; print NR - 1, bad + 0 }' \
  "$work/straight.csv")
[ "$rows" = "21 0" ] || fail "resumed CSV: expected steps 1-21 once each, got (rows, repeated) $rows"

echo "== --expert-bias steers the routing and resumes with its bias"
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --expert-bias --csv "$work/bias.csv"
"$bin" "${tiny[@]}" --steps 30 --stop-at 20 --expert-bias --save "$work/bias.pt"
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --resume "$work/bias.pt" --csv "$work/bias_resumed.csv"
biased=$(awk -F, '$1 == 21 { print $2 }' "$work/bias.csv")
bias_resumed=$(awk -F, '$1 == 21 { print $2 }' "$work/bias_resumed.csv")
echo "step 21 loss: no bias $straight, bias $biased, bias resumed $bias_resumed"
[ -n "$biased" ] && [ "$biased" != "$straight" ] || fail "--expert-bias changed nothing"
[ "$biased" = "$bias_resumed" ] || fail "a resumed --expert-bias run differs"

echo "== every --moe-block trains, and resumes with its block"
for block in olmoe qwen3 qwen2 deepseek-v3 gpt-oss llama4; do
  "$bin" "${tiny[@]}" --steps 25 --moe-block "$block" --csv "$work/block_$block.csv" \
    > "$work/block_$block.log"
  grep -q "($block block)" "$work/block_$block.log" || fail "--moe-block $block: not announced"
  awk -F, 'NR == 2 { first = $2 } NR > 16 { sum += $2; n++ }
           END { last = sum / n; printf "'"$block"': first loss %.4f, last 10 %.4f\n", first, last
                 exit !(first - last > 0.5) }' "$work/block_$block.csv" \
    || fail "--moe-block $block: loss did not fall by > 0.5 nat"
done
"$bin" "${tiny[@]}" --steps 30 --stop-at 20 --moe-block deepseek-v3 --save "$work/block.pt"
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --moe-block deepseek-v3 --csv "$work/block_straight.csv"
"$bin" "${tiny[@]}" --steps 30 --stop-at 21 --resume "$work/block.pt" --csv "$work/block_resumed.csv"
[ "$(awk -F, '$1 == 21 { print $2 }' "$work/block_straight.csv")" = \
  "$(awk -F, '$1 == 21 { print $2 }' "$work/block_resumed.csv")" ] \
  || fail "a resumed --moe-block deepseek-v3 run differs"

echo "== generation from the checkpoint"
text=$("$bin" --resume "$work/ckpt.pt" --generate 40 --prompt "The ")
printf '%s\n' "$text"
[ "${#text}" -ge 44 ] || fail "generated text too short"

echo "== progress reaches a pipe before the run ends"
# stdout is a pipe, so it is fully buffered unless each line is flushed: the first step line (the
# only one for a long time) must arrive while the run is still going.
mkfifo "$work/progress"
"$bin" "${tiny[@]}" --steps 1000000 --log-every 1000000 >"$work/progress" &
pid=$!
exec 3<"$work/progress"
line=
while IFS= read -r -t 60 line <&3 && [[ $line != step* ]]; do :; done
running=0
kill -0 "$pid" 2>/dev/null && running=1
kill "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
exec 3<&-
[[ $line == step* ]] && ((running)) || fail "no step line in the pipe while the run was going"
echo "$line"

echo "== errors"
expect_error() {  # expected exit code, expected message, flags...
  local code=$1 message=$2
  shift 2
  set +e
  out=$("$bin" "$@" 2>&1 >/dev/null)  # stderr only
  got=$?
  set -e
  [ "$got" -eq "$code" ] || fail "'$*' exited $got, expected $code"
  grep -qF -- "$message" <<<"$out" || fail "'$*' printed '$out', expected '$message'"
  ! grep -qv '^moe_lm: ' <<<"$out" || fail "'$*' printed an error line not starting 'moe_lm: ': '$out'"
}
expect_error 2 "unknown flag '--bogus'" --bogus
expect_error 2 "--steps needs a value" --steps
expect_error 2 "--batch: value must be >= 1, got 0" --batch 0
expect_error 2 "--steps: value must be >= 1, got 0" --steps 0
expect_error 1 "nothing to train: the checkpoint is at step 20, and --steps 30 --stop-at 20 ends" \
  "${tiny[@]}" --resume "$work/ckpt.pt" --steps 30 --stop-at 20
expect_error 2 "--heads 3 must divide --hidden 128" --heads 3
expect_error 2 "--generate needs --resume" --generate 5
expect_error 2 "--moe-block must be one of mixtral, olmoe, qwen3, qwen2, deepseek-v3, gpt-oss, \
llama4, got 'switch'" --moe-block switch
expect_error 2 "--cuda-graph needs --device cuda" --cuda-graph --device cpu
expect_error 2 "--fp8 must be delayed, current or block, got 'e5m2'" --fp8 e5m2
expect_error 2 "--fp8 needs --device cuda" --fp8 delayed --device cpu
expect_error 2 "--fp8: value must be delayed, current or block" --fp8 ""
expect_error 2 "--lr: value must fit a float32, got 1e308" --lr 1e308
expect_error 2 "--min-lr-ratio must be at most 1 (the final rate is at most --lr), got 2" \
  --min-lr-ratio 2
expect_error 2 "--stop-at (9) must be at most --steps (5), the schedule's end" --steps 5 --stop-at 9
# A diverged run stops with an error rather than training on NaN and exiting 0.
expect_error 1 "training diverged" "${tiny[@]}" --steps 3 --weight-decay 1e30
if ! nvidia-smi -L >/dev/null 2>&1; then  # --device auto finds no GPU
  expect_error 1 "--fp8 needs CUDA (FP8 GEMMs are CUDA only), but no CUDA device is available" \
    "${tiny[@]}" --device auto --fp8 delayed
fi
expect_error 1 "data file or directory '$work/missing' does not exist" --data "$work/missing"
expect_error 1 "checkpoint '$work/missing.pt' does not exist" --resume "$work/missing.pt" --generate 5
# Output paths are checked before training: no step line, no minutes of lost work.
expect_error 1 "moe_lm: --save: cannot write '$work/none/x.pt': directory '$work/none' does not exist" \
  "${tiny[@]}" --steps 5 --save "$work/none/x.pt"
expect_error 1 "moe_lm: --csv: cannot write '$work/none/x.csv': directory '$work/none' does not exist" \
  "${tiny[@]}" --steps 5 --csv "$work/none/x.csv"
expect_error 1 "moe_lm: --trace: cannot write '$work/none/t.json': directory '$work/none' does not exist" \
  "${tiny[@]}" --steps 5 --trace "$work/none/t.json"
steps=$("$bin" "${tiny[@]}" --steps 5 --save "$work/none/x.pt" 2>/dev/null || true)
! grep -q '^step' <<<"$steps" || fail "--save into a missing directory trained before failing"
# --trace writes a chrome-trace JSON of the steps asked for.
"$bin" "${tiny[@]}" --steps 4 --trace "$work/t.json" --trace-steps 2 >/dev/null 2>&1 ||
  fail "a run with --trace failed"
grep -q '"traceEvents"' "$work/t.json" || fail "--trace did not write a chrome trace"
# Captured first: grep -q leaves at its match, and the rest of the help would hit a closed pipe.
help=$("$bin" --help)
grep -q -- "--profile-moe" <<<"$help" || fail "--help does not list every flag"
echo "PASS"
