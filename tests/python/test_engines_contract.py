"""tpar.engines against the engines' real code at the pinned releases (vLLM 0.33.0, SGLang
0.5.23), without a GPU and without torch.

Neither engine imports on a CPU-only machine without torch and its CUDA libraries, so these
tests read the released wheels' source (downloaded once with ``pip download --no-deps`` into
``TPAR_ENGINE_WHEELS``, default .ci/engines; nothing of it is copied into the project) and
check, from the engines' own syntax trees:

- the import statement each engine runs at construction resolves, after the plugin, to tpar's
  class (the statement is executed as the engine wrote it, against a stand-in package that
  has the engine's module path);
- tpar's class and dispatch function accept exactly the arguments the engines pass (their call
  sites) and every parameter the engine's own class accepts;
- every attribute the engines read on the object without a hasattr/getattr default exists;
- the wheel's entry points, ``TPAR_ALLREDUCE=0`` and the ``.pth`` fallback.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import pathlib
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest
from tpar.engines import TparCustomAllreduce, plugins

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHEEL_DIR = pathlib.Path(os.environ.get("TPAR_ENGINE_WHEELS", ROOT / ".ci" / "engines"))
PINNED = {"vllm": "0.33.0", "sglang": "0.5.23"}

VLLM_COMMUNICATOR = "vllm/distributed/device_communicators/cuda_communicator.py"
VLLM_CUSTOM_AR = "vllm/distributed/device_communicators/custom_all_reduce.py"
VLLM_PARALLEL_STATE = "vllm/distributed/parallel_state.py"
SGLANG_PARALLEL_STATE = "sglang/srt/distributed/parallel_state.py"
SGLANG_CUSTOM_AR = "sglang/srt/distributed/device_communicators/custom_all_reduce.py"


def _wheel(name: str) -> zipfile.ZipFile:
    version = PINNED[name]
    found = sorted(WHEEL_DIR.glob(f"{name}-{version}-*.whl"))
    if not found:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--disable-pip-version-check",
                f"{name}=={version}",
                "-d",
                str(WHEEL_DIR),
            ],
            capture_output=True,
            text=True,
        )
        found = sorted(WHEEL_DIR.glob(f"{name}-{version}-*.whl"))
        if not found:
            pytest.skip(
                f"{name}=={version} wheel not in {WHEEL_DIR} and pip download failed: "
                f"{result.stderr.strip().splitlines()[-1:]}"
            )
    return zipfile.ZipFile(found[0])


_trees: dict = {}


def _tree(engine: str, path: str) -> ast.Module:
    key = (engine, path)
    if key not in _trees:
        with _wheel(engine) as wheel:
            _trees[key] = ast.parse(
                wheel.read(path).decode(), filename=f"{engine}=={PINNED[engine]}:{path}"
            )
    return _trees[key]


def _function(tree: ast.Module, class_name: str, function: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == function:
                    return item
    raise AssertionError(
        f"{class_name}.{function} not found: the engine moved it; re-read its source"
    )


def _imports_of(function: ast.FunctionDef, module: str, name: str) -> ast.ImportFrom:
    for node in ast.walk(function):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == module
            and any(a.name == name for a in node.names)
        ):
            return node
    raise AssertionError(f"{function.name} no longer imports {name} from {module} inside it")


def _calls(function: ast.AST, callee: str) -> list:
    return [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == callee
    ]


def _bind_call(signature: inspect.Signature, call: ast.Call) -> None:
    """Binds the engine's call (positional count and keyword names) to ``signature``."""
    assert not any(isinstance(a, ast.Starred) for a in call.args), ast.unparse(call)
    assert all(k.arg is not None for k in call.keywords), ast.unparse(call)
    signature.bind(*[object()] * len(call.args), **{k.arg: object() for k in call.keywords})


def _parameters(function: ast.FunctionDef) -> list:
    args = function.args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg != "self"]


def _reads(tree: ast.AST, holder: str):
    """(attributes read on ``holder``, a name or self.<holder>; names the file also looks up
    on something through hasattr/getattr with a default, which may be absent)."""
    read, guarded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if (isinstance(value, ast.Name) and value.id == holder) or (
                isinstance(value, ast.Attribute) and value.attr == holder
            ):
                read.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
        ):
            if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
                guarded.add(node.args[1].value)
    return read, guarded


def _missing(reads) -> list:
    read, guarded = reads
    return sorted(
        name for name in read if not hasattr(TparCustomAllreduce, name) and name not in guarded
    )


def _stand_in_package(tmp_path: pathlib.Path, module: str, body: str) -> None:
    """A package tree with the engine's module path, holding ``body`` (the engine itself does
    not import without torch and CUDA)."""
    parts = module.split(".")
    directory = tmp_path
    for part in parts[:-1]:
        directory = directory / part
        directory.mkdir(exist_ok=True)
        (directory / "__init__.py").touch()
    (directory / f"{parts[-1]}.py").write_text(textwrap.dedent(body))


def _run(tmp_path, code: str, **env) -> subprocess.CompletedProcess:
    environment = {
        k: v for k, v in os.environ.items() if k not in ("TPAR_ALLREDUCE", "TPAR_ENGINE_HOOK")
    }
    environment.update(env)
    environment["PYTHONPATH"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=tmp_path,
        timeout=120,
    )


# -- vLLM ------------------------------------------------------------------------------------


def test_vllm_constructs_customallreduce_with_arguments_tpar_accepts():
    init = _function(_tree("vllm", VLLM_COMMUNICATOR), "CudaCommunicator", "__init__")
    _imports_of(init, plugins.VLLM_MODULE, plugins.VLLM_SYMBOL)
    calls = _calls(init, plugins.VLLM_SYMBOL)
    assert calls, "CudaCommunicator.__init__ no longer calls CustomAllreduce(...)"
    signature = inspect.signature(TparCustomAllreduce)
    for call in calls:
        _bind_call(signature, call)
    keywords = {k.arg for call in calls for k in call.keywords}
    assert {"group", "device"} <= keywords, keywords


def test_tpar_accepts_every_parameter_of_vllms_class():
    engine = _function(_tree("vllm", VLLM_CUSTOM_AR), "CustomAllreduce", "__init__")
    signature = inspect.signature(TparCustomAllreduce)
    signature.bind(**{name: object() for name in _parameters(engine)})


def test_tpar_has_every_attribute_vllm_reads_on_its_custom_allreduce():
    communicator = _reads(_tree("vllm", VLLM_COMMUNICATOR), "ca_comm")
    parallel_state = _reads(_tree("vllm", VLLM_PARALLEL_STATE), "ca_comm")
    assert {
        "disabled",
        "should_custom_ar",
        "custom_all_reduce",
        "custom_all_gather",
    } <= communicator[0]
    assert "capture" in parallel_state[0]
    missing = _missing(communicator) + _missing(parallel_state)
    assert not missing, f"vLLM reads {missing} on ca_comm"


def test_vllm_plugin_swaps_the_class_vllms_own_import_statement_gets(tmp_path):
    init = _function(_tree("vllm", VLLM_COMMUNICATOR), "CudaCommunicator", "__init__")
    statement = ast.unparse(_imports_of(init, plugins.VLLM_MODULE, plugins.VLLM_SYMBOL))
    _stand_in_package(
        tmp_path,
        plugins.VLLM_MODULE,
        """
        class CustomAllreduce:
            @staticmethod
            def create_shared_buffer(size_in_bytes, group=None, uncached=False):
                return ["engine helper", size_in_bytes]
    """,
    )
    code = f"""
        from tpar.engines import plugins, TparCustomAllreduce
        plugins.vllm_plugin()
        import sys
        assert {plugins.VLLM_MODULE!r} not in sys.modules, "the plugin imported the engine early"
        {statement}
        print(issubclass(CustomAllreduce, TparCustomAllreduce), CustomAllreduce.create_shared_buffer(7))
    """
    result = _run(tmp_path, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "['engine", "helper',", "7]"], result.stdout
    assert "is tpar's" in result.stderr

    off = _run(tmp_path, code, TPAR_ALLREDUCE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split()[0] == "False", off.stdout


# -- SGLang ----------------------------------------------------------------------------------


def test_sglang_dispatches_and_constructs_with_arguments_tpar_accepts():
    init = _function(_tree("sglang", SGLANG_PARALLEL_STATE), "GroupCoordinator", "__init__")
    _imports_of(init, plugins.SGLANG_MODULE, plugins.SGLANG_SYMBOL)
    dispatch_calls = _calls(init, plugins.SGLANG_SYMBOL)
    assert dispatch_calls, "GroupCoordinator.__init__ no longer calls dispatch_custom_allreduce"
    # The class SGLang constructs is what the dispatch call was assigned to.
    class_names = {
        target.id
        for node in ast.walk(init)
        if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == plugins.SGLANG_SYMBOL
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    assert class_names, "the result of dispatch_custom_allreduce is no longer assigned to a name"
    construct_calls = [call for name in class_names for call in _calls(init, name)]
    assert construct_calls
    fake_module = type(sys)("stand_in")
    fake_module.dispatch_custom_allreduce = lambda group, device: None
    plugins._swap_sglang(fake_module)
    dispatch = fake_module.dispatch_custom_allreduce
    assert dispatch(group=None, device=None) is TparCustomAllreduce
    for call in dispatch_calls:
        _bind_call(inspect.signature(dispatch), call)
    for call in construct_calls:
        _bind_call(inspect.signature(TparCustomAllreduce), call)


def test_tpar_accepts_every_parameter_of_sglangs_class():
    engine = _function(_tree("sglang", SGLANG_CUSTOM_AR), "CustomAllreduce", "__init__")
    inspect.signature(TparCustomAllreduce).bind(**{name: object() for name in _parameters(engine)})


def test_tpar_has_every_attribute_sglang_reads_on_its_custom_allreduce():
    reads = _reads(_tree("sglang", SGLANG_PARALLEL_STATE), "ca_comm")
    assert {"disabled", "should_custom_ar", "custom_all_reduce", "capture"} <= reads[0], reads[0]
    missing = _missing(reads)
    assert not missing, f"SGLang reads {missing} on ca_comm without a hasattr/getattr default"


def test_sglang_plugin_swaps_the_dispatch_sglangs_own_import_statement_gets(tmp_path):
    init = _function(_tree("sglang", SGLANG_PARALLEL_STATE), "GroupCoordinator", "__init__")
    statement = ast.unparse(_imports_of(init, plugins.SGLANG_MODULE, plugins.SGLANG_SYMBOL))
    _stand_in_package(
        tmp_path,
        plugins.SGLANG_MODULE,
        """
        class CustomAllreduce:
            pass

        def dispatch_custom_allreduce(group, device):
            return CustomAllreduce
    """,
    )
    code = f"""
        from tpar.engines import plugins, TparCustomAllreduce
        plugins.sglang_plugin()
        {statement}
        print(dispatch_custom_allreduce(group=None, device=None) is TparCustomAllreduce)
    """
    result = _run(tmp_path, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"], result.stdout
    off = _run(tmp_path, code, TPAR_ALLREDUCE="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False"], off.stdout


# -- the wheel: entry points and the .pth fallback -------------------------------------------


@pytest.mark.parametrize(
    "group, function",
    [("vllm.general_plugins", plugins.vllm_plugin), ("sglang.srt.plugins", plugins.sglang_plugin)],
)
def test_installed_wheel_registers_the_entry_point(group, function):
    found = [
        ep
        for ep in importlib.metadata.entry_points(group=group)
        if ep.dist and ep.dist.name == "tpar"
    ]
    assert len(found) == 1, f"tpar's wheel has no single {group} entry point: {found}"
    assert found[0].load() is function


def test_pth_hook_is_installed_and_swaps_only_when_asked(tmp_path):
    pth = pathlib.Path(sysconfig.get_paths()["purelib"]) / "tpar-engines.pth"
    assert pth.is_file(), f"the wheel did not install {pth}"
    _stand_in_package(tmp_path, plugins.VLLM_MODULE, "class CustomAllreduce:\n    pass\n")
    _stand_in_package(
        tmp_path,
        plugins.SGLANG_MODULE,
        "def dispatch_custom_allreduce(group, device):\n    return None\n",
    )
    # A fresh interpreter that never imports tpar itself: only the .pth can swap.
    code = f"""
        from {plugins.VLLM_MODULE} import CustomAllreduce
        from {plugins.SGLANG_MODULE} import dispatch_custom_allreduce
        print(CustomAllreduce.__module__, dispatch_custom_allreduce(None, None) is not None)
    """
    hooked = _run(tmp_path, code, TPAR_ENGINE_HOOK="1")
    assert hooked.returncode == 0, hooked.stderr
    assert hooked.stdout.split() == ["tpar.engines.plugins", "True"], hooked.stdout
    plain = _run(tmp_path, code)
    assert plain.stdout.split() == [plugins.VLLM_MODULE, "False"], plain.stdout + plain.stderr
    off = _run(tmp_path, code, TPAR_ENGINE_HOOK="1", TPAR_ALLREDUCE="0")
    assert off.stdout.split() == [plugins.VLLM_MODULE, "False"], off.stdout + off.stderr


def _source(engine: str, path: str) -> str:
    with _wheel(engine) as wheel:
        return wheel.read(path).decode()


def test_sglangs_fused_entry_asks_the_custom_allreduce_with_the_arguments_tpar_takes():
    """The fused allreduce + residual + RMSNorm path tpar covers (see tpar.engines): SGLang's
    GroupCoordinator.fused_allreduce_rmsnorm calls ca_comm.fused_allreduce_rmsnorm(input_,
    residual_inp_, weight_, eps) and tpar's method takes exactly those."""
    method = _function(
        _tree("sglang", SGLANG_PARALLEL_STATE), "GroupCoordinator", "fused_allreduce_rmsnorm"
    )
    calls = [
        node
        for node in ast.walk(method)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "fused_allreduce_rmsnorm"
    ]
    assert calls, (
        "SGLang no longer asks its custom allreduce for fused_allreduce_rmsnorm: re-read parallel_state.py"
    )
    for call in calls:
        inspect.signature(TparCustomAllreduce.fused_allreduce_rmsnorm).bind(
            None, *[None] * len(call.args), **{k.arg: None for k in call.keywords}
        )


def test_the_fusion_paths_left_uncovered_still_bypass_the_custom_allreduce():
    """What tpar.engines says is not covered, still true at the pinned releases: vLLM's
    AllReduceFusionPass and SGLang's CUDA fused path call FlashInfer, not the custom-allreduce
    object (a release that adds such a hook makes this fail, so that it gets wired)."""
    path = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"
    vllm_pass = _source("vllm", path)
    assert "flashinfer_trtllm_fused_allreduce_norm" in vllm_pass
    (fusion_pass,) = [
        node
        for node in ast.walk(_tree("vllm", path))
        if isinstance(node, ast.ClassDef) and node.name == "AllReduceFusionPass"
    ]
    names = {n.attr for n in ast.walk(fusion_pass) if isinstance(n, ast.Attribute)} | {
        n.id for n in ast.walk(fusion_pass) if isinstance(n, ast.Name)
    }
    assert not names & {"ca_comm", "device_communicator", "custom_all_reduce"}, names
    layernorm = _source("sglang", "sglang/srt/layers/layernorm.py")
    assert "flashinfer_allreduce_residual_rmsnorm(" in layernorm and "if _use_aiter:" in layernorm
