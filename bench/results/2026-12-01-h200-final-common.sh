# Sourced by gpuA.sh / gpuB.sh: environment, step() and the summary.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TPAR_CACHE_DIR=/tmp/tpar-cache PYTHONUNBUFFERED=1
T=.stage/final/tpar; B=.stage/before/tpar; L=$OUT/logs; mkdir -p $L
summary=()
step() { # name limit cmd...
  local name=$1 limit=$2; shift 2; local t=$SECONDS
  timeout $limit "$@" > $L/$name.log 2>&1; local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss %s' $name $rc $((SECONDS-t)) "$(grep -E 'passed|failed|pass|FAIL|error' $L/$name.log | tail -1 | cut -c1-110)")")
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $L/device.txt
