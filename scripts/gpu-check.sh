#!/usr/bin/env bash
# The GPU test suite in one command, for the GPU machine (Ubuntu 24.04, python3 3.12 with torch
# and pytest, NVIDIA driver; no cargo, no network). What it runs is tests/python/gpu (every
# test there is marked `gpu` and skips, saying why, where there is no GPU: CI collects it):
#   cli     the `tpar` binary on every CUDA path (selftest as threads and processes, bench with
#           JSON and plot, processes, a forced algorithm, --anatomy, --fused, bench step, doctor,
#           tune) and the Rust span tests (crates/tpar/tests/cuda_spans.rs, ignored by cargo
#           test, run here as a prebuilt binary with --ignored); about 4 minutes on one H200
#   python  the Python package on CUDA tensors (allreduce, fused op, threads refused, the fused
#           op timed from Python) and tpar.verify/tpar.tune on a GPU; about 4 minutes
#   engines an engine-grade communicator (footprint, leaks, streams, subgroups, init cost),
#           vLLM's and SGLang's calling sequence, SGLang's fused entry; needs .ci/engines-gpu
#           for the SGLang parts; about 6 minutes
#   vllm    tpar's vLLM fusion pass with vLLM's own code; needs .ci/vllm-gpu; about 4 minutes
# (times: the old scripts' logs of the same checks on one H200, bench/results). Tests that need
# one GPU per rank (`gpus(2)`) skip on a one-GPU machine.
#
# Usage
#   scripts/gpu-check.sh --prepare           on the dev machine: build what runs there into
#                                            .ci/gpu (tpar, cuda_spans, the wheel, COMMIT;
#                                            about 12 MB, binaries without debug info)
#   scripts/gpu-check.sh --prepare-engines   on the dev machine, downloads once: .ci/engines-gpu
#                                            (SGLang 0.5.23's Python sources and the cp312 wheels
#                                            of what its parallel_state imports) and .ci/vllm-gpu
#                                            (vLLM 0.33.0's Python sources and the wheels its IR
#                                            imports; about 32 and 27 MB); the machine cannot
#                                            download them itself
#   scripts/gpu-check.sh [--dry-run] OUTDIR [GROUP...] [-- PYTEST_ARGS...]
#                                            on the GPU machine: run GROUPs (default: all four),
#                                            write OUTDIR/gpu-check.json, gpu-check.txt and
#                                            gpu-check-logs.tar.gz (every test's log and JSON);
#                                            exit 1 if a test failed. --dry-run lists what would
#                                            run and collects the tests, touching no GPU.
#
# With the device tool (each call carries the working tree plus the named ignored paths, 64 MiB
# in all; only 8 files come back from $OUT, so everything is packed into three):
#   here:  scripts/gpu-check.sh --prepare   (and once: scripts/gpu-check.sh --prepare-engines)
#   run:   command "bash scripts/gpu-check.sh $OUT cli",     carry [".ci/gpu"]
#          command "bash scripts/gpu-check.sh $OUT python",  carry [".ci/gpu"]
#          command "bash scripts/gpu-check.sh $OUT engines", carry [".ci/gpu", ".ci/engines-gpu"]
#          command "bash scripts/gpu-check.sh $OUT vllm",    carry [".ci/gpu", ".ci/vllm-gpu"]
# (one group a call keeps each inside the 10 minutes; the JSON is rewritten after each group,
# so a call stopped at its limit still returns the groups before).
# The machine's checkout has no .git: the commit comes from .ci/gpu/COMMIT (written by --prepare).
set -uo pipefail
cd "$(dirname "$0")/.."
carry=${TPAR_GPU_CARRY:-.ci/gpu}
all_groups=(cli python engines vllm)

group_tests() {
  case $1 in
    cli) echo tests/python/gpu/test_cli_cuda.py ;;
    python)
      echo tests/python/gpu/test_cuda_allreduce.py tests/python/gpu/test_cuda_fused.py \
        tests/python/gpu/test_cuda_threads.py tests/python/gpu/test_cuda_fused_timing.py \
        tests/python/test_harness.py::test_verify_and_tune_on_a_gpu
      ;;
    engines)
      echo tests/python/gpu/test_cuda_engine_comm.py tests/python/gpu/test_cuda_engine_sequence.py \
        tests/python/gpu/test_cuda_sglang_fusion.py
      ;;
    vllm) echo tests/python/gpu/test_cuda_vllm_fusion.py ;;
    *) return 1 ;;
  esac
}

# Seconds a group may run before it is stopped (a device call has 10 minutes).
group_limit() {
  case $1 in
    cli) echo 420 ;; python) echo 420 ;; engines) echo 540 ;; vllm) echo 420 ;;
  esac
}

prepare() {
  set -e
  mkdir -p "$carry"
  echo "== cargo build --release -p tpar-cli"
  cargo build --release -p tpar-cli
  echo "== the Rust span tests' binary (cargo test --no-run)"
  local spans
  spans=$(cargo test --release -p tpar --test cuda_spans --no-run --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_spans":
        print(m["executable"])')
  [ -x "$spans" ] || { echo "no cuda_spans test binary came out of cargo test --no-run" >&2; exit 1; }
  strip --strip-debug -o "$carry/tpar" "${CARGO_TARGET_DIR:-target}/release/tpar"
  strip --strip-debug -o "$carry/cuda_spans" "$spans"
  echo "== the wheel (maturin, in .ci/venv)"
  if [ ! -x .ci/venv/bin/maturin ]; then
    python3 -m venv .ci/venv
    .ci/venv/bin/python -m pip install --quiet --disable-pip-version-check maturin
  fi
  rm -f "$carry"/tpar-*.whl
  .ci/venv/bin/maturin build --release --quiet -m crates/tpar-py/Cargo.toml -o "$carry"
  {
    git rev-parse HEAD
    git status --porcelain --untracked-files=no | grep -q . && echo "dirty: uncommitted changes in the build"
    date -u +%Y-%m-%dT%H:%M:%SZ
  } >"$carry/COMMIT"
  du -sh "$carry"
  ls -la "$carry"
}

prepare_engines() {
  set -e
  mkdir -p .ci/engines
  for engine in vllm==0.33.0 sglang==0.5.23; do
    ls .ci/engines/"${engine%%==*}"-"${engine##*==}"-*.whl >/dev/null 2>&1 ||
      python3 -m pip download --quiet --no-deps "$engine" -d .ci/engines
  done
  local cp312=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
  echo "== .ci/engines-gpu: SGLang's sources and JIT headers (none of its cp311 binaries), its imports for cp312"
  rm -rf .ci/engines-gpu && mkdir -p .ci/engines-gpu/deps
  python3 -m pip download --quiet "${cp312[@]}" -d .ci/engines-gpu/deps orjson psutil pybase64 requests \
    pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp apache-tvm-ffi
  # What the GPU machine's image already holds (its package list of 2026-11-17) stays behind:
  # carried, these 12 MB would push a call's working tree over its 64 MiB.
  local on_image=(pillow aiohttp aiosignal aiohappyeyeballs attrs multidict frozenlist propcache yarl
    pygments psutil requests urllib3 charset_normalizer idna certifi tqdm)
  for name in "${on_image[@]}"; do rm -f .ci/engines-gpu/deps/"$name"-*.whl; done
  python3 - .ci/engines-gpu/sglang-0.5.23-src.zip .ci/engines/sglang-0.5.23-*.whl <<'EOF'
import sys, zipfile
out, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
    for name in src.namelist():
        jit = name.startswith("sglang/kernels/jit/") and ("/include/" in name or "/csrc/" in name)
        if (name.startswith("sglang/") and name.endswith(".py")) or jit:
            dst.writestr(name, src.read(name))
EOF
  echo "== .ci/vllm-gpu: vLLM's Python files, the same imports and regex (its IR needs it)"
  rm -rf .ci/vllm-gpu && mkdir -p .ci/vllm-gpu/deps
  cp .ci/engines-gpu/deps/*.whl .ci/vllm-gpu/deps/
  python3 -m pip download --quiet --no-deps "${cp312[@]}" -d .ci/vllm-gpu/deps regex
  python3 - .ci/vllm-gpu/vllm-src.zip .ci/engines/vllm-0.33.0-*.whl <<'EOF'
import sys, zipfile
out, wheel = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
    for name in src.namelist():
        if name.startswith("vllm/") and name.endswith(".py"):
            dst.writestr(name, src.read(name))
EOF
  du -sh .ci/engines-gpu .ci/vllm-gpu
}

case ${1:-} in
  --prepare) prepare; exit ;;
  --prepare-engines) prepare_engines; exit ;;
  -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac

dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
out=${1:-}
[ -n "$out" ] || { echo "usage: scripts/gpu-check.sh [--dry-run] OUTDIR [GROUP...] [-- PYTEST_ARGS...] (--help says more)" >&2; exit 2; }
shift
groups=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  group_tests "$1" >/dev/null || { echo "unknown group '$1'; the groups are: ${all_groups[*]}" >&2; exit 2; }
  groups+=("$1"); shift
done
[ "${1:-}" = -- ] && shift
pytest_args=("$@")
[ ${#groups[@]} -gt 0 ] || groups=("${all_groups[@]}")

# What the tests find: the carried binaries (else a local build), the wheel, the bundles.
export TPAR_BIN=$PWD/$carry/tpar TPAR_CUDA_SPANS=$PWD/$carry/cuda_spans
[ -x "$TPAR_BIN" ] || TPAR_BIN=$PWD/target/release/tpar
wheel=$(ls "$carry"/tpar-*.whl .ci/wheels/tpar-*.whl 2>/dev/null | head -1)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TPAR_CACHE_DIR=${TPAR_CACHE_DIR:-/tmp/tpar-gpu-check-cache}
work=${TPAR_GPU_WORK:-/tmp/tpar-gpu-check}

if [ $dry = 1 ]; then
  echo "tpar binary:      $TPAR_BIN $([ -x "$TPAR_BIN" ] && echo '(found)' || echo '(MISSING: scripts/gpu-check.sh --prepare)')"
  echo "span tests:       $TPAR_CUDA_SPANS $([ -x "$TPAR_CUDA_SPANS" ] && echo '(found)' || echo '(MISSING: scripts/gpu-check.sh --prepare)')"
  echo "wheel:            ${wheel:-MISSING: scripts/gpu-check.sh --prepare}"
  echo "SGLang bundle:    .ci/engines-gpu $([ -d .ci/engines-gpu ] && echo '(found)' || echo '(missing: the engines group fails its SGLang tests)')"
  echo "vLLM bundle:      .ci/vllm-gpu $([ -d .ci/vllm-gpu ] && echo '(found)' || echo '(missing: the vllm group fails)')"
  rc=0
  for group in "${groups[@]}"; do
    read -ra tests <<<"$(group_tests "$group")"
    echo "== $group (stopped after $(group_limit "$group") s): python3 -m pytest -rs -v ${tests[*]} ${pytest_args[*]}"
    python3 -m pytest --collect-only -q -p no:cacheprovider "${tests[@]}" "${pytest_args[@]}" 2>&1 | tail -n 40 || rc=1
  done
  echo "(dry run: nothing ran; the results would go to $out)"
  exit $rc
fi

rm -rf "$work" && mkdir -p "$work" "$out"
start_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
nvidia-smi >"$work/nvidia-smi.txt" 2>&1
nvidia-smi topo -m >>"$work/nvidia-smi.txt" 2>&1
site=/tmp/tpar-gpu-check-site
rm -rf "$site"
if [ -n "$wheel" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" >"$work/pip.log" 2>&1 ||
    echo "warning: the wheel did not install (see pip.log)"
else
  echo "warning: no wheel in $carry or .ci/wheels: the Python tests cannot import tpar" | tee "$work/pip.log"
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
# The engines' pure-Python imports go into their own folder, put on the path only by the tests
# that run engine code (TPAR_ENGINE_DEPS), so that they shadow nothing else.
deps=/tmp/tpar-gpu-check-engine-deps
rm -rf "$deps"
for bundle in .ci/engines-gpu .ci/vllm-gpu; do
  [ -d "$bundle/deps" ] &&
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$deps" "$bundle"/deps/*.whl >>"$work/pip.log" 2>&1
done
export TPAR_ENGINE_DEPS=$deps
[ -f .ci/engines-gpu/sglang-0.5.23-src.zip ] && export TPAR_SGLANG_SRC=$PWD/.ci/engines-gpu/sglang-0.5.23-src.zip
[ -f .ci/vllm-gpu/vllm-src.zip ] && export TPAR_VLLM_SRC=$PWD/.ci/vllm-gpu/vllm-src.zip
# A test that cannot run here fails instead of skipping (a machine's shape, fewer GPUs than a
# test's ranks, still skips).
export TPAR_GPU_REQUIRED=1

commit=$(head -1 "$carry/COMMIT" 2>/dev/null || "$TPAR_BIN" --version 2>/dev/null || echo unknown)
# The tests' own records name it too (tests/python/jobs.py, write_result).
export TPAR_COMMIT=$commit
# Writes gpu-check.json, gpu-check.txt and the packed logs for the groups run so far: after each
# group, so that a call stopped at its time limit still returns what ran before.
record() {
  groups_json=$(for g in "${finished[@]}"; do printf '%s %s %s\n' "$g" "${rcs[$g]}" "${seconds[$g]}"; done)
  COMMAND="scripts/gpu-check.sh $out ${groups[*]}${pytest_args[*]:+ -- ${pytest_args[*]}}" \
  COMMIT="$commit" BUILD="$(sed -n '2,$p' "$carry/COMMIT" 2>/dev/null | tr '\n' ' ')" \
  DATE="$start_date" GROUPS_RC="$groups_json" WORK="$work" OUTDIR="$out" python3 - <<'EOF'
import json, os, platform, subprocess
import xml.etree.ElementTree as ElementTree

def query(field):
    try:
        text = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout
        return [line.strip() for line in text.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []

names, drivers = query("name"), query("driver_version")
try:
    import torch
    torch_version = torch.__version__
except ImportError:
    torch_version = None
work, groups, checks = os.environ["WORK"], {}, []
for line in os.environ["GROUPS_RC"].splitlines():
    name, rc, seconds = line.split()
    groups[name] = {"exit": int(rc), "seconds": int(seconds), "stopped_at_limit": rc in ("124", "137")}
    path = os.path.join(work, name, "junit.xml")
    for case in ElementTree.parse(path).iter("testcase") if os.path.exists(path) else []:
        entry = {"group": name, "test": f"{case.get('classname')}::{case.get('name')}",
                 "outcome": "passed", "seconds": round(float(case.get("time") or 0), 2)}
        for kind, outcome in (("skipped", "skipped"), ("failure", "failed"), ("error", "error")):
            found = case.find(kind)
            if found is not None:
                entry["outcome"] = outcome
                text = (found.get("message") or "") + "\n" + (found.text or "")
                entry["reason" if kind == "skipped" else "message"] = text.strip()[-2000:]
        checks.append(entry)
    if not os.path.exists(path):
        checks.append({"group": name, "test": f"{name} (pytest)", "outcome": "error",
                       "seconds": int(seconds), "message": f"pytest wrote no report (exit {rc}); see {name}/pytest.log"})
counts = {k: sum(c["outcome"] == k for c in checks) for k in ("passed", "failed", "error", "skipped")}
record = {
    "command": os.environ["COMMAND"],
    "device": f"{len(names)} x {names[0]}" if names else "no GPU visible to nvidia-smi",
    "driver": drivers[0] if drivers else None,
    "date": os.environ["DATE"],
    "commit": os.environ["COMMIT"],
    "build": os.environ["BUILD"].strip() or None,
    "host": platform.node(),
    "python": platform.python_version(),
    "torch": torch_version,
    "groups": groups,
    "summary": counts,
    "checks": checks,
}
out = os.environ["OUTDIR"]
with open(os.path.join(out, "gpu-check.json"), "w") as f:
    json.dump(record, f, indent=1)
lines = [f"gpu-check: {record['device']}, driver {record['driver']}, commit {record['commit']}, {record['date']}",
         "groups: " + ", ".join(f"{g} exit {v['exit']} in {v['seconds']} s" for g, v in groups.items())]
for c in checks:
    why = (c.get("reason") or "").split("\n")[0] or (c.get("message", "").splitlines() or [""])[-1]
    lines.append(f"{c['outcome'].upper():8} {c['seconds']:7.1f} s  {c['test']}" + (f"  ({why[:160]})" if why else ""))
lines.append(", ".join(f"{v} {k}" for k, v in counts.items()))
with open(os.path.join(out, "gpu-check.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
EOF
  tar czf "$out/gpu-check-logs.tar.gz" -C "$work" . 2>/dev/null
}

declare -A rcs seconds
finished=()
for group in "${groups[@]}"; do
  read -ra tests <<<"$(group_tests "$group")"
  mkdir -p "$work/$group"
  began=$SECONDS
  echo "== $group: ${tests[*]}"
  TPAR_GPU_OUT=$work/$group timeout -k 10 "$(group_limit "$group")" python3 -m pytest -rs -v \
    -p no:cacheprovider --durations=0 --junitxml="$work/$group/junit.xml" \
    "${tests[@]}" "${pytest_args[@]}" >"$work/$group/pytest.log" 2>&1
  rcs[$group]=$?
  seconds[$group]=$((SECONDS - began))
  grep -E '^(PASSED|FAILED|ERROR|SKIPPED)|^=+ .*(passed|failed|error|skipped)' "$work/$group/pytest.log" | tail -n 40
  finished+=("$group")
  record
done
cat "$out/gpu-check.txt"
for group in "${groups[@]}"; do [ "${rcs[$group]}" = 0 ] || exit 1; done
exit 0
