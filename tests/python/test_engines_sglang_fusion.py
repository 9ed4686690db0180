"""SGLang's CUDA fused allreduce + residual + RMSNorm path (FlashInfer's, in 0.5.23) reaching
tpar's fused op through tpar's plugin (tpar.engines.sglang_fusion), on a gloo group of 2 processes.

Each rank loads tpar's plugin with SGLang's own loader (``sglang.srt.plugins.load_plugins``, the
installed wheel's entry point), builds SGLang's own ``GroupCoordinator`` for "tp" (its custom
allreduce is then tpar's, on tpar's CPU backend) and publishes it as the TP and attention-TP
group in SGLang's ``runtime_context``. SGLang's ``flashinfer_comm_fusion`` module is SGLang's;
the layer code on the path (``layernorm._forward_with_allreduce_fusion``, ``add_norm``'s gate,
``fusions/allreduce.py``'s ``fused_ffn_input``) is SGLang's source cut out of the wheel
(tests/python/sglang_fusion_standin.py: those modules import transformers and sgl_kernel), with
the platform flags of a GPU FlashInfer's fusion does not take. Checked:

- the hooks: SGLang's lookup of ``flashinfer_allreduce_residual_rmsnorm`` gives tpar's function,
  and the gate that ``fusions/allreduce.py`` bound by name admits batches it did not;
- SGLang's ``fused_ffn_input`` (gate -> ``_forward_with_allreduce_fusion`` -> the fused entry)
  makes one call of tpar's fused op and none of SGLang's allreduce or norm; ``residual_out`` is
  bitwise the fp32 sum rounded once plus the residual rounded once, the norm is within two
  roundings of a torch fp32 reference, both equal SGLang's own unfused sequence on the same
  operands (residual bitwise), the inputs are unchanged, both ranks have the same bits;
- what tpar does not take (Gemma's fp32 weight, over max_size, an attention-TP group whose custom
  allreduce is not tpar's) goes to SGLang's own unfused sequence, with the right result and a
  logged reason; with no tpar on the TP group the gate is SGLang's own (no fused path);
- the same call under ``torch.compile`` (Dynamo, eager backend, dynamic shapes) still reaches
  tpar on every call, with the eager bits;
- ``TPAR_ALLREDUCE=0``: SGLang's function and gate stay SGLang's, and the fused path is not taken.
"""

from __future__ import annotations

import pathlib
import sys
import textwrap

import pytest
from jobs import run_python_ranks
from test_engines_sglang import sglang_path  # noqa: F401  (the fixture: SGLang's wheel, unpacked)

pytest.importorskip(
    "torch", reason="torch is not installed (scripts/test.sh installs it unless TPAR_CI_TORCH=0)"
)

HERE = pathlib.Path(__file__).resolve().parent

WORKER = textwrap.dedent(
    """
    import hashlib, os, sys
    import torch, torch.distributed as dist
    rank, n, scenario = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["SCENARIO"]
    counts = {"tpar": 0, "sglang_ar": 0}
    import sglang_fusion_standin as standin
    standin.install(os.environ["SGLANG_ROOT"])
    from sglang.srt.plugins import load_plugins
    load_plugins()  # SGLang's own loader: entry points of the installed packages
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.runtime_context import get_parallel
    import sglang.srt.layers.flashinfer_comm_fusion as fcf
    import sglang.srt.layers.layer_boundary.fusions.allreduce as fusions
    import sglang.srt.layers.layer_boundary.residual.add_norm as add_norm
    import sglang.srt.layers.layernorm  # noqa: F401
    group = ps.GroupCoordinator([list(range(n))], rank, "gloo", use_pynccl=False, use_mscclpp=False,
                                use_custom_allreduce=True, use_torch_symm_mem_all_reduce=False,
                                use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
    ca = group.ca_comm
    plain = ps.GroupCoordinator([list(range(n))], rank, "gloo", use_pynccl=False, use_mscclpp=False,
                                use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                                use_hpu_communicator=False, use_xpu_communicator=False, group_name="attn_tp")
    plain_ar = plain.all_reduce
    plain.all_reduce = lambda x: counts.__setitem__("sglang_ar", counts["sglang_ar"] + 1) or plain_ar(x)
    print("CLASS", type(ca).__name__, getattr(ca, "disabled", None), flush=True)
    from sglang.srt.layers.flashinfer_comm_fusion import flashinfer_allreduce_residual_rmsnorm as entry
    print("ENTRY", getattr(entry, "_tpar", False), flush=True)
    print("GATE BOUND", getattr(fusions.flashinfer_ar_fusion_applies, "_tpar", False),
          fusions.flashinfer_ar_fusion_applies is add_norm.flashinfer_ar_fusion_applies, flush=True)

    if ca is not None and getattr(ca, "comm", None) is not None:
        real_fused = ca.comm.fused_add_rms_norm
        def counted_fused(*a, **k):
            counts["tpar"] += 1
            return real_fused(*a, **k)
        ca.comm.fused_add_rms_norm = counted_fused
    real_ar = group.all_reduce
    def counted_ar(x):
        counts["sglang_ar"] += 1
        return real_ar(x)
    group.all_reduce = counted_ar

    def operands(tokens, hidden, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        xs = [(torch.rand(tokens, hidden, generator=g) * 2 - 1).to(dtype) for _ in range(n)]
        residual = (torch.rand(tokens, hidden, generator=g) * 2 - 1).to(dtype)
        weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
        return xs, residual, weight

    def reference(xs, residual, weight, eps):
        total = xs[0].float()
        for other in xs[1:]:
            total = total + other.float()
        residual_out = (total.to(xs[0].dtype).float() + residual.float()).to(residual.dtype)
        v = residual_out.float()
        norm = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return norm, residual_out

    def within(a, b, dtype):
        unit = {torch.float32: 2.0 ** -22, torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}[dtype]
        return bool(((a.float() - b).abs() <= b.abs() * unit + 1e-6).all())

    def run(tokens, hidden, dtype, weight_dtype=None, seed=1):
        xs, residual, weight = operands(tokens, hidden, dtype, seed)
        if weight_dtype is not None:
            weight = weight.to(weight_dtype)
        eps = 1e-6
        norm_module = standin.RMSNormStandIn(weight, eps)
        x, res_in = xs[rank].clone(), residual.clone()
        counts.update(tpar=0, sglang_ar=0)
        out = fusions.fused_ffn_input(standin.PlanStandIn(norm_module), x, residual, None)
        if out is None:
            return f"NONE {tokens}x{hidden}", None
        norm, residual_out = out
        want_norm, want_residual = reference(xs, res_in, weight, eps)
        checks = [
            torch.equal(residual_out, want_residual),
            within(norm, want_norm, dtype),
            torch.equal(x, xs[rank]) and torch.equal(residual, res_in),
            residual_out.data_ptr() != residual.data_ptr(),
        ]
        line = (f"CASE {tokens}x{hidden} {str(dtype)[6:]} tpar={counts['tpar']} sglang_ar={counts['sglang_ar']} "
                f"norm_fwd={norm_module.forward_calls}")
        # SGLang's own unfused sequence on the same operands (its fallback, over a group without
        # tpar): the same residual bits, the norm within the same roundings.
        with get_parallel().override(attn_tp_group=plain):
            sglang_norm, sglang_residual = fusions.fused_ffn_input(
                standin.PlanStandIn(standin.RMSNormStandIn(weight, eps)), xs[rank].clone(), res_in.clone(), None)
        checks.append(torch.equal(residual_out, sglang_residual) and within(norm, sglang_norm.float(), dtype))
        digest = hashlib.sha256(norm.view(torch.uint8).numpy().tobytes()
                                + residual_out.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        return f"{line} checks={''.join('1' if c else '0' for c in checks)}", digest

    with get_parallel().override(tp_group=group, attn_tp_group=group, tp_size=n, attn_tp_size=n, tp_rank=rank,
                                 attn_tp_rank=rank, moe_ep_size=1, moe_tp_size=n):
        gate = fusions.flashinfer_ar_fusion_applies
        engine_gate = getattr(gate, "engine_original", gate)
        print("GATE", engine_gate(8), gate(8), gate(0), gate(add_norm.FUSE_ALLREDUCE_MAX_BATCH_SIZE + 1), flush=True)
        print("PRESERVES", fusions.flashinfer_preserves_residual(torch.empty(8, 4), None), flush=True)
        digests = []
        cases = [(1, 64, torch.bfloat16), (8, 40, torch.bfloat16), (5, 5120, torch.bfloat16), (3, 72, torch.float32),
                 (2, 96, torch.float16)]
        if scenario == "off":
            cases = cases[:1]
        for tokens, hidden, dtype in cases:
            line, digest = run(tokens, hidden, dtype)
            print(line, "digest=" + str(digest), flush=True)
        if scenario == "fuse":
            # Under torch.compile (SGLang's --enable-torch-compile traces its layers with Dynamo):
            # the hooked path still reaches tpar on every call, with the eager bits.
            xs, residual, weight = operands(8, 64, torch.bfloat16, 3)
            plan = standin.PlanStandIn(standin.RMSNormStandIn(weight, 1e-6))
            layer = lambda x, r: fusions.fused_ffn_input(plan, x, r, None)
            eager = layer(xs[rank].clone(), residual.clone())
            counts.update(tpar=0, sglang_ar=0)
            compiled = torch.compile(layer, backend="eager", dynamic=True)
            first, second = (compiled(xs[rank].clone(), residual.clone()) for _ in range(2))
            same = all(torch.equal(a, b) for got in (first, second) for a, b in zip(got, eager))
            print("COMPILE", f"tpar={counts['tpar']} sglang_ar={counts['sglang_ar']} same={same}", flush=True)
            # Gemma's fp32 gamma beside bf16 activations: tpar declines, SGLang's sequence runs.
            print("GEMMA", run(4, 64, torch.bfloat16, weight_dtype=torch.float32)[0], flush=True)
            # Over tpar's max_size: SGLang's sequence.
            ca.max_size, saved = 1024, ca.max_size
            print("OVER", run(4, 256, torch.bfloat16)[0], flush=True)
            print("OVER AGAIN", run(2, 512, torch.bfloat16)[0], flush=True)  # its reason is not logged again
            ca.max_size = saved
            # The TP group without tpar: the gate is SGLang's answer (no), the fused path not taken.
            group.ca_comm = None
            print("TP NOT TPAR", run(4, 64, torch.bfloat16)[0], flush=True)
            group.ca_comm = ca
            # An attention-TP group (the one fused_ffn_input reduces over) whose custom allreduce
            # is SGLang's, beside a TP group that is tpar's: the fused entry declines.
            with get_parallel().override(attn_tp_group=plain):
                print("ATTN NOT TPAR", run(4, 64, torch.bfloat16)[0], flush=True)
    if ca is not None:
        ca.close()
    # As an engine shuts down: without it, gloo's threads were still up at interpreter exit and
    # one run in about twelve aborted there ("terminate called without an active exception").
    dist.destroy_process_group()
    # Every check above is printed, and tpar's communicator is closed. With it destroyed, a CI run
    # on 8100d82 still aborted so in interpreter teardown once (a C++ thread of torch's, after
    # torch.compile; tpar has no C++), so the rank leaves without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def _run(sglang_path, scenario, **env):
    # The scenario sets TPAR_ALLREDUCE and SGLANG_PLUGINS where it wants them.
    env = {
        "TPAR_ALLREDUCE": None,
        "SGLANG_PLUGINS": None,
        "SCENARIO": scenario,
        "SGLANG_ROOT": sglang_path,
        **env,
    }
    return run_python_ranks(2, WORKER, timeout=300, env=env, path=[sglang_path, HERE])


def test_sglang_fused_entry_runs_tpars_fused_op(sglang_path):
    outputs = _run(sglang_path, "fuse")
    case_lines = []
    for lines, err in outputs:
        assert "CLASS TparCustomAllreduce False" in lines, lines
        assert "ENTRY True" in lines, lines
        assert "GATE BOUND True True" in lines, lines
        # SGLang's own gate says no on this GPU; tpar's admits 8 tokens, not 0 nor over 2048.
        assert "GATE False True False False" in lines, lines
        assert "PRESERVES True" in lines, lines
        assert "COMPILE tpar=2 sglang_ar=0 same=True" in lines, lines
        cases = [line for line in lines if line.startswith("CASE ")]
        assert len(cases) == 5, lines
        for line in cases:
            # One tpar fused call, no SGLang allreduce, no SGLang norm; every check holds.
            assert "tpar=1 sglang_ar=0 norm_fwd=0 checks=11111" in line, line
        case_lines.append(cases)
        # Declined: SGLang's allreduce + norm ran instead, and the results are right (the input
        # changes: SGLang's all_reduce reduces CPU tensors in place; on CUDA it is out of place).
        for label in ("GEMMA", "OVER", "OVER AGAIN", "ATTN NOT TPAR"):
            line = next(line for line in lines if line.startswith(label + " "))
            assert "tpar=0 sglang_ar=1 norm_fwd=1 checks=11011" in line, line
        assert any(line.startswith("TP NOT TPAR NONE 4x64") for line in lines), lines
        assert "takes tpar's fused allreduce + RMSNorm" in err, err[-2000:]
        assert (
            "Gemma's fp32 gamma" in err
            and "over the limit of 1024 bytes" in err
            and "is not an enabled tpar one" in err
        ), err[-3000:]
        assert err.count("over the limit of 1024 bytes") == 1, err[-3000:]
    # Both ranks hold the same bits.
    assert [line.split("digest=")[1] for line in case_lines[0]] == [
        line.split("digest=")[1] for line in case_lines[1]
    ]


def test_tpar_allreduce_0_leaves_sglangs_fused_path_alone(sglang_path):
    for lines, err in _run(sglang_path, "off", TPAR_ALLREDUCE="0"):
        assert lines[0].startswith("CLASS ") and "TparCustomAllreduce" not in lines[0], lines
        assert "ENTRY False" in lines, lines
        assert "GATE BOUND False True" in lines, lines
        assert "GATE False False False False" in lines, lines
        # The gate says no, so SGLang's boundary does not take the fused path at all.
        assert any(line.startswith("NONE 1x64") for line in lines), lines
        assert "tpar's fused" not in err, err[-2000:]


def _tree(sglang_path, relative):
    import ast

    return ast.parse((pathlib.Path(sglang_path) / "sglang" / "srt" / relative).read_text())


def test_sglang_looks_the_hooked_names_up_where_the_hooks_replace_them(sglang_path):
    """What the hooks rely on, read from SGLang's own files: the fused entry is imported inside
    ``_forward_with_allreduce_fusion`` (so replacing the module attribute is enough) and called
    with keywords tpar's function takes, its ``(None, None)`` is the decline; every module that
    binds the gate by name is one the plugin rebinds; tpar's function has SGLang's parameters."""
    import ast
    import inspect

    from tpar.engines import sglang_fusion

    functions = {
        node.name: node
        for node in ast.walk(_tree(sglang_path, "layers/layernorm.py"))
        if isinstance(node, ast.FunctionDef)
    }
    caller = functions["_forward_with_allreduce_fusion"]
    imports = [
        node
        for node in ast.walk(caller)
        if isinstance(node, ast.ImportFrom) and node.module == sglang_fusion.FUSION_MODULE
    ]
    assert any(
        alias.name == sglang_fusion.FUSION_SYMBOL for node in imports for alias in node.names
    )
    calls = [
        node
        for node in ast.walk(caller)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == sglang_fusion.FUSION_SYMBOL
    ]
    assert len(calls) == 1
    ours = inspect.signature(sglang_fusion._make_fused(None, None)).parameters
    assert {k.arg for k in calls[0].keywords} <= set(ours), [k.arg for k in calls[0].keywords]
    assert "fused_result[0] is not None" in ast.unparse(caller)

    entry = next(
        node
        for node in _tree(sglang_path, "layers/flashinfer_comm_fusion.py").body
        if isinstance(node, ast.FunctionDef) and node.name == sglang_fusion.FUSION_SYMBOL
    )
    assert [a.arg for a in entry.args.args] == list(ours)
    assert [ast.literal_eval(d) for d in entry.args.defaults] == [p.default for p in ours.values()][
        -len(entry.args.defaults) :
    ]
    assert "return (None, None)" in ast.unparse(entry)

    # Every module of SGLang that imports the gate or the entry by name.
    srt = pathlib.Path(sglang_path) / "sglang" / "srt"
    binders = {}
    for path in srt.rglob("*.py"):
        text = path.read_text(errors="replace")
        for symbol in (sglang_fusion.GATE_SYMBOL, sglang_fusion.FUSION_SYMBOL):
            if symbol not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and any(a.name == symbol for a in node.names):
                    module = "sglang.srt." + str(path.relative_to(srt).with_suffix("")).replace(
                        "/", "."
                    )
                    binders.setdefault(symbol, set()).add((module, node.col_offset == 0))
    assert binders[sglang_fusion.GATE_SYMBOL] == {
        (m, True) for m in sglang_fusion.GATE_IMPORTERS
    }, binders
    # The entry is imported only inside a function (looked up at call time), by layernorm.
    assert binders[sglang_fusion.FUSION_SYMBOL] == {("sglang.srt.layers.layernorm", False)}, binders


def test_import_hook_runs_each_modules_callbacks_once_when_one_loader_serves_several():
    """tpar's import hook shadows the loader's exec_module; a loader that serves several modules
    (as a zip importer does) must still run each hooked module's callbacks for that module only."""
    import importlib.abc
    import importlib.machinery

    from tpar.engines import plugins

    names = ("tpar_hook_probe_a", "tpar_hook_probe_b")

    class SharedLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            return importlib.machinery.ModuleSpec(fullname, self) if fullname in names else None

        def create_module(self, spec):
            return None

        def exec_module(self, module):
            module.executed = True

    finder = SharedLoader()
    sys.meta_path.append(finder)
    seen = []
    try:
        for name in names:
            plugins.when_imported(
                name, lambda module, name=name: seen.append((name, module.__name__))
            )
        for name in reversed(names):  # the module hooked last is imported first
            __import__(name)
    finally:
        sys.meta_path.remove(finder)
        for name in names:
            sys.modules.pop(name, None)
    assert sorted(seen) == [(name, name) for name in names], seen
