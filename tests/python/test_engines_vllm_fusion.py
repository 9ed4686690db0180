"""tpar's vLLM fusion pass (``tpar.engines.vllm_fusion``) against vLLM 0.33.0's own code, on
the CPU with two processes:

- the pattern: vLLM's ``AllReduceFusedAddRMSNormPattern.register`` is re-read from the pinned
  source and must hold the same ``pattern`` body as tpar's (so a release that changes what it
  matches makes this fail), and ``backends.py`` must still add the
  ``post_grad_custom_post_pass`` entry to its pass manager;
- a graph traced (fake mode, as Inductor's post-grad graph) from a layer calling vLLM's
  ``tensor_model_parallel_all_reduce`` and ``vllm.ir.ops.fused_add_rms_norm`` is rewritten to one
  ``torch.ops.tpar.vllm_all_reduce_fused_add_rms_norm`` node, with vLLM's two ops gone (both
  registrations: norm and residual, norm only); ``torch.compile`` with Inductor and the pass in
  Inductor's ``post_grad_custom_post_pass`` hook (the hook vLLM fills with its pass manager) does
  the same;
- the rewritten graph runs tpar's fused op (spied), not vLLM's allreduce; ``residual_out`` is
  bitwise the unfused graph's, ``norm`` within two bf16 roundings of it (vLLM's native
  ``fused_add_rms_norm`` normalises the unrounded fp32 sum, tpar the rounded ``residual_out``,
  as vLLM's CUDA kernel does: see tpar.Communicator.fused_add_rms_norm) and bitwise what
  ``Communicator.fused_add_rms_norm`` gives; both ranks get the same bits;
- the fallback: a message tpar's ``should_custom_ar`` declines (over max_size) and a fused call
  that raises both run vLLM's unfused sequence and give bitwise the unfused graph's results; a
  Gemma-style fp32 weight is not matched; a TP group whose custom allreduce is not tpar's is not
  rewritten.

What stands in for vLLM here, because the CPU CI cannot run it: vLLM's ``GroupCoordinator`` is
vLLM's own (gloo groups), built without a device communicator, since vLLM's communicator
classes import ``vllm.config`` (which needs transformers, tokenizers, openai-harmony and more
that CI does not install); its two config reads of distributed timeouts are replaced by None
(no timeout). The device communicator is a small stand-in with vLLM's ``CudaCommunicator``
routing (``ca_comm`` first when ``should_custom_ar`` says yes, else torch.distributed) and a
``TparCustomAllreduce`` on the CPU as ``ca_comm``; ``use_custom_op_call`` is set as vLLM's CUDA
platform sets it, so the allreduce traces to ``torch.ops.vllm.all_reduce``. vLLM's IR op runs
its native provider (no CUDA kernels on this machine).
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from jobs import run_python_ranks

pytest.importorskip(
    "torch", reason="torch is not installed (scripts/test.sh installs it unless TPAR_CI_TORCH=0)"
)

from test_engines_vllm import vllm_path  # noqa: E402,F401  (the fixture: vLLM's unpacked sources)

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPAR_PASS = ROOT / "crates" / "tpar-py" / "python" / "tpar" / "engines" / "vllm_fusion.py"
VLLM_FUSION = "vllm/compilation/passes/fusion/allreduce_rms_fusion.py"
VLLM_BACKENDS = "vllm/compilation/backends.py"

WORKER = textwrap.dedent(
    """
    import hashlib, os, sys
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{os.environ['STORE']}-inductor{rank}"  # one a rank
    import torch, torch.distributed as dist
    from torch.fx.experimental.proxy_tensor import make_fx
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)

    import vllm.distributed.utils as vllm_utils
    vllm_utils.get_cpu_distributed_timeout_or_none = lambda: None  # reads vllm.config (module doc)
    vllm_utils.get_distributed_timeout_or_none = lambda: None
    from vllm.distributed import parallel_state as ps, tensor_model_parallel_all_reduce
    import vllm.ir.ops
    import tpar
    from tpar.engines import TparCustomAllreduce
    from tpar.engines import vllm_fusion

    class DeviceCommunicator:
        # CudaCommunicator.all_reduce's routing: the custom allreduce first, else torch.distributed.
        def __init__(self, ca_comm, device_group):
            self.ca_comm, self.device_group, self.calls = ca_comm, device_group, 0
        def all_reduce(self, x):
            self.calls += 1
            ca = self.ca_comm
            if ca is not None and not ca.disabled and ca.should_custom_ar(x):
                out = ca.custom_all_reduce(x)
                assert out is not None
                return out
            out = x.clone()
            dist.all_reduce(out, group=self.device_group)
            return out

    group = ps.GroupCoordinator([list(range(n))], rank, "gloo", use_device_communicator=False, group_name="tp")
    group.use_custom_op_call = True  # what vLLM's CUDA platform sets
    ps._TP = group
    ca = TparCustomAllreduce(group.cpu_group, "cpu", max_size=int(os.environ["MAX_SIZE"]))
    assert not ca.disabled
    device = group.device_communicator = DeviceCommunicator(ca, group.device_group)
    fused_calls = []
    real_fused = ca.comm.fused_add_rms_norm
    ca.comm.fused_add_rms_norm = lambda *a, **k: fused_calls.append(1) or real_fused(*a, **k)

    def layer(x, residual, weight):
        reduced = tensor_model_parallel_all_reduce(x * 2)
        norm, residual = vllm.ir.ops.fused_add_rms_norm(reduced, residual, weight, 1e-6)
        return norm, residual

    def layer_norm_only(x, residual, weight):
        reduced = tensor_model_parallel_all_reduce(x)
        return vllm.ir.ops.fused_add_rms_norm(reduced, residual, weight, 1e-5)[0]

    def operands(tokens, hidden, weight_dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(11)
        xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(n)]
        residual = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        weight = (torch.rand(hidden, generator=g) + 0.5).to(weight_dtype)
        return xs[rank], residual, weight

    def rewrite(fn, *args, pass_=None):
        gm = make_fx(fn, tracing_mode="fake")(*args)
        pass_ = pass_ or vllm_fusion.TparAllReduceFusionPass()
        pass_(gm.graph)
        gm.recompile()
        targets = {str(node.target) for node in gm.graph.nodes if node.op == "call_function"}
        vllm_ops = sorted(t for t in targets if t.startswith(("vllm.all_reduce", "vllm_ir.")))
        tpar_ops = sorted(t for t in targets if t.startswith("tpar."))
        return gm, getattr(pass_, "matched_count", None), vllm_ops, tpar_ops

    def digest(*tensors):
        return hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)).hexdigest()[:16]

    def run_counted(fn, *args):
        fused_calls.clear()
        device.calls = 0
        out = fn(*args)
        return out, len(fused_calls), device.calls

    def ulp_close(a, b):
        # Two bf16 roundings: y is rounded twice (v * inv, then * weight), so a last-bit
        # difference in v or inv may move y by up to two units in the last place.
        return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -6).all())

    scenario = os.environ["SCENARIO"]
    if scenario == "fuse":
        x, residual, weight = operands(4, 96)
        gm, matched, vllm_ops, tpar_ops = rewrite(layer, x, residual, weight)
        print("REWRITE", matched, vllm_ops, tpar_ops, flush=True)
        (want_norm, want_res), fused, via_vllm = run_counted(layer, x, residual, weight)
        print("UNFUSED CALLS", fused, via_vllm, flush=True)
        (norm, res), fused, via_vllm = run_counted(gm, x, residual, weight)
        print("FUSED CALLS", fused, via_vllm, flush=True)
        print("RESIDUAL BITWISE", torch.equal(res, want_res), flush=True)
        print("NORM WITHIN TWO ROUNDINGS", ulp_close(norm, want_norm), flush=True)
        direct_norm, direct_res = real_fused(x * 2, residual, weight, 1e-6, in_place=False)
        print("AS TPAR'S OP", torch.equal(norm, direct_norm) and torch.equal(res, direct_res), flush=True)
        print("DIGEST", digest(norm, res), flush=True)
        gm, matched, vllm_ops, tpar_ops = rewrite(layer_norm_only, x, residual, weight)
        print("NORM ONLY REWRITE", matched, vllm_ops, tpar_ops, flush=True)
        (norm_only), fused, via_vllm = run_counted(gm, x, residual, weight)
        print("NORM ONLY CALLS", fused, via_vllm, ulp_close(norm_only, layer_norm_only(x, residual, weight)), flush=True)
        # Inductor's own post-grad hook, the one vLLM fills with its pass manager.
        import torch._inductor.config as inductor_config
        inductor_pass = vllm_fusion.TparAllReduceFusionPass()
        def layer_eps5(x, residual, weight):
            return vllm.ir.ops.fused_add_rms_norm(tensor_model_parallel_all_reduce(x), residual, weight, 1e-5)
        with inductor_config.patch(post_grad_custom_post_pass=inductor_pass, force_disable_caches=True):
            compiled = torch.compile(layer_eps5, backend="inductor", fullgraph=True, dynamic=False)
            (norm, res), fused, via_vllm = run_counted(compiled, x, residual, weight)
        want_norm, want_res = layer_eps5(x, residual, weight)
        print("INDUCTOR", inductor_pass.matched_count, fused, via_vllm, torch.equal(res, want_res),
              ulp_close(norm, want_norm), flush=True)
        # vllm serve's JSON route: CompilationConfig resolves "tpar.vllm_fusion_pass" with the
        # statement below (test_pass_by_name checks vLLM still has it) and wraps it.
        from vllm.compilation.passes.inductor_pass import CallableInductorPass
        names = "tpar.vllm_fusion_pass".split(".")
        module, func_name = ".".join(names[:-1]), names[-1]
        func = __import__(module).__dict__[func_name]
        gm, _, vllm_ops, tpar_ops = rewrite(layer, x, residual, weight, pass_=CallableInductorPass(func))
        (norm, res), fused, via_vllm = run_counted(gm, x, residual, weight)
        print("BY NAME", vllm_ops, tpar_ops, fused, via_vllm, flush=True)
        # A Gemma-style fp32 weight beside bf16 activations: vLLM's extra_check, not matched.
        x, residual, weight = operands(4, 96, torch.float32)
        print("GEMMA WEIGHT REWRITE", rewrite(layer, x, residual, weight)[1], flush=True)
    elif scenario == "fallback":
        # 64 x 96 bf16 = 12 KiB, over the 8 KiB max_size: should_custom_ar says no.
        x, residual, weight = operands(64, 96)
        gm, matched, _, _ = rewrite(layer, x, residual, weight)
        (want_norm, want_res), _, _ = run_counted(layer, x, residual, weight)
        (norm, res), fused, via_vllm = run_counted(gm, x, residual, weight)
        print("DECLINED", matched, fused, via_vllm, torch.equal(norm, want_norm) and torch.equal(res, want_res), flush=True)
        # A fused call that raises: vLLM's path, bitwise, and one warning.
        x, residual, weight = operands(4, 96)
        gm, matched, _, _ = rewrite(layer, x, residual, weight)
        (want_norm, want_res), _, _ = run_counted(layer, x, residual, weight)
        def refuse(*args, **kwargs):
            fused_calls.append(1)
            raise tpar.TparError("refused (test)")
        ca.comm.fused_add_rms_norm = refuse
        for _ in range(2):  # counted: the second call; warned: once
            (norm, res), fused, via_vllm = run_counted(gm, x, residual, weight)
        print("RAISED", matched, fused, via_vllm, torch.equal(norm, want_norm) and torch.equal(res, want_res), flush=True)
        # A TP group whose custom allreduce is not tpar's: nothing rewritten.
        device.ca_comm = None
        print("NOT TPAR REWRITE", rewrite(layer, x, residual, weight)[1], flush=True)
    ca.close()
    # As an engine shuts down (test_engines_sglang_fusion.py's worker aborted at exit one run in
    # about twelve without it: gloo's threads still up).
    dist.destroy_process_group()
    """
)


def _run(vllm_path, scenario, max_size=8 << 20):
    env = {"SCENARIO": scenario, "MAX_SIZE": str(max_size)}
    return run_python_ranks(2, WORKER, timeout=600, env=env, path=[vllm_path])


class _SelfEpsilon(ast.NodeTransformer):
    """vLLM's pattern reads ``self.epsilon``; tpar's closes over ``epsilon``."""

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr == "epsilon":
            return ast.Name(id="epsilon", ctx=node.ctx)
        return self.generic_visit(node)


def _pattern_body(tree: ast.Module, class_name: str | None) -> str:
    """The body of the ``pattern`` function (vLLM's: nested in ``<class_name>.register``)."""
    scope = tree
    if class_name is not None:
        (scope,) = [
            n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name
        ]
    bodies = [
        ast.dump(ast.Module(body=n.body, type_ignores=[]))
        for n in ast.walk(scope)
        if isinstance(n, ast.FunctionDef) and n.name == "pattern"
    ]
    assert len(bodies) == 1, (
        f"expected one pattern function in {class_name or 'tpar'}, found {len(bodies)}"
    )
    return bodies[0]


def test_tpars_pattern_is_vllms_allreduce_fused_add_rms_norm_pattern(vllm_path):
    vllm_tree = _SelfEpsilon().visit(ast.parse(pathlib.Path(vllm_path, VLLM_FUSION).read_text()))
    tpar_tree = ast.parse(TPAR_PASS.read_text())
    assert _pattern_body(tpar_tree, None) == _pattern_body(
        vllm_tree, "AllReduceFusedAddRMSNormPattern"
    ), (
        "vLLM's AllReduceFusedAddRMSNormPattern matches something else now: re-read allreduce_rms_fusion.py"
    )
    register = pathlib.Path(vllm_path, VLLM_FUSION).read_text()
    assert "for epsilon in [1e-5, 1e-6]:" in register and "first_return_only" in register
    backends = pathlib.Path(vllm_path, VLLM_BACKENDS).read_text()
    assert (
        "self.pass_manager.add(\n                    self.compilation_config.inductor_compile_config[self.pass_key]"
        in backends
    ), (
        "vLLM no longer adds inductor_compile_config['post_grad_custom_post_pass'] to its pass manager"
    )


def test_pass_by_name_is_resolved_the_way_vllm_resolves_it(vllm_path):
    """``"tpar.vllm_fusion_pass"`` in ``inductor_passes``: vLLM imports the name's module and
    looks the function up in the TOP-LEVEL package's namespace (``__import__`` returns it), which
    is why the entry lives in ``tpar`` itself; the worker test resolves it the same way."""
    compilation = pathlib.Path(vllm_path, "vllm/config/compilation.py").read_text()
    assert "func = __import__(module).__dict__[func_name]" in compilation
    assert "func if isinstance(func, InductorPass) else CallableInductorPass(func)" in compilation


def test_compilation_config_puts_the_pass_in_vllms_hook(vllm_path):
    code = textwrap.dedent(
        """
        import pickle
        from vllm.compilation.passes.inductor_pass import InductorPass
        from tpar.engines import vllm_fusion
        config = vllm_fusion.compilation_config({"mode": 3, "inductor_compile_config": {"max_autotune": False}})
        pass_ = config["inductor_compile_config"]["post_grad_custom_post_pass"]
        print("CONFIG", config["mode"], config["inductor_compile_config"]["max_autotune"], type(pass_).__name__,
              isinstance(pass_, InductorPass), config["pass_config"])
        kept = vllm_fusion.compilation_config({"pass_config": {"fuse_allreduce_rms": True, "eliminate_noops": True}})
        print("KEPT", kept["pass_config"])
        copy = pickle.loads(pickle.dumps(pass_))
        print("PICKLE", type(copy).__name__, copy.uuid() == pass_.uuid(), len(pass_.uuid()))
        try:
            vllm_fusion.compilation_config({"inductor_compile_config": {"post_grad_custom_post_pass": print}})
        except ValueError as error:
            print("REFUSED", str(error).split(";")[0])
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [vllm_path] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert (
        lines[0] == "CONFIG 3 False TparAllReduceFusionPass True {'fuse_allreduce_rms': False}"
    ), lines
    assert lines[1] == "KEPT {'fuse_allreduce_rms': True, 'eliminate_noops': True}", lines
    assert lines[2] == "PICKLE TparAllReduceFusionPass True 64", lines
    assert lines[3].startswith(
        "REFUSED inductor_compile_config['post_grad_custom_post_pass'] already holds"
    ), lines


def test_the_pass_rewrites_vllms_allreduce_and_norm_into_tpars_fused_op(vllm_path):
    outputs = _run(vllm_path, "fuse")
    digests = set()
    for lines, err in outputs:
        assert ("REWRITE 1 [] ['tpar.vllm_all_reduce_fused_add_rms_norm.default']") in lines, (
            "\n".join(lines) + err[-3000:]
        )
        assert "UNFUSED CALLS 0 1" in lines, "\n".join(
            lines
        )  # the plain graph: vLLM's allreduce, no fused op
        assert "FUSED CALLS 1 0" in lines, "\n".join(
            lines
        )  # the rewritten one: tpar's fused op, no vLLM allreduce
        assert "RESIDUAL BITWISE True" in lines, "\n".join(lines)
        assert "NORM WITHIN TWO ROUNDINGS True" in lines, "\n".join(lines)
        assert "AS TPAR'S OP True" in lines, "\n".join(lines)
        assert (
            "NORM ONLY REWRITE 1 [] ['tpar.vllm_all_reduce_fused_add_rms_norm.default']" in lines
        ), "\n".join(lines)
        assert "NORM ONLY CALLS 1 0 True" in lines, "\n".join(lines)
        assert "INDUCTOR 1 1 0 True True" in lines, "\n".join(lines)
        assert "BY NAME [] ['tpar.vllm_all_reduce_fused_add_rms_norm.default'] 1 0" in lines, (
            "\n".join(lines)
        )
        assert "GEMMA WEIGHT REWRITE 0" in lines, "\n".join(lines)
        digests |= {line for line in lines if line.startswith("DIGEST")}
    assert len(digests) == 1, f"the ranks got different bits: {digests}"


def test_the_rewritten_graph_falls_back_to_vllms_sequence(vllm_path):
    for lines, err in _run(vllm_path, "fallback", max_size=8 << 10):
        # matched, tpar fused calls, vLLM allreduce calls, bitwise equal to the unfused graph
        assert "DECLINED 1 0 1 True" in lines, "\n".join(lines) + err[-3000:]
        assert "RAISED 1 1 1 True" in lines, "\n".join(lines) + err[-3000:]
        assert (
            err.count(
                "tpar's fused allreduce + RMSNorm failed on group tp:0 (TparError: refused (test))"
            )
            == 1
        ), err[-3000:]
        assert "NOT TPAR REWRITE 0" in lines, "\n".join(lines)
        assert "tpar's vLLM fusion pass rewrites nothing" in err, err[-3000:]
