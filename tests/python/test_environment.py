"""`import tpar` runs the `tpar` command's process set-up (tpar::environment::prepare): it sets
CUDA_DEVICE_MAX_CONNECTIONS unless the user did, and finds NVRTC from pip's
`nvidia-cuda-nvrtc` wheel on the interpreter's sys.path without LD_LIBRARY_PATH.

Each case runs a fresh interpreter with LD_LIBRARY_PATH, PYTHONPATH and tpar's own search
variables removed, so that only what tpar does itself can find the library. The wheel is the
one CI installs into .ci/pydeps (TPAR_NVRTC_SITE names another folder holding `nvidia/`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("TPAR_NVRTC_SITE", ROOT / ".ci" / "pydeps"))
WHEEL_LIB = SITE / "nvidia" / "cu13" / "lib"

# Puts the folder named on the command line (if any) on sys.path as site-packages would be,
# imports tpar, and prints what it found and which libnvrtc files the process has mapped.
PROBE = r"""
import json, sys
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
import tpar
env = tpar.environment()
with open("/proc/self/maps") as maps:
    files = {line.split()[5] for line in maps if len(line.split()) > 5}
env["mapped"] = sorted(f for f in files if "/libnvrtc" in f)
print(json.dumps(env))
"""

CLEARED = (
    "LD_LIBRARY_PATH",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "TPAR_NVRTC_DIR",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)


def probe(*site: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(extra)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, site)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_import_sets_cuda_device_max_connections_unless_set():
    assert probe()["cuda_device_max_connections"] == "32"
    assert probe(CUDA_DEVICE_MAX_CONNECTIONS="1")["cuda_device_max_connections"] == "1"


def test_nvrtc_from_the_pip_wheel_on_sys_path_without_ld_library_path():
    if not (WHEEL_LIB / "libnvrtc.so.13").exists():
        why = f"no pip NVRTC wheel in {SITE} (pip install --target {SITE} nvidia-cuda-nvrtc)"
        assert "TPAR_REQUIRE_NVRTC" not in os.environ, f"TPAR_REQUIRE_NVRTC is set but {why}"
        pytest.skip(why)
    without = probe()
    if without["nvrtc"] is not None:
        pytest.skip(
            f"NVRTC {without['nvrtc']} is found without the wheel ({without['nvrtc_file']}), "
            "so this machine cannot show the wheel being found"
        )
    # Without the wheel's folder: not loaded, and the error says how to get it.
    assert without["mapped"] == []
    assert "NVRTC" in without["nvrtc_error"] and "pip install" in without["nvrtc_error"]

    found = probe(SITE)
    assert found["nvrtc_error"] is None
    assert found["nvrtc"].startswith("13."), found
    assert Path(found["nvrtc_file"]).resolve().parent == WHEEL_LIB.resolve(), found
    assert found["mapped"], found
    for file in found["mapped"]:
        assert Path(file).resolve().parent == WHEEL_LIB.resolve(), found
    assert str(WHEEL_LIB) in found["nvrtc_search_dirs"], found
