#!/usr/bin/env bash
# The example LM with expert parallelism on the CPU (Gloo), launched by torchrun as 2 processes:
# its losses, gradient norms and validation losses equal a single process's on the same global
# batch, across a resume from its per-rank checkpoints; merged into one, they resume in a single
# process as the --ep run went on; rank 0 alone reports; and the errors of --ep without torchrun, of shapes it cannot split, of
# --cuda-graph, of a rank's file resumed alone, of the ranks' files of different saves and of a
# merge of missing files.
# usage: moe_lm_ep_test.sh MOE_LM_BINARY WORK_DIR TORCHRUN FIRST_PORT
set -euo pipefail
bin=$1
work=$2
torchrun=$3
port=$4
rm -rf "$work"
mkdir -p "$work"
# One thread, as torchrun gives each worker: the single-process runs then sum in the same order.
export OMP_NUM_THREADS=1
fail() { echo "FAIL: $*" >&2; exit 1; }

tiny=(--device cpu --layers 2 --hidden 32 --heads 2 --experts 4 --topk 2 --ffn 64 --seq 32
      --batch 8 --warmup 3 --lr 1e-2 --steps 12 --eval-every 4 --eval-batches 2 --log-every 1)
# Each launch on a port of its own, so that none waits for the last one's to be released.
ep2() {
  local rc=0
  "$torchrun" --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port" --no-python \
    "$bin" --ep 2 "$@" || rc=$?
  port=$((port + 1))
  return "$rc"
}
# The columns loss, aux_loss, grad_norm and val_loss of two CSVs agree to `tol` on the steps
# both have from `first`; the float32 sums run in another order over 2 ranks.
same_columns() {  # csv csv first tol
  awk -F, -v first="$3" -v tol="$4" '
    NR == FNR { if (FNR > 1) { l[$1] = $2; a[$1] = $3; g[$1] = $5; v[$1] = $10 } next }
    FNR > 1 && $1 >= first && ($1 in l) {
      n++
      d = l[$1] - $2; if (d < 0) d = -d; if (d > worst) worst = d
      d = a[$1] - $3; if (d < 0) d = -d; if (d > worst) worst = d
      d = g[$1] - $5; if (d < 0) d = -d; if (d > worst) worst = d
      if ((v[$1] == "") != ($10 == "")) bad = 1
      if ($10 != "") { d = v[$1] - $10; if (d < 0) d = -d; if (d > worst) worst = d }
    }
    END { printf "%d steps compared, largest difference %.3g\n", n, worst
          exit !(n > 0 && !bad && worst <= tol) }' "$1" "$2"
}

echo "== --ep 2 trains as one process does on the same global batch, resumed from its files too"
"$bin" "${tiny[@]}" --stop-at 8 --csv "$work/single.csv" >/dev/null
ep2 "${tiny[@]}" --stop-at 4 --save "$work/ckpt.pt" --csv "$work/ep.csv" >"$work/ep.log"
for r in 0 1; do [ -f "$work/ckpt.pt.rank$r-of-2" ] || fail "no checkpoint file for rank $r"; done
# A resumed run appends to its CSV.
ep2 "${tiny[@]}" --stop-at 8 --resume "$work/ckpt.pt" --csv "$work/ep.csv" >>"$work/ep.log"
cat "$work/ep.log"
same_columns "$work/single.csv" "$work/ep.csv" 1 1e-4 || fail "--ep 2 differs from one process"
[ "$(grep -c '^step ' "$work/ep.log")" -eq 8 ] || fail "not exactly one progress line per step"

echo "== the merged checkpoint resumes in one process as the --ep 2 run went on"
"$bin" --merge-checkpoint "$work/ckpt.pt" --ep 2 --save "$work/merged.pt"
"$bin" "${tiny[@]}" --stop-at 8 --resume "$work/merged.pt" --csv "$work/merged_resumed.csv" \
  >/dev/null
same_columns "$work/ep.csv" "$work/merged_resumed.csv" 5 1e-4 ||
  fail "one process resumed from the merged checkpoint differs from the --ep 2 run"

echo "== errors"
expect_error() {  # expected exit code, expected message, command...
  local code=$1 message=$2
  shift 2
  set +e
  out=$("$@" 2>&1 >/dev/null)  # stderr only
  got=$?
  set -e
  [ "$got" -eq "$code" ] || fail "'$*' exited $got, expected $code: $out"
  grep -qF -- "$message" <<<"$out" || fail "'$*' printed '$out', expected '$message'"
}
expect_error 1 "moe_lm: --ep 2 runs as 2 processes launched by torchrun" \
  env -u WORLD_SIZE "$bin" "${tiny[@]}" --ep 2
expect_error 1 "so WORLD_SIZE must be 2, got WORLD_SIZE=4" \
  env WORLD_SIZE=4 "$bin" "${tiny[@]}" --ep 2
expect_error 2 "moe_lm: --ep 3 must divide --experts 4" "$bin" "${tiny[@]}" --ep 3
expect_error 2 "moe_lm: --ep 2 must divide --batch 3" "$bin" --ep 2 --batch 3
expect_error 2 "moe_lm: --cuda-graph does not work with --ep" "$bin" --ep 2 --cuda-graph
expect_error 2 "moe_lm: --merge-checkpoint needs --ep N" "$bin" --merge-checkpoint "$work/ckpt.pt"
expect_error 1 "is rank 1's file of an --ep 2 run" \
  "$bin" "${tiny[@]}" --resume "$work/ckpt.pt.rank1-of-2"
# Rank 1's file from another save (step 4 beside rank 0's step 2): every rank stops.
ep2 "${tiny[@]}" --stop-at 2 --save "$work/mixed.pt" >/dev/null
cp "$work/ckpt.pt.rank1-of-2" "$work/mixed.pt.rank1-of-2"
expect_error 1 "--resume: the ranks' files must be of one save, got step 2 here and a mean of 3" \
  ep2 "${tiny[@]}" --resume "$work/mixed.pt"
# Rank 1's file missing: rank 0 stops too, instead of waiting for it in a collective. (ep2 ran in
# expect_error's subshell above, whose port count did not come back.)
port=$((port + 1))
rm "$work/mixed.pt.rank1-of-2"
expect_error 1 "--resume: 1 of the 2 ranks could not load their files" \
  ep2 "${tiny[@]}" --resume "$work/mixed.pt"
# (--ep 3 divides neither the default --experts nor --batch, which a merge does not use.)
expect_error 1 "--merge-checkpoint: '$work/ckpt.pt.rank0-of-3' does not exist" \
  "$bin" --merge-checkpoint "$work/ckpt.pt" --ep 3 --save "$work/x.pt"
echo "PASS"
