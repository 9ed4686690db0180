set -u
export TPAR_CACHE_DIR=/tmp/tpar-cache
for i in 1 2 3 4 5 6; do
  ./target/release/tpar selftest --backend cuda -n 8 --counts 1023,4099,65541 --dtypes f32,bf16 --algos one-shot,two-shot,host-staged --replays 0 --no-timeout-case 2>&1 | grep -E "FAIL|wrong|selftest:"
done
