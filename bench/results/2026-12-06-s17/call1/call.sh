# Session 17, call 1: the GPU suite's cli group (the binary of .ci/gpu/COMMIT), then the plan,
# all within CALL_S seconds (default 575).
set -u
start=$SECONDS
bash scripts/gpu-check.sh "$OUT" cli
BUDGET=$((${CALL_S:-575} - (SECONDS - start))) bash .gpu/plan.sh
