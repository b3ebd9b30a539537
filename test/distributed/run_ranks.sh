#!/usr/bin/env bash
# Runs a command as NPROC ranks on this machine, with the environment torchrun gives each worker
# (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and fails when any
# rank fails. Each rank is killed after LIMIT_S seconds, so a hang fails the test instead of
# outliving it; each rank's output is printed after all have ended, under a header.
#
# usage: run_ranks.sh NPROC MASTER_PORT LIMIT_S COMMAND [ARGS...]
set -u
nproc=$1 port=$2 limit=$3
shift 3
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
pids=()
for ((rank = 0; rank < nproc; rank++)); do
  RANK=$rank LOCAL_RANK=$rank WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc MASTER_ADDR=127.0.0.1 \
    MASTER_PORT=$port timeout -k 5 "$limit" "$@" >"$logs/$rank.log" 2>&1 &
  pids+=($!)
done
status=0
for ((rank = 0; rank < nproc; rank++)); do
  wait "${pids[$rank]}"
  rc=$?
  echo "===== rank $rank: exit $rc$( ((rc == 124 || rc == 137)) && echo " (killed after ${limit} s)")"
  cat "$logs/$rank.log"
  ((rc != 0 && status == 0)) && status=$rc
done
exit "$status"
