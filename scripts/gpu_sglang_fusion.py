"""SGLang's CUDA fused allreduce + residual + RMSNorm entry landing in tpar's fused kernel, on a GPU.

Two ranks as processes sharing GPU 0 (``--per-gpu``: rank r on GPU r), bf16, hidden 8192 and
5120, 1 and 8 tokens. Each rank loads tpar's plugin with SGLang 0.5.23's own loader, builds
SGLang's own ``GroupCoordinator`` for "tp" (its custom allreduce is then tpar's on the GPU) and
publishes it as the TP and attention-TP group in SGLang's ``runtime_context``. The device machine
has no SGLang CUDA build (sgl_kernel, transformers): ``flashinfer_comm_fusion``,
``parallel_state``, ``runtime_context`` and ``dp_attention`` are SGLang's own modules from its
sources, and the layer code on the fused path (``add_norm``'s gate, ``fusions/allreduce.py``'s
``fused_ffn_input``, ``layernorm._forward_with_allreduce_fusion``) is SGLang's source cut out of
the same files by tests/python/sglang_fusion_standin.py, with the platform flags of a GPU that
FlashInfer's fusion does not take (no FlashInfer here either). The norm module is a stand-in with
sgl_kernel's ``fused_add_rmsnorm`` semantics in torch (used only where tpar declines).

Per case, as SGLang calls it (``fused_ffn_input(plan, x, residual, batch)`` -> SGLang's gate ->
``norm.forward_with_allreduce_fusion`` -> ``flashinfer_allreduce_residual_rmsnorm``), checked:
SGLang's own gate says no and tpar's yes; one call of ``tpar.ops.fused_add_rms_norm`` and none
of SGLang's allreduce or norm; tpar's plan runs it in the fused kernel (``fused_plan``);
``residual_out`` bitwise the fp32 sum rounded once plus the residual rounded once, the norm
within two bf16 roundings of torch's fp32 reference; the inputs unchanged; both ranks the same
bits; then the same call captured in a CUDA graph inside SGLang's ``graph_capture`` and replayed
with new data three times, each checked the same way. One decline case (an fp32 weight beside
bf16, as Gemma's gamma) must run SGLang's allreduce + norm with the right result. Prints a table
last; JSON and per-rank logs in $OUT.

Set-up on the device machine (carry .ci/wheels from scripts/test.sh and .ci/engines-gpu from
scripts/engine_harness_bundle.sh: SGLang's sources and its cp312 imports)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .ci/wheels/tpar-*.whl
    python3 -m pip install -q --no-index --no-deps --target /tmp/sglang-site .ci/engines-gpu/deps/*.whl
    python3 -m zipfile -e .ci/engines-gpu/sglang-0.5.23-src.zip /tmp/sglang-src
    PYTHONPATH=/tmp/site:/tmp/sglang-site:/tmp/sglang-src CUDA_VISIBLE_DEVICES=0 \\
        python3 scripts/gpu_sglang_fusion.py --sglang /tmp/sglang-src
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = [(1, 8192), (8, 8192), (1, 5120), (8, 5120)]
REPLAYS = 3

WORKER = r"""
import hashlib, json, os, sys
import torch, torch.distributed as dist
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
gpu = rank % torch.cuda.device_count() if os.environ["PER_GPU"] == "1" else 0
torch.cuda.set_device(gpu)
device = torch.device("cuda", gpu)
# SGLang's FlashInfer PCIe-IPC allreduce would open NCCL during construction (NCCL refuses
# ranks sharing a GPU); it ranks after "ca" anyway.
os.environ.setdefault("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "0")
import sglang_fusion_standin as standin
standin.install(os.environ["SGLANG_ROOT"])
from sglang.srt.plugins import load_plugins
load_plugins()  # SGLang's own loader: tpar's entry point from the installed wheel
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)
from sglang.srt.distributed import parallel_state as ps
from sglang.srt.runtime_context import get_parallel
import sglang.srt.layers.flashinfer_comm_fusion as fcf
import sglang.srt.layers.layer_boundary.fusions.allreduce as fusions
import sglang.srt.layers.layernorm  # noqa: F401
import tpar.ops
from tpar.engines import TparCustomAllreduce

group = ps.GroupCoordinator([list(range(n))], gpu, "nccl", use_pynccl=False, use_mscclpp=False,
                            use_custom_allreduce=True, use_torch_symm_mem_all_reduce=False,
                            use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
ca = group.ca_comm
report = {"rank": rank, "device": str(device), "class": type(ca).__name__,
          "entry_is_tpar": bool(getattr(fcf.flashinfer_allreduce_residual_rmsnorm, "_tpar", False)),
          "gate_is_tpar": bool(getattr(fusions.flashinfer_ar_fusion_applies, "_tpar", False))}
if not isinstance(ca, TparCustomAllreduce) or ca.disabled:
    report["error"] = f"SGLang built {type(ca).__name__}, disabled={getattr(ca, 'disabled', None)}"
    print("REPORT " + json.dumps(report), flush=True)
    sys.exit(0)

counts = {"tpar": 0, "sglang_ar": 0}
real_fused = tpar.ops.fused_add_rms_norm
def counted_fused(*a, **k):
    counts["tpar"] += 1
    return real_fused(*a, **k)
tpar.ops.fused_add_rms_norm = counted_fused
real_ar = group.all_reduce
def counted_ar(x):
    counts["sglang_ar"] += 1
    return real_ar(x)
group.all_reduce = counted_ar

EPS = 1e-6
def operands(tokens, hidden, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    xs = [(torch.rand(tokens, hidden, generator=g) * 2 - 1).to(dtype).to(device) for _ in range(n)]
    residual = (torch.rand(tokens, hidden, generator=g) * 2 - 1).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype).to(device)
    return xs, residual, weight

def reference(xs, residual, weight):
    total = xs[0].float()
    for other in xs[1:]:
        total = total + other.float()
    residual_out = (total.to(xs[0].dtype).float() + residual.float()).to(residual.dtype)
    v = residual_out.float()
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS) * weight.float(), residual_out

def checks(norm, residual_out, xs, residual, weight):
    want_norm, want_residual = reference(xs, residual, weight)
    # Two bf16 roundings: the norm is rounded twice (v * inv, then * weight).
    near = bool(((norm.float() - want_norm).abs() <= want_norm.abs() * 2.0 ** -6 + 1e-6).all())
    return {"residual_bitwise": bool(torch.equal(residual_out, want_residual)), "norm_ok": near}

def digest(*tensors):
    return hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors)).hexdigest()[:16]

rows = []
with get_parallel().override(tp_group=group, attn_tp_group=group, tp_size=n, attn_tp_size=n, tp_rank=rank,
                             attn_tp_rank=rank, moe_ep_size=1, moe_tp_size=n):
    gate = fusions.flashinfer_ar_fusion_applies
    report["gate"] = {"sglang": bool(gate.engine_original(8)), "tpar": bool(gate(8))}
    for tokens, hidden in json.loads(os.environ["CASES"]):
        row = {"tokens": tokens, "hidden": hidden}
        algorithm, fused, reason = ca.comm.fused_plan(tokens, hidden, "bf16", False)
        row["plan"] = f"{algorithm}{' fused' if fused else ' + separate norm'}"
        xs, residual, weight = operands(tokens, hidden, seed=tokens * 100003 + hidden)
        norm_module = standin.RMSNormStandIn(weight, EPS)
        plan = standin.PlanStandIn(norm_module)
        x, res_in = xs[rank].clone(), residual.clone()
        counts.update(tpar=0, sglang_ar=0)
        out = fusions.fused_ffn_input(plan, x, residual, None)
        torch.cuda.synchronize()
        if out is None:
            row["error"] = "SGLang's boundary did not take the fused path (the gate said no)"
            rows.append(row)
            continue
        norm, residual_out = out
        row.update(tpar_calls=counts["tpar"], sglang_allreduces=counts["sglang_ar"], norm_forwards=norm_module.forward_calls,
                   inputs_unchanged=bool(torch.equal(x, xs[rank]) and torch.equal(residual, res_in)),
                   digest=digest(norm, residual_out), **checks(norm, residual_out, xs, res_in, weight))
        # The same call captured in a CUDA graph inside SGLang's graph_capture, replayed.
        try:
            algorithm, fused, reason = ca.comm.fused_plan(tokens, hidden, "bf16", True)
            row["graph_plan"] = f"{algorithm}{' fused' if fused else ' + separate norm'}"
            sx, sres = xs[rank].clone(), res_in.clone()
            graph = torch.cuda.CUDAGraph()
            counts.update(tpar=0, sglang_ar=0)
            with group.graph_capture() as context:
                fusions.fused_ffn_input(plan, sx.clone(), sres.clone(), None)  # warm-up on the capture stream
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=context.stream):
                    gnorm, gres = fusions.fused_ffn_input(plan, sx, sres, None)
            row["graph_tpar_calls"] = counts["tpar"]
            ok = True
            for replay in range(int(os.environ["REPLAYS"])):
                gxs, gresidual, _ = operands(tokens, hidden, seed=7919 * (replay + 1) + tokens + hidden)
                sx.copy_(gxs[rank]); sres.copy_(gresidual)
                dist.barrier(group=group.cpu_group)
                graph.replay()
                torch.cuda.synchronize()
                got = checks(gnorm, gres, gxs, gresidual, weight)
                ok = ok and got["residual_bitwise"] and got["norm_ok"]
                row[f"graph_digest_{replay}"] = digest(gnorm, gres)
            row["graph_ok"] = ok
            del graph
        except Exception as error:
            row["graph_error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
    # A call tpar declines (an fp32 weight beside bf16 activations, as Gemma's gamma): SGLang's
    # allreduce (on tpar, out of place) and its norm.
    xs, residual, weight = operands(1, 8192, seed=5)
    weight = weight.float()
    norm_module = standin.RMSNormStandIn(weight, EPS)
    counts.update(tpar=0, sglang_ar=0)
    x, res_in = xs[rank].clone(), residual.clone()
    norm, residual_out = fusions.fused_ffn_input(standin.PlanStandIn(norm_module), x, residual, None)
    torch.cuda.synchronize()
    report["decline"] = {"tpar_calls": counts["tpar"], "sglang_allreduces": counts["sglang_ar"],
                         "norm_forwards": norm_module.forward_calls, "digest": digest(norm, residual_out),
                         **checks(norm, residual_out, xs, res_in, weight)}
report["rows"] = rows
print("REPORT " + json.dumps(report), flush=True)
ca.close()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sglang",
        type=pathlib.Path,
        default=ROOT / ".ci" / "engines" / "sglang-0.5.23-unpacked",
        help="folder holding SGLang 0.5.23's sglang/srt sources",
    )
    parser.add_argument(
        "--per-gpu", action="store_true", help="rank r on GPU r (default: both ranks on GPU 0)"
    )
    parser.add_argument("--timeout", type=int, default=200)
    args = parser.parse_args()
    if not (args.sglang / "sglang" / "srt" / "layers" / "flashinfer_comm_fusion.py").is_file():
        print(
            f"error: no SGLang 0.5.23 sources under {args.sglang}; pass --sglang (the module doc says how to "
            "unpack .ci/engines-gpu/sglang-0.5.23-src.zip)"
        )
        return 2
    out = pathlib.Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ)
    base["PYTHONPATH"] = os.pathsep.join(
        [str(args.sglang), str(ROOT / "tests" / "python")]
        + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            **base,
            "WORLD_SIZE": "2",
            "CASES": json.dumps(CASES),
            "SGLANG_ROOT": str(args.sglang),
            "STORE": os.path.join(tmp, "store"),
            "PER_GPU": "1" if args.per_gpu else "0",
            "REPLAYS": str(REPLAYS),
        }
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**env, "RANK": str(r)},
            )
            for r in range(2)
        ]
        for r, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
            (out / f"sglang-fusion-rank{r}.log").write_text(stdout + "\n--- stderr\n" + stderr)
            lines = [line[7:] for line in stdout.splitlines() if line.startswith("REPORT ")]
            reports.append(json.loads(lines[0]) if p.returncode == 0 and lines else None)
            if reports[-1] is None:
                print(f"rank {r} failed (rc {p.returncode}):\n{stderr[-3000:]}")
    (out / "sglang-fusion.json").write_text(json.dumps(reports, indent=1))

    print(
        "\n== SGLang's CUDA fused allreduce + RMSNorm entry on tpar (2 ranks, bf16, "
        f"{'one GPU each' if args.per_gpu else 'sharing GPU 0'})"
    )
    if any(r is None for r in reports):
        print("FAILED: a rank did not report (see sglang-fusion-rank*.log)")
        return 1
    r0, r1 = reports
    failures = 0
    for report in reports:
        if "error" in report:
            print(f"rank {report['rank']}: {report['error']}")
            failures += 1
    if failures:
        return 1
    hooks = (
        r0["entry_is_tpar"] and r0["gate_is_tpar"] and r0["gate"] == {"sglang": False, "tpar": True}
    )
    print(
        f"hooks: entry tpar's {r0['entry_is_tpar']}, gate tpar's {r0['gate_is_tpar']}, "
        f"gate at 8 tokens SGLang {r0['gate']['sglang']} / tpar {r0['gate']['tpar']}: {'ok' if hooks else 'FAIL'}"
    )
    failures += not hooks
    mark = lambda b: "ok" if b else "FAIL"  # noqa: E731
    print(
        f"{'tokens x hidden':>16} {'plan (eager)':<22}{'tpar':>5}{'sgl AR':>7}{'residual':>9}{'norm':>6}"
        f"{'inputs':>7}{'ranks':>6} {'plan (graph)':<22}{'graph':>6}{'g-ranks':>8}"
    )
    for a, b in zip(r0["rows"], r1["rows"], strict=False):
        if "error" in a or "error" in b:
            print(f"{a['tokens']:>8} x {a['hidden']:<6} FAIL: {a.get('error') or b.get('error')}")
            failures += 1
            continue
        calls = (a["tpar_calls"], a["sglang_allreduces"], a["norm_forwards"]) == (1, 0, 0) and (
            b["tpar_calls"],
            b["sglang_allreduces"],
            b["norm_forwards"],
        ) == (1, 0, 0)
        in_kernel = a["plan"].endswith(" fused")
        residual = a["residual_bitwise"] and b["residual_bitwise"]
        norm = a["norm_ok"] and b["norm_ok"]
        inputs = a["inputs_unchanged"] and b["inputs_unchanged"]
        ranks = a["digest"] == b["digest"]
        graph = (
            a.get("graph_ok", False) and b.get("graph_ok", False) and a.get("graph_tpar_calls") == 2
        )
        graph_ranks = all(
            a.get(f"graph_digest_{i}") is not None
            and a.get(f"graph_digest_{i}") == b.get(f"graph_digest_{i}")
            for i in range(REPLAYS)
        )
        ok = [calls, in_kernel, residual, norm, inputs, ranks, graph, graph_ranks]
        failures += not all(ok)
        print(
            f"{a['tokens']:>8} x {a['hidden']:<6} {a['plan']:<22}{mark(calls):>5}{a['sglang_allreduces']:>7}"
            f"{mark(residual):>9}{mark(norm):>6}{mark(inputs):>7}{mark(ranks):>6} {a.get('graph_plan', '-'):<22}"
            f"{mark(graph) if 'graph_error' not in a else 'ERR':>6}{mark(graph_ranks):>8}"
        )
        if "graph_error" in a:
            print(f"   graph: {a['graph_error']}")
    d0, d1 = r0["decline"], r1["decline"]
    decline = (
        all(
            (d["tpar_calls"], d["sglang_allreduces"], d["norm_forwards"]) == (0, 1, 1)
            and d["residual_bitwise"]
            and d["norm_ok"]
            for d in (d0, d1)
        )
        and d0["digest"] == d1["digest"]
    )
    print(
        f"decline (fp32 weight, 1 x 8192): SGLang's allreduce + norm, right result, ranks equal: {mark(decline)}"
    )
    failures += not decline
    print(f"sglang-fusion: {'passed' if failures == 0 else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
