"""The GPU test suite: every test under tests/python/gpu is marked `gpu` and needs an NVIDIA GPU.

Without one (no torch, or torch sees no GPU) each test is skipped with the reason in pytest's
`-rs` summary, so `bash scripts/test.sh` on a machine without a GPU collects the suite and says
why nothing ran. On the GPU machine `scripts/gpu-check.sh` runs it with TPAR_GPU_REQUIRED=1:
then a missing GPU, binary or engine bundle fails the test instead of skipping it, so that a
green run cannot hide a check that never ran.

Environment (all optional; scripts/gpu-check.sh sets them):
- TPAR_GPU_REQUIRED=1: what would skip fails instead (the GPU machine).
- TPAR_GPU_OUT: a folder for each test's logs and JSON (one subfolder per test); else pytest's
  tmp_path.
- TPAR_BIN: the `tpar` binary (default target/release/tpar); TPAR_CUDA_SPANS: the Rust span
  tests' binary (from `cargo test --release -p tpar --test cuda_spans --no-run`).
- TPAR_VLLM_SRC, TPAR_SGLANG_SRC: vLLM's and SGLang's Python sources (a folder or a zip), and
  TPAR_ENGINE_DEPS: a folder holding their pure-Python imports (scripts/gpu-check.sh sets them
  from .ci/vllm-gpu and .ci/engines-gpu).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import pytest

# jobs.py, shared with the CPU tests, is in the folder above (on the path already where pytest
# collects that folder too, not where it is given this one alone).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jobs import ROOT, missing  # noqa: E402

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "gpu: needs an NVIDIA GPU; skipped with the reason where there is none "
        "(scripts/gpu-check.sh runs these on the GPU machine)",
    )
    config.addinivalue_line(
        "markers", "gpus(n): needs at least n GPUs (one process per GPU); skipped with fewer"
    )


@functools.cache
def _gpu_count() -> tuple[int, str]:
    """(GPUs torch sees, why none); makes no CUDA context in this process."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed: the GPU tests need torch with CUDA"
    if not torch.cuda.is_available():
        return (
            0,
            "no CUDA GPU visible to torch: the GPU suite runs on the GPU machine (scripts/gpu-check.sh)",
        )
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    gpus, why = _gpu_count()
    if gpus == 0:
        missing(why)
    needs = item.get_closest_marker("gpus")
    if needs is not None and gpus < needs.args[0]:
        # Fewer GPUs than the test's ranks is a machine's shape, not a fault: always a skip.
        pytest.skip(f"needs {needs.args[0]} GPUs (one process per GPU); {gpus} visible")


@pytest.fixture
def gpu_count() -> int:
    return _gpu_count()[0]


@pytest.fixture
def gpu_out(request, tmp_path) -> Path:
    """Where this test keeps its logs and JSON: TPAR_GPU_OUT/<test> on the GPU machine."""
    base = os.environ.get("TPAR_GPU_OUT")
    if not base:
        return tmp_path
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")
    folder = Path(base) / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _executable(variable: str, default: Path, how: str) -> Path:
    path = Path(os.environ.get(variable) or default)
    if not (path.is_file() and os.access(path, os.X_OK)):
        missing(f"no {path} ({variable}): {how}")
    return path


@pytest.fixture(scope="session")
def tpar_bin() -> Path:
    return _executable(
        "TPAR_BIN",
        ROOT / "target" / "release" / "tpar",
        "build it with `cargo build --release -p tpar-cli` (scripts/gpu-check.sh --prepare)",
    )


@pytest.fixture(scope="session")
def cuda_spans_bin() -> Path:
    return _executable(
        "TPAR_CUDA_SPANS",
        ROOT / ".ci" / "gpu" / "cuda_spans",
        "build it with `scripts/gpu-check.sh --prepare` (cargo test --no-run of crates/tpar/tests/cuda_spans.rs)",
    )
