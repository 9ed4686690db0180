"""vLLM's own code (the released 0.33.0 wheel's Python files and entry points, unpacked at test
time, not copied into the project) loading tpar's plugin: ``vllm.plugins.load_general_plugins()``
discovers tpar's ``vllm.general_plugins`` entry point in the installed wheel, and vLLM's real
``custom_all_reduce`` module, imported the way ``CudaCommunicator.__init__`` imports it, then
holds tpar's class (keeping vLLM's static helpers); ``TPAR_ALLREDUCE=0`` and a
``VLLM_PLUGINS`` list without tpar leave vLLM's class. vLLM's compiled ``_C`` is left out (it
needs CUDA): vLLM's module then imports as on a machine without GPUs.

Needs torch and vLLM's pure-Python imports (scripts/test.sh installs them); skipped, saying
which is missing, without them.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import textwrap
import zipfile

import pytest

pytest.importorskip(
    "torch", reason="torch is not installed (scripts/test.sh installs it unless TPAR_CI_TORCH=0)"
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHEEL_DIR = pathlib.Path(os.environ.get("TPAR_ENGINE_WHEELS", ROOT / ".ci" / "engines"))
VERSION = "0.33.0"
DEPS = ("regex", "msgspec", "pydantic", "requests", "psutil", "zmq")


@pytest.fixture(scope="module")
def vllm_path() -> str:
    missing = [name for name in DEPS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(
            f"vLLM's modules need {', '.join(missing)} (scripts/test.sh installs them into .ci/sglang-deps)"
        )
    wheels = sorted(WHEEL_DIR.glob(f"vllm-{VERSION}-*.whl"))
    if not wheels:
        pytest.skip(
            f"vllm-{VERSION} wheel not in {WHEEL_DIR} (test_engines_contract.py or scripts/test.sh downloads it)"
        )
    target = WHEEL_DIR / f"vllm-{VERSION}-py"
    if not (target / ".complete").is_file():
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.endswith(".py") or name.startswith(f"vllm-{VERSION}.dist-info/"):
                    wheel.extract(name, target)
        (target / ".complete").touch()
    return str(target)


CODE = textwrap.dedent(
    """
    import sys
    import vllm.plugins
    vllm.plugins.load_general_plugins()
    # CudaCommunicator.__init__'s own import statement (test_engines_contract.py checks it is this)
    from vllm.distributed.device_communicators.custom_all_reduce import CustomAllreduce
    from tpar.engines import TparCustomAllreduce
    print("TPAR", issubclass(CustomAllreduce, TparCustomAllreduce))
    print("HELPER", CustomAllreduce.create_shared_buffer.__module__)
    """
)


def _run(vllm_path, **env):
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TPAR_ALLREDUCE", "VLLM_PLUGINS", "TPAR_ENGINE_HOOK")
    }
    base["PYTHONPATH"] = os.pathsep.join(
        [vllm_path] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    result = subprocess.run(
        [sys.executable, "-c", CODE],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines(), result.stderr


def test_vllms_plugin_loader_makes_its_custom_allreduce_tpars(vllm_path):
    lines, err = _run(vllm_path)
    assert lines == [
        "TPAR True",
        "HELPER vllm.distributed.device_communicators.custom_all_reduce",
    ], (lines, err[-2000:])
    assert "CustomAllreduce is tpar's" in err


def test_vllm_plugins_naming_only_tpar_loads_it(vllm_path):
    lines, _ = _run(vllm_path, VLLM_PLUGINS="tpar_allreduce")
    assert lines[0] == "TPAR True", lines


@pytest.mark.parametrize("env", [{"TPAR_ALLREDUCE": "0"}, {"VLLM_PLUGINS": "some_other_plugin"}])
def test_vllm_keeps_its_class_when_tpar_is_off_or_not_listed(vllm_path, env):
    lines, err = _run(vllm_path, **env)
    assert lines[0] == "TPAR False", (lines, err[-2000:])
    assert "is tpar's" not in err
