set -u
bash scripts/gpu-check.sh "$OUT" cli -- -k "first_use or forced or threads_json"
bash .gpu/plan2.sh
