#!/usr/bin/env bash
# The example LM end to end on the CPU with a tiny config: the loss falls by a clear margin, a run
# split by a checkpoint gives the same next-step loss as an unbroken one, generation from the
# checkpoint prints text, and bad flags or data fail with a message and a non-zero exit.
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

echo "== generation from the checkpoint"
text=$("$bin" --resume "$work/ckpt.pt" --generate 40 --prompt "The ")
printf '%s\n' "$text"
[ "${#text}" -ge 44 ] || fail "generated text too short"

echo "== errors"
expect_error() {  # expected exit code, expected message, flags...
  local code=$1 message=$2
  shift 2
  set +e
  out=$("$bin" "$@" 2>&1)
  got=$?
  set -e
  [ "$got" -eq "$code" ] || fail "'$*' exited $got, expected $code"
  grep -qF -- "$message" <<<"$out" || fail "'$*' printed '$out', expected '$message'"
}
expect_error 2 "unknown flag '--bogus'" --bogus
expect_error 2 "--steps needs a value" --steps
expect_error 2 "--batch: value must be >= 1, got 0" --batch 0
expect_error 2 "--heads 3 must divide --hidden 128" --heads 3
expect_error 2 "--generate needs --resume" --generate 5
expect_error 1 "data file or directory '$work/missing' does not exist" --data "$work/missing"
expect_error 1 "checkpoint '$work/missing.pt' does not exist" --resume "$work/missing.pt" --generate 5
"$bin" --help | grep -q -- "--profile-moe" || fail "--help does not list every flag"
echo "PASS"
