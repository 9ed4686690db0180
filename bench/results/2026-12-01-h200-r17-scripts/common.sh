# Shared by the final GPU calls: run from the repository root; binaries in .stage/final.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TPAR_CACHE_DIR=/tmp/tpar-cache
S=.stage/final
T=$S/tpar          # merged main
B="env TPAR_CACHE_DIR=/tmp/tpar-cache-base $S/tpar-base"   # 603f51f, the tree before this session (its own cache)
L=$OUT/logs; mkdir -p $L
models=crates/tpar/fixtures/models
summary=()
step() { # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$L/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(grep -E '^selftest|test result|passed|failed' "$L/$name.log" | tail -1 | cut -c1-95)")")
}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } > $L/device.txt
