"""tpar's vLLM fusion pass (``tpar.engines.vllm_fusion``) on GPUs, for the device machine.

Two ranks (one GPU each where there are two, else both on GPU 0), each with vLLM 0.33.0's own
``GroupCoordinator`` and IR ops on a gloo group and a ``TparCustomAllreduce`` on its GPU as the
TP group's custom allreduce (vLLM's ``CudaCommunicator`` itself needs ``vllm.config``, whose
imports are not on the device machine: a stand-in with its routing holds it, as in
tests/python/test_engines_vllm_fusion.py). Per case (bf16, tokens x hidden): a layer calling
``tensor_model_parallel_all_reduce`` + ``vllm.ir.ops.fused_add_rms_norm`` is traced and
rewritten by the pass, and torch.compile'd with Inductor and the pass in its
``post_grad_custom_post_pass`` hook; checked: the pattern matched, the rewritten graph called
tpar's fused op and not vLLM's allreduce, ``residual_out`` bitwise the unfused graph's, the norm
within two bf16 roundings, both ranks the same bits, a CUDA graph of the rewritten layer
replayed gives the eager bits, and a message over tpar's max_size falls back to vLLM's sequence
bitwise. Prints a table last; JSON in $OUT/vllm-fusion.json.

On the dev machine, ``--bundle .ci/vllm-gpu`` writes what the device machine needs besides the
tpar wheel: vllm-src.zip (vLLM's Python files, from .ci/engines/vllm-0.33.0-py) and deps/ (the
cp312 wheels of .ci/engines-gpu/deps and of ``regex``, which vLLM's IR imports); about 40 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASES = [(1, 8192), (8, 8192), (64, 4096), (5, 5120)]

WORKER = r"""
import hashlib, json, os, sys
import torch, torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
gpu = rank % torch.cuda.device_count()
torch.cuda.set_device(gpu)
dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)
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

group = ps.GroupCoordinator([list(range(n))], rank, "gloo", use_device_communicator=False, group_name="tp")
group.use_custom_op_call = True
ps._TP = group
ca = TparCustomAllreduce(group.cpu_group, torch.device("cuda", gpu), max_size=int(os.environ["MAX_SIZE"]))
assert not ca.disabled, "tpar did not open on this group"
device = group.device_communicator = DeviceCommunicator(ca, group.device_group)
fused_calls = []
real = ca.comm.fused_add_rms_norm
ca.comm.fused_add_rms_norm = lambda *a, **k: fused_calls.append(1) or real(*a, **k)

def layer(x, residual, weight):
    reduced = tensor_model_parallel_all_reduce(x)
    return vllm.ir.ops.fused_add_rms_norm(reduced, residual, weight, 1e-6)

def counted(fn, *args):
    fused_calls.clear(); device.calls = 0
    out = fn(*args); torch.cuda.synchronize()
    return out, len(fused_calls), device.calls

def close2(a, b):
    return bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -6).all())

def digest(*ts):
    return hashlib.sha256(b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in ts)).hexdigest()[:16]

rows = []
for tokens, hidden in json.loads(os.environ["CASES"]):
    g = torch.Generator().manual_seed(tokens * 7 + hidden)
    xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(n)]
    residual = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16).cuda()
    x = xs[rank].cuda()
    row = {"tokens": tokens, "hidden": hidden, "bytes": tokens * hidden * 2}
    gm = make_fx(layer, tracing_mode="fake")(x, residual, weight)
    p = vllm_fusion.TparAllReduceFusionPass(); p(gm.graph); gm.recompile()
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
    row["inductor"] = ip.matched_count == 1 and torch.equal(cn, norm) and torch.equal(cr, res) and (cf, cv) == (fused, via_vllm)
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
            graph.replay(); torch.cuda.synchronize()
            ok = ok and torch.equal(gn, norm) and torch.equal(gr, res)
        row["graph_replay"] = ok
    rows.append(row)
print("ROWS " + json.dumps(rows), flush=True)
ca.close()
"""


def bundle(target: pathlib.Path) -> None:
    """vllm-src.zip (every .py of vLLM 0.33.0, 13 MB) and deps/ (the cp312 wheels of
    .ci/engines-gpu/deps, plus regex) into ``target`` (run on the dev machine)."""
    source = ROOT / ".ci" / "engines" / "vllm-0.33.0-py"
    deps = target / "deps"
    deps.mkdir(parents=True, exist_ok=True)
    count = 0
    with zipfile.ZipFile(target / "vllm-src.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted((source / "vllm").rglob("*.py")):
            archive.write(path, str(path.relative_to(source)))
            count += 1
    for wheel in sorted((ROOT / ".ci" / "engines-gpu" / "deps").glob("*.whl")):
        shutil.copy(wheel, deps / wheel.name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--platform",
            "manylinux2014_x86_64",
            "-d",
            str(deps),
            "regex",
        ],
        check=True,
    )
    print(
        f"{count} vLLM files -> {target / 'vllm-src.zip'}; {len(list(deps.glob('*.whl')))} wheels in {deps}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--bundle", type=pathlib.Path, help="write the device machine's vLLM bundle here and stop"
    )
    parser.add_argument(
        "--vllm",
        type=pathlib.Path,
        default=ROOT / ".ci" / "vllm-gpu" / "vllm-src.zip",
        help="vLLM's sources: a folder or vllm-src.zip",
    )
    parser.add_argument("--timeout", type=int, default=150)
    args = parser.parse_args()
    if args.bundle:
        bundle(args.bundle)
        return 0
    out = pathlib.Path(os.environ.get("OUT", "."))
    with tempfile.TemporaryDirectory() as tmp:
        vllm_dir = args.vllm
        if vllm_dir.suffix == ".zip":
            zipfile.ZipFile(vllm_dir).extractall(os.path.join(tmp, "vllm-src"))
            vllm_dir = pathlib.Path(tmp, "vllm-src")
        base = dict(os.environ)
        base["PYTHONPATH"] = os.pathsep.join(
            [str(vllm_dir)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        results = {}
        for label, max_size in (("tpar", 8 << 20), ("over-max-size", 4 << 10)):
            cases = CASES if label == "tpar" else CASES[:1]
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", WORKER],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env={
                        **base,
                        "RANK": str(r),
                        "WORLD_SIZE": "2",
                        "MAX_SIZE": str(max_size),
                        "CASES": json.dumps(cases),
                        "STORE": os.path.join(tmp, f"store-{label}"),
                        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, f"inductor-{label}-{r}"),
                    },
                )
                for r in range(2)
            ]
            ranks = []
            for r, p in enumerate(procs):
                try:
                    stdout, stderr = p.communicate(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    stdout, stderr = p.communicate()
                (out / f"vllm-fusion-{label}-rank{r}.log").write_text(
                    stdout + "\n--- stderr\n" + stderr
                )
                rows = [line[5:] for line in stdout.splitlines() if line.startswith("ROWS ")]
                ranks.append(json.loads(rows[0]) if p.returncode == 0 and rows else None)
                if ranks[-1] is None:
                    print(f"{label} rank {r} failed (rc {p.returncode}):\n{stderr[-3000:]}")
            results[label] = ranks
    (out / "vllm-fusion.json").write_text(json.dumps(results, indent=1))
    failures = 0
    print("\n== vLLM fusion pass on GPUs (2 ranks, bf16)")
    print(
        f"{'run':<14}{'tokens x hidden':>16} {'path':<9}{'matched':>8}{'fused':>6}{'vllm AR':>8} "
        f"{'residual':>9}{'norm':>6}{'ranks':>6}{'inductor':>9}{'graph':>6}"
    )
    for label, ranks in results.items():
        if any(r is None for r in ranks):
            print(f"{label:<14} FAILED (see vllm-fusion-{label}-rank*.log)")
            failures += 1
            continue
        for row0, row1 in zip(*ranks, strict=False):
            want_fused = (1, 0) if row0["path"] == "tpar" else (0, 1)
            ok = [
                row0["matched"] == 1 and row1["matched"] == 1,
                (row0["fused_calls"], row0["vllm_allreduces"]) == want_fused,
                row0["residual_bitwise"] and row1["residual_bitwise"],
                row0["norm_ok"] and row1["norm_ok"],
                row0["digest"] == row1["digest"],
                row0["inductor"] and row1["inductor"],
                row0.get("graph_replay", True) and row1.get("graph_replay", True),
            ]
            failures += not all(ok)
            mark = lambda b: "ok" if b else "FAIL"  # noqa: E731
            print(
                f"{label:<14}{row0['tokens']:>8} x {row0['hidden']:<6} {row0['path']:<9}{mark(ok[0]):>8}"
                f"{mark(ok[1]):>6}{row0['vllm_allreduces']:>8} {mark(ok[2]):>9}{mark(ok[3]):>6}{mark(ok[4]):>6}"
                f"{mark(ok[5]):>9}{mark(ok[6]) if 'graph_replay' in row0 else '-':>6}"
            )
    print(f"vllm-fusion: {'passed' if failures == 0 else f'{failures} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
