"""SGLang's own code (the released 0.5.23 wheel, unpacked at test time, not copied into the
project) building tpar's class through its own plugin loader, on a gloo group of processes:

- ``sglang.srt.plugins.load_plugins()`` finds tpar's ``sglang.srt.plugins`` entry point in the
  installed wheel, and SGLang's ``GroupCoordinator`` for a "tp" group then holds
  ``TparCustomAllreduce`` (``TPAR_ALLREDUCE=0``: it does not);
- SGLang's out-of-place allreduce (``_all_reduce_out_place(x, "auto")``, what its registered
  ``outplace_all_reduce`` op runs) resolves a small message to tpar ("ca") and gets the sum
  without its input changing, and a message over max_size to its own fallback;
- SGLang's ``graph_capture`` enters tpar's ``capture()``;
- SGLang's fused allreduce + residual + RMSNorm entry (``GroupCoordinator.fused_allreduce_rmsnorm``,
  which asks the custom allreduce for ``fused_allreduce_rmsnorm`` first) reaches tpar's fused op
  and gets the sum, the new residual and the norm, and None back for what tpar does not take;
- a rank that cannot open tpar leaves every rank's object disabled, and SGLang routes every
  size to its own path on every rank.

SGLang's tensors here are CPU tensors (no GPU), and its ``all_reduce`` sends CPU tensors straight
to torch.distributed, so the test calls the out-of-place method that the CUDA path calls. Needs
torch, SGLang's wheel and the pure-Python packages its parallel_state imports (scripts/test.sh
installs them into .ci/sglang-deps); skipped, saying which is missing, without them.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import textwrap
import zipfile

import pytest
from jobs import run_python_ranks

pytest.importorskip(
    "torch", reason="torch is not installed (scripts/test.sh installs it unless TPAR_CI_TORCH=0)"
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
WHEEL_DIR = pathlib.Path(os.environ.get("TPAR_ENGINE_WHEELS", ROOT / ".ci" / "engines"))
VERSION = "0.5.23"
DEPS = (
    "orjson",
    "psutil",
    "pybase64",
    "requests",
    "PIL",
    "starlette",
    "msgspec",
    "pydantic",
    "zmq",
    "tqdm",
    "IPython",
    "aiohttp",
    "tvm_ffi",
)


@pytest.fixture(scope="module")
def sglang_path() -> str:
    missing = [name for name in DEPS if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(
            f"SGLang's parallel_state needs {', '.join(missing)} (scripts/test.sh installs them into .ci/sglang-deps)"
        )
    wheels = sorted(WHEEL_DIR.glob(f"sglang-{VERSION}-*.whl"))
    if not wheels:
        pytest.skip(
            f"sglang-{VERSION} wheel not in {WHEEL_DIR} (test_engines_contract.py or scripts/test.sh downloads it)"
        )
    target = WHEEL_DIR / f"sglang-{VERSION}-unpacked"
    if not (target / "sglang" / "srt" / "distributed" / "parallel_state.py").is_file():
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(target)
    return str(target)


WORKER = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    rank, n, scenario = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["SCENARIO"]
    from sglang.srt.plugins import load_plugins
    load_plugins()  # SGLang's own loader: entry points of the installed packages
    from tpar.engines import TparCustomAllreduce
    if scenario == "fail" and rank == 1:
        TparCustomAllreduce._preflight = lambda self, device: "no peer access (test)"
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)
    from sglang.srt.distributed import parallel_state as ps
    group = ps.GroupCoordinator([list(range(n))], rank, "gloo", use_pynccl=False, use_mscclpp=False,
                                use_custom_allreduce=True, use_torch_symm_mem_all_reduce=False,
                                use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
    ca = group.ca_comm
    print("CLASS", type(ca).__name__, getattr(ca, "disabled", None), flush=True)
    if not isinstance(ca, TparCustomAllreduce):
        sys.exit(0)
    calls = []
    real = ca.custom_all_reduce
    ca.custom_all_reduce = lambda x: calls.append(x.numel()) or real(x)
    for count in (1024, (8 << 20) // 4 + 4):
        x = torch.arange(count, dtype=torch.float32) % 61 + rank
        before = x.clone()
        y = group._all_reduce_out_place(x, "auto")
        expected = sum(torch.arange(count, dtype=torch.float32) % 61 + r for r in range(n))
        assert torch.equal(x, before), "the input changed"
        assert torch.equal(y, expected), f"wrong sum for {count}"
        print("ROUTE", count, group._resolve_outplace_all_reduce_method(x), calls, flush=True)
    # SGLang's fused allreduce + residual + RMSNorm entry (communication_op's
    # tensor_model_parallel_fused_allreduce_rmsnorm calls it on the tp group).
    def fused_entry():
        g = torch.Generator().manual_seed(7)
        xs = [torch.rand(3, 40, generator=g) * 2 - 1 for _ in range(n)]
        residual, weight = torch.rand(3, 40, generator=g), torch.rand(40, generator=g) + 0.5
        x, res_before = xs[rank].clone(), residual.clone()
        fused = group.fused_allreduce_rmsnorm(x, residual, weight, 1e-6)
        if ca.disabled:
            assert fused is None, "a disabled tpar answered SGLang's fused entry"
            return "none"
        assert fused is not None, "SGLang's fused entry did not reach tpar"
        norm_out, residual_out = fused
        total = xs[0].clone()
        for other in xs[1:]:
            total += other
        want_residual = total + residual
        want_norm = want_residual * torch.rsqrt(want_residual.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        assert torch.equal(residual_out, want_residual), "residual_out"
        assert torch.allclose(norm_out, want_norm, rtol=1e-5, atol=1e-6), "norm_out"
        assert torch.equal(x, xs[rank]) and torch.equal(residual, res_before), "an input changed"
        # What tpar does not take goes back to SGLang as None: a weight of another dtype
        # (Gemma's fp32 gamma beside bf16 activations), and a message over max_size.
        assert group.fused_allreduce_rmsnorm(x, residual, weight.double(), 1e-6) is None
        big = torch.ones(2, (4 << 20) // 4 + 4)
        assert group.fused_allreduce_rmsnorm(big, big.clone(), torch.ones(big.shape[1]), 1e-6) is None
        return f"{norm_out.shape[0]} {norm_out.shape[1]}"
    print("FUSED", fused_entry(), flush=True)
    entered = []
    capture = ca.capture
    ca.capture = lambda: (entered.append(1), capture())[1]
    with group.graph_capture():
        pass
    print("CAPTURE", len(entered), flush=True)
    group.destroy() if hasattr(group, "destroy") else None
    # As an engine shuts down (test_engines_sglang_fusion.py's worker aborted at exit one run in
    # about twelve without it: gloo's threads still up).
    dist.destroy_process_group()
    """
)


def _run(sglang_path, n, scenario, **env):
    # The scenario sets TPAR_ALLREDUCE and SGLANG_PLUGINS where it wants them.
    env = {"TPAR_ALLREDUCE": None, "SGLANG_PLUGINS": None, "SCENARIO": scenario, **env}
    return run_python_ranks(n, WORKER, timeout=300, env=env, path=[sglang_path])


def test_sglang_builds_tpar_through_its_plugin_loader_and_routes_to_it(sglang_path):
    for lines, err in _run(sglang_path, 2, "ok"):
        assert "CLASS TparCustomAllreduce False" in lines, lines
        # 4 KiB: SGLang resolves "ca" and calls tpar once; 8 MiB + 16 B: over max_size, SGLang's own path.
        assert "ROUTE 1024 ca [1024]" in lines, lines
        assert f"ROUTE {(8 << 20) // 4 + 4} None [1024]" in lines, lines
        assert "CAPTURE 1" in lines, lines
        assert "FUSED 3 40" in lines, lines
        assert "tpar took the allreduce of this group" in err, err[-2000:]


def test_tpar_allreduce_0_keeps_sglangs_class(sglang_path):
    for lines, _ in _run(sglang_path, 2, "ok", TPAR_ALLREDUCE="0"):
        assert lines and lines[0].startswith("CLASS ") and "TparCustomAllreduce" not in lines[0], (
            lines
        )


def test_one_failing_rank_leaves_sglang_on_its_own_path_on_every_rank(sglang_path):
    for lines, err in _run(sglang_path, 2, "fail"):
        assert "CLASS TparCustomAllreduce True" in lines, lines
        assert "ROUTE 1024 None []" in lines, lines
        assert "FUSED none" in lines, lines
        assert (
            err.count("tpar is off for this group") == 1 and "group rank 1 could not open it" in err
        ), err[-2000:]
