"""One rank of test_cuda_sglang_fusion.py, run as a script: SGLang's CUDA fused allreduce +
residual + RMSNorm entry landing in tpar's fused kernel. The rank loads tpar's plugin with SGLang
0.5.23's own loader, builds SGLang's own ``GroupCoordinator`` for "tp" (its custom allreduce is
then tpar's on the GPU) and publishes it as the TP and attention-TP group in SGLang's
``runtime_context``. The GPU machine has no SGLang CUDA build (sgl_kernel, transformers):
``flashinfer_comm_fusion``, ``parallel_state``, ``runtime_context`` and ``dp_attention`` are
SGLang's own modules from its sources, and the layer code on the fused path (``add_norm``'s gate,
``fusions/allreduce.py``'s ``fused_ffn_input``, ``layernorm._forward_with_allreduce_fusion``) is
SGLang's source cut out of the same files by tests/python/sglang_fusion_standin.py, with the
platform flags of a GPU that FlashInfer's fusion does not take. The norm module is a stand-in
with sgl_kernel's ``fused_add_rmsnorm`` semantics in torch (used only where tpar declines).

Per case, as SGLang calls it (``fused_ffn_input(plan, x, residual, batch)`` -> SGLang's gate ->
``norm.forward_with_allreduce_fusion`` -> ``flashinfer_allreduce_residual_rmsnorm``): the calls
of tpar's op and of SGLang's allreduce and norm, tpar's fused decision, the results against an
fp32 reference, the inputs, a digest to compare ranks; then the same call captured in a CUDA
graph inside SGLang's ``graph_capture`` and replayed with new data; and one call tpar declines
(an fp32 weight beside bf16, as Gemma's gamma). Prints ``REPORT {json}`` (the test judges).

Environment: RANK, WORLD_SIZE, STORE, CASES, REPLAYS, PER_GPU ("1": rank r on GPU r),
SGLANG_ROOT (SGLang's sources, also on PYTHONPATH with tests/python for the stand-in).
"""

# The imports follow the engine's own set-up (platform patches, the plugin loader, the
# process group), so they cannot all sit at the top.
# ruff: noqa: E402
# isort: skip_file
import hashlib
import json
import os
import sys
import torch
import torch.distributed as dist

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
dist.init_process_group(
    "gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n
)
from sglang_group import tp_group
from sglang.srt.runtime_context import get_parallel
import sglang.srt.layers.flashinfer_comm_fusion as fcf
import sglang.srt.layers.layer_boundary.fusions.allreduce as fusions
import sglang.srt.layers.layernorm  # noqa: F401
import tpar.ops
from tpar.engines import TparCustomAllreduce

group = tp_group(n, gpu)
ca = group.ca_comm
report = {
    "rank": rank,
    "device": str(device),
    "class": type(ca).__name__,
    "entry_is_tpar": bool(getattr(fcf.flashinfer_allreduce_residual_rmsnorm, "_tpar", False)),
    "gate_is_tpar": bool(getattr(fusions.flashinfer_ar_fusion_applies, "_tpar", False)),
}
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
    near = bool(((norm.float() - want_norm).abs() <= want_norm.abs() * 2.0**-6 + 1e-6).all())
    return {"residual_bitwise": bool(torch.equal(residual_out, want_residual)), "norm_ok": near}


def digest(*tensors):
    return hashlib.sha256(
        b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors)
    ).hexdigest()[:16]


rows = []
with get_parallel().override(
    tp_group=group,
    attn_tp_group=group,
    tp_size=n,
    attn_tp_size=n,
    tp_rank=rank,
    attn_tp_rank=rank,
    moe_ep_size=1,
    moe_tp_size=n,
):
    gate = fusions.flashinfer_ar_fusion_applies
    report["gate"] = {"sglang": bool(gate.engine_original(8)), "tpar": bool(gate(8))}
    for tokens, hidden in json.loads(os.environ["CASES"]):
        row = {"tokens": tokens, "hidden": hidden}
        algorithm, fused, reason = ca.comm.fused_plan(tokens, hidden, "bf16", False)
        row["decision"] = f"{algorithm}{' fused' if fused else ' + separate norm'}"
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
        row.update(
            tpar_calls=counts["tpar"],
            sglang_allreduces=counts["sglang_ar"],
            norm_forwards=norm_module.forward_calls,
            inputs_unchanged=bool(torch.equal(x, xs[rank]) and torch.equal(residual, res_in)),
            digest=digest(norm, residual_out),
            **checks(norm, residual_out, xs, res_in, weight),
        )
        # The same call captured in a CUDA graph inside SGLang's graph_capture, replayed.
        try:
            algorithm, fused, reason = ca.comm.fused_plan(tokens, hidden, "bf16", True)
            row["graph_decision"] = f"{algorithm}{' fused' if fused else ' + separate norm'}"
            sx, sres = xs[rank].clone(), res_in.clone()
            graph = torch.cuda.CUDAGraph()
            counts.update(tpar=0, sglang_ar=0)
            with group.graph_capture() as context:
                fusions.fused_ffn_input(
                    plan, sx.clone(), sres.clone(), None
                )  # warm-up on the capture stream
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=context.stream):
                    gnorm, gres = fusions.fused_ffn_input(plan, sx, sres, None)
            row["graph_tpar_calls"] = counts["tpar"]
            ok = True
            for replay in range(int(os.environ["REPLAYS"])):
                gxs, gresidual, _ = operands(
                    tokens, hidden, seed=7919 * (replay + 1) + tokens + hidden
                )
                sx.copy_(gxs[rank])
                sres.copy_(gresidual)
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
    norm, residual_out = fusions.fused_ffn_input(
        standin.PlanStandIn(norm_module), x, residual, None
    )
    torch.cuda.synchronize()
    report["decline"] = {
        "tpar_calls": counts["tpar"],
        "sglang_allreduces": counts["sglang_ar"],
        "norm_forwards": norm_module.forward_calls,
        "digest": digest(norm, residual_out),
        **checks(norm, residual_out, xs, res_in, weight),
    }
report["rows"] = rows
print("REPORT " + json.dumps(report), flush=True)
ca.close()
# As an engine shuts down: gloo's threads still up at interpreter exit aborted a CPU worker
# like this one in about one run of twelve (test_engines_sglang_fusion.py).
dist.destroy_process_group()
