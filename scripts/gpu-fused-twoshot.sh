#!/usr/bin/env bash
# issue 15, the fused two-shot kernel (crates/tpar/kernels/twoshot_fused.cu), on one GPU with the
# ranks as threads sharing GPU 0 (one call, under 4 minutes):
#   1. `tpar selftest` at -n 2 and -n 8: its fused rows run two-shot forced on every row
#      ("fused two-shot ..."), fused now (odd hidden sizes, 1 and many tokens, in place and not,
#      eager and graph, f32/f16/bf16, each rank's residual_out and y bitwise against the CPU
#      reference), plus the two-shot silent-peer and mismatch rows; rows above hidden 16384 say
#      "(unfused)" by design. The pull rows ("fused one-shot-pull ...") run the pull and
#      the separate norm kernel: the fused pull kernel was dropped (bench/README.md, "Fourth session").
#   2. `tpar bench --fused --algos two-shot` at 8 ranks, 4, 8 and 32 tokens of hidden 8192 bf16:
#      "fused" is the fused two-shot kernel, "ar + norm" two-shot followed by the separate norm
#      kernel in the same graph chain; then the same with one-shot (what auto runs up to 64 KiB
#      at 8 ranks) for comparison.
# Run from the repository root with a release build (target/release/tpar), or TPAR=path.
# Logs and JSON go to $OUT; a short table is printed last.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TPAR_CACHE_DIR=${TPAR_CACHE_DIR:-/tmp/tpar-cache-tsfuse}
tpar=${TPAR:-}
if [ -z "$tpar" ]; then
  for candidate in ./tpar target/release/tpar; do
    if [ -x "$candidate" ]; then tpar=$candidate; break; fi
  done
fi
if [ -z "$tpar" ]; then
  echo "no tpar binary: build it (cargo build --release) or set TPAR=path/to/tpar" >&2
  exit 2
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
summary=()
step() { # name, limit in seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout -s ABRT "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E '^selftest:|FAILED|rror' "$OUT/$name.log" | tail -1 | cut -c1-110)")")
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  date -u
  git rev-parse --short HEAD 2> /dev/null || true
  "$tpar" --version 2> /dev/null || true
} > "$OUT/device.txt"

sel="selftest --backend cuda --counts 7,4099 --replays 20 --timeout 10"
step selftest-2 65 "$tpar" $sel -n 2
step selftest-8 120 "$tpar" $sel -n 8
bench="bench --fused -n 8 --tokens 4,8,32 --iters 100 --chain 50"
step bench-twoshot-8 30 "$tpar" $bench --algos two-shot --json "$OUT/bench-fused-twoshot-8.json"
step bench-oneshot-8 25 "$tpar" $bench --algos one-shot --json "$OUT/bench-fused-oneshot-8.json"

for f in selftest-2 selftest-8; do
  for a in two-shot one-shot-pull; do
    echo "== $f: fused $a rows $(grep -c "^fused $a " "$OUT/$f.log"), of them fused" \
      "$(grep "^fused $a " "$OUT/$f.log" | grep -c '(fused)')"
  done
  echo "== $f: failing rows:"
  grep -E 'FAIL|rror|panick' "$OUT/$f.log" | head -8 | cut -c1-240
  grep -E '^fused (two-shot|one-shot-pull) +bf16 +(1 x 8192|8 x 4099|512 x 2048) +in place +graph|^fused two-shot (peer|mismatch)|^fused (peer|mismatch)' \
    "$OUT/$f.log" | sed -E 's/  +/  /g' | cut -c1-240
done
for f in bench-twoshot-8 bench-oneshot-8; do
  echo "== $f"
  grep -vE '^wrote|^\s*$' "$OUT/$f.log" | tail -6
done
cat "$OUT/device.txt"
printf '%s\n' "${summary[@]}"
