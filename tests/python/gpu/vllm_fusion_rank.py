"""One rank of test_cuda_vllm_fusion.py, run as a script: vLLM 0.33.0's own ``GroupCoordinator``
and IR ops on a gloo group, a ``TparCustomAllreduce`` on this rank's GPU as the TP group's custom
allreduce (vLLM's ``CudaCommunicator`` itself needs ``vllm.config``, whose imports are not on the
GPU machine: a stand-in with its routing holds it, as in tests/python/test_engines_vllm_fusion.py).
Per case of CASES (bf16, tokens x hidden), a layer calling ``tensor_model_parallel_all_reduce``
+ ``vllm.ir.ops.fused_add_rms_norm`` is traced and rewritten by tpar's pass, and torch.compile'd
with Inductor and the pass in its ``post_grad_custom_post_pass`` hook; the rank prints what it
found per case as ``ROWS [json]`` (the test compares the ranks and judges).

Environment: RANK, WORLD_SIZE, STORE (torch.distributed's file store), MAX_SIZE (tpar's
max_size), CASES (JSON list of [tokens, hidden]); vLLM's sources on PYTHONPATH.
"""

# The imports follow the engine's own set-up (platform patches, the plugin loader, the
# process group), so they cannot all sit at the top.
# ruff: noqa: E402
# isort: skip_file
import hashlib
import json
import os
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# Each rank compiles into its own Inductor cache (TORCHINDUCTOR_CACHE_DIR is read when used).
os.environ["TORCHINDUCTOR_CACHE_DIR"] += f"-rank{rank}"
gpu = rank % torch.cuda.device_count()
torch.cuda.set_device(gpu)
dist.init_process_group(
    "gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n
)
# vLLM's ops register for its platform's dispatch key; without vLLM's compiled CUDA build the
# platform resolves to one that says "CPU", so its allreduce op had no CUDA kernel here
# (NotImplementedError on 1 H200, 2026-12-01). On a real CUDA install the key is "CUDA".
from vllm.platforms import current_platform

type(current_platform).dispatch_key = "CUDA"
import vllm.distributed.utils as vllm_utils

vllm_utils.get_cpu_distributed_timeout_or_none = lambda: None
vllm_utils.get_distributed_timeout_or_none = lambda: None
from vllm.distributed import parallel_state as ps, tensor_model_parallel_all_reduce
import vllm.ir.ops
import tpar.ops
from tpar.engines import TparCustomAllreduce
from tpar.engines import vllm_fusion
import torch._inductor.config as inductor_config


class DeviceCommunicator:  # CudaCommunicator.all_reduce's routing
    def __init__(self, ca_comm, device_group):
        self.ca_comm, self.device_group, self.calls = ca_comm, device_group, 0

    def all_reduce(self, x):
        self.calls += 1
        ca = self.ca_comm
        if ca is not None and not ca.disabled and ca.should_custom_ar(x):
            return ca.custom_all_reduce(x)
        out = x.to("cpu", copy=True)  # never the caller's tensor
        dist.all_reduce(out, group=self.device_group)
        return out.to(x.device)


group = ps.GroupCoordinator(
    [list(range(n))], rank, "gloo", use_device_communicator=False, group_name="tp"
)
group.use_custom_op_call = True
ps._TP = group
ca = TparCustomAllreduce(
    group.cpu_group, torch.device("cuda", gpu), max_size=int(os.environ["MAX_SIZE"])
)
assert not ca.disabled, "tpar did not open on this group"
device = group.device_communicator = DeviceCommunicator(ca, group.device_group)
fused_calls = []


class CountingNative:
    """The native communicator as tpar.ops sees it, counting the fused calls that reach it
    (torch.ops.tpar's kernels call the binding directly, not the Python Communicator)."""

    def __init__(self, native):
        self._native = native

    def fused_add_rms_norm(self, *a, **k):
        fused_calls.append(1)
        return self._native.fused_add_rms_norm(*a, **k)

    def __getattr__(self, name):
        return getattr(self._native, name)


real_native = tpar.ops._native
tpar.ops._native = lambda handle: CountingNative(real_native(handle))


def layer(x, residual, weight):
    reduced = tensor_model_parallel_all_reduce(x)
    return vllm.ir.ops.fused_add_rms_norm(reduced, residual, weight, 1e-6)


def counted(fn, *args):
    fused_calls.clear()
    device.calls = 0
    out = fn(*args)
    torch.cuda.synchronize()
    return out, len(fused_calls), device.calls


def close2(a, b):
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0**-6).all())


def digest(*ts):
    return hashlib.sha256(
        b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in ts)
    ).hexdigest()[:16]


rows = []
for tokens, hidden in json.loads(os.environ["CASES"]):
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(n)]
    residual = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16).cuda()
    x = xs[rank].cuda()
    row = {"tokens": tokens, "hidden": hidden, "bytes": tokens * hidden * 2}
    gm = make_fx(layer, tracing_mode="fake")(x, residual, weight)
    p = vllm_fusion.TparAllReduceFusionPass()
    p(gm.graph)
    gm.recompile()
    row["matched"] = p.matched_count
    (want_norm, want_res), _, _ = counted(layer, x, residual, weight)
    (norm, res), fused, via_vllm = counted(gm, x, residual, weight)
    big = tokens * hidden * 2 > ca.max_size
    row["path"] = "fallback" if big else "tpar"
    row["fused_calls"], row["vllm_allreduces"] = fused, via_vllm
    row["residual_bitwise"] = torch.equal(res, want_res)
    row["norm_ok"] = torch.equal(norm, want_norm) if big else close2(norm, want_norm)
    row["digest"] = digest(norm, res)
    ip = vllm_fusion.TparAllReduceFusionPass()
    with inductor_config.patch(post_grad_custom_post_pass=ip, force_disable_caches=True):
        compiled = torch.compile(layer, backend="inductor", fullgraph=True, dynamic=False)
        (cn, cr), cf, cv = counted(compiled, x, residual, weight)
    row["inductor"] = (
        ip.matched_count == 1
        and torch.equal(cn, norm)
        and torch.equal(cr, res)
        and (cf, cv) == (fused, via_vllm)
    )
    if not big:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            gm(x, residual, weight)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        with ca.capture():
            with torch.cuda.graph(graph):
                gn, gr = gm(x, residual, weight)
        ok = True
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            ok = ok and torch.equal(gn, norm) and torch.equal(gr, res)
        row["graph_replay"] = ok
    rows.append(row)
print("ROWS " + json.dumps(rows), flush=True)
ca.close()
# As an engine shuts down: gloo's threads still up at interpreter exit aborted a CPU worker
# like this one in about one run of twelve (test_engines_sglang_fusion.py).
dist.destroy_process_group()
