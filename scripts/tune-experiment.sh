#!/usr/bin/env bash
# Times kernel tuning variants (poll back-off, blocks per rank) on the device machine.
set -u
export TPAR_CACHE_DIR=/tmp/tpar-cache
t=./target/release/tpar
for sleep in 0 128 512; do
  for blocks in 32 8; do
    export TPAR_KERNEL_DEFINES="-DTPAR_POLL_SLEEP_MAX_NS=$sleep" TPAR_MAX_BLOCKS=$blocks
    echo "== sleep max ${sleep} ns, max blocks ${blocks}"
    $t bench --backend cuda -n 8 --sizes 4K,32K,256K --algos one-shot,two-shot --iters 50 2>/dev/null | grep -E "KiB"
    $t bench --backend cuda -n 2 --sizes 4K,42K,256K --algos one-shot,host-staged --iters 50 2>/dev/null | grep -E "KiB"
  done
done
