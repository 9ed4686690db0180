#!/usr/bin/env bash
# Before/after timings of a change on the GPU machine, with the device tool: tpar binaries of
# different commits run alternately in one call (figures compare only within a call: the tool
# lends an H100 or an H200), every command's output and JSON packed into $OUT with a summary
# whose last part is a table of every p50. What bench/results/<date>-sNN/callN holds is what
# this leaves in $OUT.
#
# Usage
#   bash scripts/gpu-compare.sh --build NAME REV   on the dev machine: build commit REV (`.`:
#                                                  the working tree) into .gpu/tpar-NAME,
#                                                  stripped (a worktree of REV beside the
#                                                  checkout, the usual cargo target folder)
#   source scripts/gpu-compare.sh                  in a plan script (kept in .gpu/), on the GPU
#                                                  machine: gives `run`, `fused_launches` and
#                                                  `finish` below and $R, the folder every
#                                                  output goes to
# A plan, e.g. .gpu/plan.sh, run as command "bash .gpu/plan.sh" with carry [".gpu"]:
#   source scripts/gpu-compare.sh
#   for i in 1 2; do for b in base new; do
#     run b8-$b-$i 90 .gpu/tpar-$b bench --backend cuda -n 8 --sizes 4K,64K --json $R/b8-$b-$i.json
#   done; done
#   run st-8 200 .gpu/tpar-new selftest --backend cuda -n 8
#   finish
# JSON files named CONFIG-BINARY[-RUN].json come out in the table as `CONFIG algorithm bytes
# BINARY p50...` (`tpar bench`) or `CONFIG ranks tokens variant BINARY p50...` (`--fused`).
set -u

if [ "${1:-}" = "--build" ]; then
  set -e
  name=${2:?--build NAME REV}
  rev=${3:?--build NAME REV}
  root=$(cd "$(dirname "$0")/.." && pwd)
  src=$root
  if [ "$rev" != "." ]; then
    src=$root/../tpar-build-$name
    git -C "$root" worktree remove --force "$src" 2>/dev/null || true
    git -C "$root" worktree add --detach "$src" "$rev" >/dev/null
  fi
  # A commit builds in a target folder of its own: cargo names a workspace's artifacts by paths
  # relative to it and judges them fresh by mtime, so a worktree's build in the checkout's
  # target folder left the checkout's edited sources looking older than "their" binary, and
  # the next `.` build kept the commit's binary (session 14, call 6: two names, one binary).
  target=${CARGO_TARGET_DIR:-$root/target}
  [ "$rev" = "." ] || target=$target-commits
  (cd "$src" && CARGO_TARGET_DIR=$target cargo build --release -p tpar-cli)
  mkdir -p "$root/.gpu"
  strip -o "$root/.gpu/tpar-$name" "$target/release/tpar"
  # The binary must say it is what was asked for (its --version names the commit it was built at).
  want=$(git -C "$src" rev-parse --short=12 HEAD)
  got=$("$root/.gpu/tpar-$name" --version)
  case "$got" in
    *"($want)"*|*"($want-dirty)"*) ;;
    *) echo "built .gpu/tpar-$name from $rev, but it says '$got', not commit $want" >&2; exit 1 ;;
  esac
  # build.rs marks a build -dirty where crates/ or Cargo.lock differ from the commit (edits
  # elsewhere, docs say, change no binary).
  edited=$(git -C "$root" status --porcelain --untracked-files=no -- crates Cargo.lock)
  if [ "$rev" = "." ] && [ -n "$edited" ] && [[ "$got" != *-dirty* ]]; then
    echo "built .gpu/tpar-$name from an edited tree, but it says '$got' (not -dirty): a stale build" >&2
    exit 1
  fi
  [ "$rev" = "." ] || git -C "$root" worktree remove --force "$src"
  echo "built .gpu/tpar-$name from $rev: $got"
  exit 0
fi

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "source this from a plan script on the GPU machine, or give --build NAME REV (see the top of $0)" >&2
  exit 2
fi

export NCCL_NVLS_ENABLE=0
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
OUT=${OUT:?the device tool sets OUT, the folder that comes back}
R=$OUT/r
mkdir -p "$R"
SUMMARY=$R/summary.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$SUMMARY" 2>/dev/null || echo "no nvidia-smi" > "$SUMMARY"

# run NAME TIMEOUT CMD...: CMD's output into $R/NAME.txt, a line in the summary (exit status,
# seconds, a selftest's verdict).
run() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout "$limit" "$@" > "$R/$name.txt" 2>&1
  local rc=$?
  printf "%-28s rc=%-3s %4ss  %s\n" "$name" "$rc" $((SECONDS - start)) \
    "$(grep -ho '[0-9]* passed.*' "$R/$name.txt" | tail -1)" >> "$SUMMARY"
}

# fused_launches GLOB: the shape of each fused row's launch in $R/GLOB (`tpar bench --fused`
# JSON) into the summary: blocks x threads, blocks per cluster (c?: a binary from before
# launches named them), PDL, and the kernel (absent before launches named it, s28); so a plan
# shows which form each knob or rule timed.
fused_launches() {
  python3 - "$R" "$1" >> "$SUMMARY" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob(sys.argv[2])):
    for r in json.loads(path.read_text()).get("rows", []):
        l = r.get("launch")
        if r["variant"] == "fused" and l:
            print(f"launch {path.stem} {r['world_size']} x {r['tokens']}: "
                  f"{l['grid']}x{l['block']} c{l.get('cluster', '?')} pdl={l['pdl']} "
                  f"{l.get('kernel', '')}")
PY
}

# finish: every p50 into the summary, then $R packed into $OUT/r.tgz (the tool brings back at
# most 8 files) beside a copy of the summary, which it prints.
finish() {
  python3 - "$R" >> "$SUMMARY" <<'PY'
import collections, json, pathlib, sys
rows = collections.defaultdict(list)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    parts = path.stem.split("-")
    config, binary = parts[0], parts[1] if len(parts) > 1 else ""
    d = json.loads(path.read_text())
    for r in d.get("results", []):
        rows[(config, r["algo"], r["bytes"], binary)].append(r.get("p50_us"))
    for r in d.get("rows", []):
        rows[(config, r["world_size"], r["tokens"], r["variant"], binary)].append(r["p50_us"])
for key in sorted(rows, key=str):
    print(*key, " ".join("-" if v is None else f"{v:.2f}" for v in rows[key]))
PY
  cp "$SUMMARY" "$OUT/summary.txt"
  tar czf "$OUT/r.tgz" -C "$OUT" r && rm -rf "$R"
  cat "$OUT/summary.txt"
}
