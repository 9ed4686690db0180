"""One rank replaying vLLM's (0.33) and SGLang's (0.5.23) calling sequence for their custom
allreduce against tpar.engines on GPUs, run by test_cuda_engine_sequence.py as a script (one
process per rank; `--sglang` for SGLang's own code). Prints `REPORT {json}` at the end.

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
gloo allreduce of a CPU copy, eager only (a size sent there is left out of the graph and
reported so). Inputs are small integers, exact in every dtype, so every result is checked
bitwise against the known sum.

With ``--sglang``, SGLang 0.5.23's own code (its sources and pure-Python imports on PYTHONPATH)
instead: its plugin loader finds tpar's entry point, its GroupCoordinator builds the "tp" group,
and its ``all_reduce`` (eager) and ``graph_capture`` with a CUDA graph run every size.
"""

import json
import os
import sys
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


def rank_main() -> None:
    import torch
    import torch.distributed as dist
    from tpar.engines import plugins

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", rank % gpus)
    torch.cuda.set_device(device)
    shared = gpus < n
    sync = torch.cuda.synchronize

    def free():
        return torch.cuda.mem_get_info(device)[0]

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
        print("REPORT " + json.dumps(report), flush=True)
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

    # Which sizes tpar takes (the rest go to the engine's fallback): every rank must agree.
    taken, rows = [], []
    for dtype_name, count in CASES:
        x = values(rank, count, getattr(torch, dtype_name), 0)
        taken.append(int(ca.should_custom_ar(x)))
        rows.append({"dtype": dtype_name, "bytes": count * x.element_size()})
    everyone = [torch.zeros(len(taken), dtype=torch.int32) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(taken, dtype=torch.int32), group=cpu_group)
    report["ranks_agree"] = all(torch.equal(e, everyone[0]) for e in everyone)

    # Eager warm-up and check, outside capture (the engines' dummy runs before capture).
    for row, on_tpar, (dtype_name, count) in zip(rows, taken, CASES, strict=True):
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
        row["runs"] = ca.comm.last_algorithm if on_tpar else "the engine's fallback"

    # The engines' graph_capture: ca.capture() around a side stream; warm-up inside, then one
    # graph of every size it can hold, replayed with new data.
    in_graph = [i for i in range(len(rows)) if taken[i] or device_group is not None]
    statics = {i: values(rank, CASES[i][1], getattr(torch, CASES[i][0]), 2) for i in in_graph}
    graph_error = None
    try:
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
    except Exception as error:  # reported in the table, not hidden
        graph_error = f"{type(error).__name__}: {error}"
    for i, row in enumerate(rows):
        row.setdefault("graph_ok", None if i not in in_graph else False)
    report["graph_error"] = graph_error
    report["rows"] = rows
    ca.close()
    dist.destroy_process_group()
    print("REPORT " + json.dumps(report), flush=True)


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
    from sglang_group import tp_group
    from tpar.engines import TparCustomAllreduce

    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    group = tp_group(n, rank % gpus)
    torch.cuda.synchronize()
    ca = group.ca_comm
    report["free_bytes_taken"] = free_before - torch.cuda.mem_get_info()[0]
    report["class"] = type(ca).__name__
    report["disabled"] = not isinstance(ca, TparCustomAllreduce) or ca.disabled
    if report["disabled"]:
        report["error"] = (
            f"SGLang built {type(ca).__name__}, disabled={getattr(ca, 'disabled', None)}"
        )
        print("REPORT " + json.dumps(report), flush=True)
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
    rows, taken = [], []
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
        taken.append(int(method == "ca"))
        rows.append(
            {
                "dtype": dtype_name,
                "bytes": count * x.element_size(),
                # SGLang's method, and how many of the 3 calls reached tpar.
                "runs": f"{method} (tpar x{took})",
                "eager_ok": bool(torch.equal(y, expected(count, dtype, 1))),
                "eager_us": round(sorted(times)[1], 1),
            }
        )
    everyone = [torch.zeros(len(taken), dtype=torch.int32) for _ in range(n)]
    dist.all_gather(everyone, torch.tensor(taken, dtype=torch.int32), group=group.cpu_group)
    report["ranks_agree"] = all(torch.equal(e, everyone[0]) for e in everyone)

    # The graph holds the sizes SGLang gives tpar: its table has torch.distributed (the NCCL
    # fallback without pynccl) disabled in graph mode.
    graphed = [i for i, on_tpar in enumerate(taken) if on_tpar]
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
    print("REPORT " + json.dumps(report), flush=True)


if __name__ == "__main__":
    sglang_rank_main() if sys.argv[1:] == ["--sglang"] else rank_main()
