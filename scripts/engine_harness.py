#!/usr/bin/env python3
"""Replays vLLM's (0.33) and SGLang's (0.5.23) calling sequence for their custom allreduce
against tpar.engines on GPUs, without the engines installed (the device has no network).

Per rank, in the engines' order:
1. torch.distributed world, the group's CPU (gloo) group and its device (NCCL) group, as
   ``GroupCoordinator`` builds them;
2. the class the vLLM plugin swaps in (``plugins._swap_vllm`` on a stand-in module), built
   exactly as ``CudaCommunicator`` builds it: ``CustomAllreduce(group=cpu_group, device=...,
   symm_mem_enabled=False, register_graph_buffers=True)``; free device memory is read around it;
3. every call through a registered out-of-place custom op (as vLLM's ``all_reduce`` op and
   SGLang's ``outplace_all_reduce`` are), whose input must come back unchanged: ``if not
   ca.disabled and ca.should_custom_ar(x): ca.custom_all_reduce(x)`` else the engine's fallback;
4. warm-up of every size outside capture, then the engines' ``graph_capture``: ``with
   ca.capture():`` around a side stream, warm-up inside it, one CUDA graph of all sizes, and
   replays with new data in the static inputs.

The fallback for sizes tpar leaves to the engine is torch's own NCCL group when each rank has
its own GPU. NCCL refuses two ranks on one GPU, so where ranks share a GPU the fallback is a
gloo allreduce of a CPU copy, eager only (a size routed there is left out of the graph and
reported so). Inputs are small integers, exact in every dtype, so every result is checked
bitwise against the known sum.

``python3 scripts/engine_harness.py --tp 2 4 --out DIR`` launches the ranks (rank r on GPU
r % visible GPUs), writes DIR/engines-tp<N>.json and prints a table last.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# (dtype, elements): from a decode step's few KiB to the engines' 8 MiB max_size and over it.
CASES = [
    ("bfloat16", 512),
    ("bfloat16", 4096),
    ("float16", 16384),
    ("bfloat16", 65536),
    ("float32", 262144),
    ("bfloat16", 1 << 20),
    ("bfloat16", 4 << 20),
    ("bfloat16", 8 << 20),
]
REPLAYS = 10


class _NoGraph(Exception):
    """Nothing to capture (the CPU dry run)."""


def rank_main() -> None:
    import torch
    import torch.distributed as dist
    from tpar.engines import plugins

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # --cpu: a dry run of this script on tpar's CPU backend (no graph), for machines without a GPU.
    cpu = os.environ.get("HARNESS_CPU") == "1"
    gpus = 0 if cpu else torch.cuda.device_count()
    device = torch.device("cpu") if cpu else torch.device("cuda", rank % gpus)
    if not cpu:
        torch.cuda.set_device(device)
    shared = gpus < n
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    free = (lambda: 0) if cpu else (lambda: torch.cuda.mem_get_info(device)[0])
    dist.init_process_group(
        "gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n
    )
    ranks = list(range(n))
    cpu_group = dist.new_group(ranks, backend="gloo")
    device_group = None if shared else dist.new_group(ranks, backend="nccl")
    report = {
        "rank": rank,
        "world_size": n,
        "device": str(device),
        "shared_gpu": shared,
        "fallback": "gloo (CPU copy, eager only): NCCL refuses ranks sharing a GPU"
        if shared
        else "torch NCCL group",
    }

    stand_in = type(sys)("vllm.distributed.device_communicators.custom_all_reduce")

    class CustomAllreduce:  # what vLLM's module holds before the plugin
        pass

    stand_in.CustomAllreduce = CustomAllreduce
    plugins._swap_vllm(stand_in)
    sync()
    free_before = free()
    ca = stand_in.CustomAllreduce(
        group=cpu_group, device=device, symm_mem_enabled=False, register_graph_buffers=True
    )
    sync()
    report["free_bytes_taken"] = free_before - free()
    report["footprint"] = ca.memory_footprint()
    report["disabled"] = ca.disabled
    report["log_line"] = ca.describe() if not ca.disabled else None
    if ca.disabled:
        print(json.dumps(report), flush=True)
        return

    def fallback(x):
        out = x.clone()
        if device_group is not None:
            dist.all_reduce(out, group=device_group)
            return out
        host = out.float().cpu()
        dist.all_reduce(host, group=cpu_group)
        return host.to(x.dtype).to(x.device).clone()

    @torch.library.custom_op("tpar_harness::all_reduce", mutates_args=())
    def engine_all_reduce(x: torch.Tensor) -> torch.Tensor:
        if not ca.disabled and ca.should_custom_ar(x):
            out = ca.custom_all_reduce(x)
            assert out is not None, (
                "custom_all_reduce returned None after should_custom_ar said True"
            )
            return out
        return fallback(x)

    @engine_all_reduce.register_fake
    def _(x):
        return torch.empty_like(x)

    def values(r, count, dtype, seed):
        i = torch.arange(count, device=device, dtype=torch.int64)
        return ((i * 7 + r * 13 + seed * 5) % 17 - 8).to(dtype)

    def expected(count, dtype, seed):
        return sum(values(r, count, dtype, seed).float() for r in range(n)).to(dtype)

    routes, rows = [], []
    for dtype_name, count in CASES:
        dtype = getattr(torch, dtype_name)
        x = values(rank, count, dtype, 0)
        route = ca.should_custom_ar(x)
        name = ca._plan_name(count * x.element_size(), dtype, False) if route else "engine NCCL"
        routes.append(int(route))
        rows.append({"dtype": dtype_name, "bytes": count * x.element_size(), "route": name})
    everyone = [torch.zeros(len(routes), dtype=torch.int32) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(routes, dtype=torch.int32), group=cpu_group)
    report["routes_agree"] = all(torch.equal(e, everyone[0]) for e in everyone)

    # Eager warm-up and check, outside capture (the engines' dummy runs before capture).
    for row, (dtype_name, count) in zip(rows, CASES, strict=False):
        dtype = getattr(torch, dtype_name)
        x = values(rank, count, dtype, 1)
        before = x.clone()
        times = []
        for _ in range(3):
            sync()
            start = time.perf_counter()
            y = torch.ops.tpar_harness.all_reduce(x)
            sync()
            times.append((time.perf_counter() - start) * 1e6)
        row["eager_ok"] = bool(
            torch.equal(y, expected(count, dtype, 1))
            and torch.equal(x, before)
            and y.data_ptr() != x.data_ptr()
        )
        row["eager_us"] = round(sorted(times)[1], 1)

    # The engines' graph_capture: ca.capture() around a side stream; warm-up inside, then one
    # graph of every size it can hold, replayed with new data.
    in_graph = (
        [] if cpu else [i for i, r in enumerate(rows) if routes[i] or device_group is not None]
    )
    statics = {i: values(rank, CASES[i][1], getattr(torch, CASES[i][0]), 2) for i in in_graph}
    graph_error = None
    try:
        if not in_graph:
            raise _NoGraph
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with ca.capture():
            with torch.cuda.stream(stream):
                for i in in_graph:
                    torch.ops.tpar_harness.all_reduce(statics[i])
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, stream=stream):
                    outputs = {i: torch.ops.tpar_harness.all_reduce(statics[i]) for i in in_graph}
        for replay in range(REPLAYS):
            seed = 3 + replay
            for i in in_graph:
                statics[i].copy_(values(rank, CASES[i][1], getattr(torch, CASES[i][0]), seed))
            dist.barrier(group=cpu_group)
            graph.replay()
            torch.cuda.synchronize()
            for i in in_graph:
                ok = torch.equal(
                    outputs[i], expected(CASES[i][1], getattr(torch, CASES[i][0]), seed)
                )
                rows[i]["graph_ok"] = rows[i].get("graph_ok", True) and bool(ok)
        ca.comm.check()
    except _NoGraph:
        pass
    except Exception as error:  # reported in the table, not hidden
        graph_error = f"{type(error).__name__}: {error}"
    for i, row in enumerate(rows):
        row.setdefault("graph_ok", None if i not in in_graph else False)
    report["graph_error"] = graph_error
    report["rows"] = rows
    ca.close()
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


def sglang_rank_main() -> None:
    """SGLang 0.5.23's own code on the GPU: its plugin loader finds tpar's entry point, its
    GroupCoordinator builds the "tp" group, and its ``all_reduce`` (eager) and ``graph_capture``
    with a CUDA graph run every size. Sizes SGLang would hand to NCCL run only with one GPU per
    rank (NCCL refuses ranks sharing a GPU)."""
    import torch
    import torch.distributed as dist

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # SGLang's FlashInfer PCIe-IPC allreduce ranks after "ca" anyway; off, it opens no NCCL
    # during construction (NCCL refuses ranks sharing a GPU).
    os.environ.setdefault("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "0")
    gpus = torch.cuda.device_count()
    shared = gpus < n
    torch.cuda.set_device(rank % gpus)
    report = {
        "rank": rank,
        "world_size": n,
        "device": f"cuda:{rank % gpus}",
        "shared_gpu": shared,
        "fallback": "SGLang's own (torch NCCL group)"
        if not shared
        else "none: sizes over tpar's are left out",
    }
    from sglang.srt.plugins import load_plugins

    load_plugins()
    dist.init_process_group(
        "gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n
    )
    from sglang.srt.distributed import parallel_state as ps
    from tpar.engines import TparCustomAllreduce

    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    group = ps.GroupCoordinator(
        [list(range(n))],
        rank % gpus,
        "nccl",
        use_pynccl=False,
        use_mscclpp=False,
        use_custom_allreduce=True,
        use_torch_symm_mem_all_reduce=False,
        use_hpu_communicator=False,
        use_xpu_communicator=False,
        group_name="tp",
    )
    torch.cuda.synchronize()
    ca = group.ca_comm
    report["free_bytes_taken"] = free_before - torch.cuda.mem_get_info()[0]
    report["class"] = type(ca).__name__
    report["disabled"] = not isinstance(ca, TparCustomAllreduce) or ca.disabled
    if report["disabled"]:
        report["error"] = (
            f"SGLang built {type(ca).__name__}, disabled={getattr(ca, 'disabled', None)}"
        )
        print(json.dumps(report), flush=True)
        return
    report["footprint"] = ca.memory_footprint()
    report["log_line"] = ca.describe()
    calls = []
    real = ca.custom_all_reduce
    ca.custom_all_reduce = lambda x: calls.append(x.numel()) or real(x)
    device = torch.device("cuda", rank % gpus)

    def values(r, count, dtype, seed):
        i = torch.arange(count, device=device, dtype=torch.int64)
        return ((i * 7 + r * 13 + seed * 5) % 17 - 8).to(dtype)

    def expected(count, dtype, seed):
        return sum(values(r, count, dtype, seed).float() for r in range(n)).to(dtype)

    cases = [
        (d, c)
        for d, c in CASES
        if not shared or ca.should_custom_ar(values(rank, c, getattr(torch, d), 0))
    ]
    rows, routes = [], []
    for dtype_name, count in cases:
        dtype = getattr(torch, dtype_name)
        x = values(rank, count, dtype, 1)
        method = group._resolve_outplace_all_reduce_method(x)
        before = len(calls)
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            y = group.all_reduce(x.clone())
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e6)
        took = len(calls) - before
        routes.append(int(method == "ca"))
        rows.append(
            {
                "dtype": dtype_name,
                "bytes": count * x.element_size(),
                "route": f"ca (tpar x{took})"
                if method == "ca" and took == 3
                else f"{method} (tpar x{took})",
                "eager_ok": bool(torch.equal(y, expected(count, dtype, 1))),
                "eager_us": round(sorted(times)[1], 1),
            }
        )
    everyone = [torch.zeros(len(routes), dtype=torch.int32) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(routes, dtype=torch.int32), group=group.cpu_group)
    report["routes_agree"] = all(torch.equal(e, everyone[0]) for e in everyone)

    # The graph holds the sizes SGLang gives tpar: its table has torch.distributed (the NCCL
    # fallback without pynccl) disabled in graph mode.
    graphed = [i for i, routed in enumerate(routes) if routed]
    graph_error = None
    statics = [values(rank, cases[i][1], getattr(torch, cases[i][0]), 2) for i in graphed]
    try:
        graph = torch.cuda.CUDAGraph()
        with group.graph_capture() as context:
            for x in statics:
                group.all_reduce(x.clone())
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=context.stream):
                outputs = [group.all_reduce(x) for x in statics]
        for replay in range(REPLAYS):
            seed = 3 + replay
            for x, i in zip(statics, graphed, strict=False):
                x.copy_(values(rank, cases[i][1], getattr(torch, cases[i][0]), seed))
            dist.barrier(group=group.cpu_group)
            graph.replay()
            torch.cuda.synchronize()
            for out, i in zip(outputs, graphed, strict=False):
                ok = torch.equal(out, expected(cases[i][1], getattr(torch, cases[i][0]), seed))
                rows[i]["graph_ok"] = rows[i].get("graph_ok", True) and bool(ok)
    except Exception as error:
        graph_error = f"{type(error).__name__}: {error}"
    for i, row in enumerate(rows):
        row.setdefault("graph_ok", False if i in graphed else None)
    report["graph_error"] = graph_error
    report["rows"] = rows
    print(json.dumps(report), flush=True)


def launch(n: int, out: str, name: str = "engines", timeout: float = 100.0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = {
            k: v for k, v in os.environ.items() if k not in ("TPAR_RENDEZVOUS", "TPAR_JOB_TOKEN")
        }
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--rank"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={
                    **env,
                    "RANK": str(r),
                    "WORLD_SIZE": str(n),
                    "STORE": os.path.join(tmp, "store"),
                },
            )
            for r in range(n)
        ]
        results = []
        deadline = time.monotonic() + timeout
        for r, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
            with open(os.path.join(out, f"{name}-tp{n}-rank{r}.log"), "w") as log:
                log.write(stdout + "\n--- stderr\n" + stderr)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            results.append(
                json.loads(lines[-1])
                if lines
                else {
                    "rank": r,
                    "error": f"exit {p.returncode} (killed after {timeout:.0f} s if -9): {stderr[-400:]}",
                }
            )
    summary = {"world_size": n, "harness": name, "ranks": results}
    with open(os.path.join(out, f"{name}-tp{n}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def table(summaries) -> int:
    failures = 0
    for s in summaries:
        r0 = s["ranks"][0]
        print(
            f"== {s.get('harness', 'engines')} TP {s['world_size']}: {r0.get('device')} shared={r0.get('shared_gpu')} fallback={r0.get('fallback')}"
        )
        for r in s["ranks"]:
            if "error" in r or r.get("disabled"):
                failures += 1
                print(f"   rank {r['rank']}: {'DISABLED' if r.get('disabled') else r.get('error')}")
        if "rows" not in r0:
            continue
        print(f"   {r0['log_line']}")
        print(
            f"   drop in rank 0's GPU free memory around construction (every rank on that GPU): "
            f"{r0['free_bytes_taken']} B; memory_footprint: "
            f"{r0['footprint'].get('device_bytes')} device B; routes agree on all ranks: "
            f"{all(r.get('routes_agree') for r in s['ranks'])}; graph error: {r0['graph_error']}"
        )
        print(
            f"   {'dtype':9} {'bytes':>9} {'route':14} {'eager':6} {'graph':6} {'eager us (rank 0)':>18}"
        )
        for i, row in enumerate(r0["rows"]):
            eager = all(r.get("rows", [{}] * (i + 1))[i].get("eager_ok") for r in s["ranks"])
            graph = [r.get("rows", [{}] * (i + 1))[i].get("graph_ok") for r in s["ranks"]]
            graph_text = (
                "n/a" if all(g is None for g in graph) else ("ok" if all(graph) else "FAIL")
            )
            failures += int(not eager) + int(graph_text == "FAIL")
            print(
                f"   {row['dtype']:9} {row['bytes']:>9} {row['route']:14} {'ok' if eager else 'FAIL':6} "
                f"{graph_text:6} {row['eager_us']:>18}"
            )
        failures += int(not all(r.get("routes_agree") for r in s["ranks"])) + int(
            bool(r0["graph_error"])
        )
    print(
        f"engines harness: {'all checks passed' if failures == 0 else f'{failures} check(s) failed'}"
    )
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--timeout", type=float, default=100.0, help="seconds for all ranks of one TP size"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="dry run on tpar's CPU backend, no graph"
    )
    parser.add_argument(
        "--sglang",
        action="store_true",
        help="SGLang's own GroupCoordinator (needs its sources and imports on PYTHONPATH)",
    )
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cpu:
        os.environ["HARNESS_CPU"] = "1"
    if args.sglang:
        os.environ["HARNESS_SGLANG"] = "1"
    if args.rank:
        sglang_rank_main() if os.environ.get("HARNESS_SGLANG") == "1" else rank_main()
        return 0
    os.makedirs(args.out, exist_ok=True)
    return table(
        [launch(n, args.out, "sglang" if args.sglang else "engines", args.timeout) for n in args.tp]
    )


if __name__ == "__main__":
    sys.exit(main())
