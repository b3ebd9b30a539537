#!/usr/bin/env bash
# libtorchmoe.so must neither define nor reference anything of gloo's and must not load libgloo:
# distributed/gloo_backend.cpp parses Debian's gloo headers for declarations only, and the one
# gloo in the process is the one inside libtorch_cpu.so (that file says why this is sound). A
# symbol here would mean code compiled against Debian's gloo layout, which may differ from torch's.
#
# usage: check_gloo_symbols.sh LIBTORCHMOE
set -euo pipefail
lib=$1
symbols=$(nm -C "$lib" | grep -E 'gloo::' || true)
needed=$(readelf -d "$lib" | grep -iE 'NEEDED.*gloo' || true)
if [ -n "$symbols$needed" ]; then
  echo "error: $lib uses gloo directly:" >&2
  printf '%s\n' "$symbols" "$needed" >&2
  exit 1
fi
echo "ok: $lib defines and references no gloo:: symbol and does not load libgloo"
