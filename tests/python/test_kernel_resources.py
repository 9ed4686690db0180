"""scripts/kernel_resources.py reads ptxas's registers and spills of tpar's kernels through
NVRTC, and passes tuning.cuh's knobs on: ring.cu as built (TPAR_LAUNCH_MIN_BLOCKS=1, one block
an SM) spills in no kernel, and with the knob at 0 ptxas compiles its f32 kernel for 64
registers and spills (NVRTC 13.5, sm_90). Skips where NVRTC cannot be loaded."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "kernel_resources.py"


def nvrtc_loadable() -> bool:
    try:
        ctypes.CDLL("libnvrtc.so.13")
    except OSError:
        return False
    return True


needs_nvrtc = pytest.mark.skipif(
    not nvrtc_loadable(),
    reason="libnvrtc.so.13 not loadable (scripts/test.sh installs nvidia-cuda-nvrtc and puts it on LD_LIBRARY_PATH)",
)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300
    )


def table(stdout: str) -> dict[str, tuple[int, int, int, int]]:
    rows = {}
    for line in stdout.splitlines():
        fields = line.split()
        if fields and fields[0].startswith("tpar_"):
            rows[fields[0]] = tuple(int(f) for f in fields[1:])
    return rows


@needs_nvrtc
def test_every_kernel_of_a_file_gets_a_row_and_the_knob_reaches_ptxas():
    plain = run("staged_pull.cu")
    assert plain.returncode == 0, plain.stderr
    rows = table(plain.stdout)
    assert set(rows) == {"tpar_staged_pull_f32", "tpar_staged_pull_f16", "tpar_staged_pull_bf16"}, (
        plain.stdout
    )
    assert all(0 < registers <= 128 for registers, *_ in rows.values()), rows
    for kernel, (_registers, _stack, stores, loads) in rows.items():
        assert (stores, loads) == (0, 0), f"{kernel} spills as built: {plain.stdout}"

    # Without the blocks-per-SM bound ptxas compiles staged-pull for two blocks an SM (64
    # registers) and spills: the knob is what keeps it from doing so. (The ring was the
    # example until its launches carried a slot per step, 2026-12-06: it now fits without.)
    unbounded = run("staged_pull.cu", "-DTPAR_LAUNCH_MIN_BLOCKS=0")
    assert unbounded.returncode == 0, unbounded.stderr
    assert "-DTPAR_LAUNCH_MIN_BLOCKS=0" in unbounded.stdout.splitlines()[0]
    registers, _stack, stores, _loads = table(unbounded.stdout)["tpar_staged_pull_f32"]
    assert registers == 64 and stores > 0, f"the knob did not reach ptxas: {unbounded.stdout}"


def test_bad_arguments_are_named():
    done = run("ring.cu", "--bogus")
    assert done.returncode != 0
    assert "--bogus" in done.stderr
    missing = run("no_such_kernel.cu")
    assert missing.returncode != 0
    assert "no_such_kernel.cu" in missing.stderr
