#!/usr/bin/env bash
# Every test of the project, as CI runs it (`.ci/run` calls this script): formatting, lints,
# the Rust unit, property and cross-process tests (including the compilation of every CUDA
# kernel for sm_80..sm_120 with NVRTC from pip's wheel), then the Python package: its wheel
# is built with maturin, installed into a fresh virtual environment and tested with pytest
# across processes. Needs no GPU and no CUDA toolkit; needs python3 with venv and pip. The
# first run downloads about 5.5 GB into .ci/ (torch 4.6 GB; the top of README.md lists it), reused
# after; TPAR_CI_TORCH=0 and TPAR_CI_ENGINES=0 skip the two large parts. The GPU suite
# (tests/python/gpu, marked `gpu`, and the ignored Rust tests of crates/tpar/tests/cuda_spans.rs)
# is collected here and skips saying why; it runs on a GPU machine: `scripts/gpu-check.sh
# --prepare` here, then `scripts/gpu-check.sh OUTDIR` there (its header says what to carry).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== NVRTC (pip wheel nvidia-cuda-nvrtc, into .ci/pydeps) for the kernel compilation test"
pydeps=.ci/pydeps
nvrtc_dir="$PWD/$pydeps/nvidia/cu13/lib"
if [ ! -e "$nvrtc_dir/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
    --target "$pydeps" "nvidia-cuda-nvrtc>=13,<14"
fi
export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The compile test fails (instead of skipping) if NVRTC still cannot be loaded.
export TPAR_REQUIRE_NVRTC=1

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (with the workspace lints: a SAFETY comment on every unsafe block and impl)"
cargo clippy --workspace --all-targets --release -- -D warnings

echo "== cargo doc (every intra-doc link resolves, none to a private item)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet

echo "== import graph: no file-level cycle, no upward import, crates in order (scripts/import_graph.py)"
python3 scripts/import_graph.py --quiet

echo "== ruff: lint and format of every Python file (ruff.toml)"
if [ ! -x .ci/ruff/bin/ruff ]; then
  python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location --root-user-action=ignore \
    --target .ci/ruff "ruff==0.17.6"
fi
.ci/ruff/bin/ruff check .
.ci/ruff/bin/ruff format --check .

echo "== cargo test (release: the cross-process tests move megabytes between 8 ranks)"
cargo test --workspace --release

echo "== Python package: build the wheel, install it into a fresh venv, run pytest"
rm -rf .ci/venv .ci/wheels
python3 -m venv .ci/venv
.ci/venv/bin/python -m pip install --quiet --disable-pip-version-check maturin numpy pytest
.ci/venv/bin/maturin build --release --quiet -m crates/tpar-py/Cargo.toml -o .ci/wheels
.ci/venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps .ci/wheels/tpar-*.whl
# tpar.engines' tests read the pinned vLLM and SGLang wheels (375 MB, downloaded once into
# .ci/engines) and run gloo groups with torch: PyPI's torch 2.11 with its CUDA libraries is
# 4.6 GB and took 2-4 minutes to install here, so it goes once into .ci/torch and is reused; set
# TPAR_CI_TORCH=0 to skip it (the gloo tests then skip and say why). A failed download only
# makes those tests skip.
pythonpath=""
if [ "${TPAR_CI_TORCH:-1}" != 0 ]; then
  if [ ! -e .ci/torch/.complete ]; then
    echo "== torch 2.11 into .ci/torch (once) for the gloo tests of tpar.engines"
    rm -rf .ci/torch
    .ci/venv/bin/python -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
      --target .ci/torch "torch==2.11.0" && touch .ci/torch/.complete ||
      echo "warning: torch did not install; the gloo tests will skip"
  fi
  [ -e .ci/torch/.complete ] && pythonpath="$PWD/.ci/torch"
  # What SGLang's parallel_state and vLLM's plugin loader import besides torch (135 MB, ~1
  # minute, once): their own code then loads tpar's plugin in test_engines_sglang.py and
  # test_engines_vllm.py.
  if [ ! -e .ci/sglang-deps/.complete ]; then
    echo "== SGLang's and vLLM's pure-Python imports into .ci/sglang-deps (once)"
    rm -rf .ci/sglang-deps
    .ci/venv/bin/python -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
      --target .ci/sglang-deps orjson psutil pybase64 requests pillow starlette msgspec pydantic pyzmq tqdm \
      ipython aiohttp apache-tvm-ffi regex && touch .ci/sglang-deps/.complete ||
      echo "warning: the engines' imports did not install; test_engines_sglang.py and test_engines_vllm.py will skip"
  fi
  [ -e .ci/sglang-deps/.complete ] && pythonpath="${pythonpath:+$pythonpath:}$PWD/.ci/sglang-deps"
fi
# The pinned engines' wheels (547 MB, once): the contract tests read their source. Set
# TPAR_CI_ENGINES=0 to skip them (those tests then skip and say why).
mkdir -p .ci/engines
if [ "${TPAR_CI_ENGINES:-1}" != 0 ]; then
  for engine in vllm==0.33.0 sglang==0.5.23; do
    ls .ci/engines/"${engine%%==*}"-"${engine##*==}"-*.whl >/dev/null 2>&1 ||
      .ci/venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps "$engine" -d .ci/engines ||
      echo "warning: $engine did not download; the engine contract tests will skip"
  done
fi
PYTHONPATH="$pythonpath" TPAR_ENGINE_WHEELS="$PWD/.ci/engines" .ci/venv/bin/python -m pytest -rs tests/python
