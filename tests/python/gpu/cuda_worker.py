"""One rank of the CUDA tests in test_cuda_allreduce.py (run as a script, one process per rank,
with tpar's rank environment). Rank r uses GPU r % (GPUs visible), so on a one-GPU machine all
ranks share it. Prints "ok <step>" per passed step; exits non-zero naming the first failure.

Inputs are multiples of 1/64 in [-8, 8), exact in every dtype, so tpar's fp32 rank-order sum
rounded once to the dtype is known exactly: tpar's own algorithms are checked bitwise; calls the
dispatcher gave to NCCL (own order, every partial sum rounded to the dtype) within the bound
of tpar::check::unordered_sum_error_bound: n roundings of half an ulp of a sum at most n x 8.
"""

import functools
import time

import torch
import tpar
from cuda_rank import device, fail, n, rank, refused, task

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def values(r, count, dtype, seed=0):
    i = torch.arange(count, dtype=torch.int64)
    return ((((i * 7 + r * 13 + seed * 5) % 1024) - 512).double() / 64.0 + 1 / 64.0).to(dtype)


@functools.lru_cache(maxsize=8)
def expected(count, dtype, seed=0):
    total = torch.zeros(count, dtype=torch.float32)
    for r in range(n):
        total += values(r, count, dtype, seed).float()
    return total.to(dtype)


def check(got, dtype, count, seed, algorithm, what):
    want = expected(count, dtype, seed)
    got = got.cpu()
    error = (got.float() - want.float()).abs()
    if algorithm == "nccl":
        unit_roundoff = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[
            dtype
        ]
        bad = (error > n * unit_roundoff * 8.0 * n) | error.isnan()
    else:
        bad = got != want  # bitwise for these exact inputs; a NaN is never equal
    if count and bool(bad.any()):
        first = int(bad.nonzero()[0])
        fail(
            f"{what}: {count} {dtype} via {algorithm}: first wrong element {first}: "
            f"got {got[first].item()}, want {want[first].item()} "
            f"({int(bad.sum())} wrong, largest error {error.nan_to_num(float('inf')).max().item():g})"
        )


def eager(comm):
    ran = set()
    # Processes sharing a GPU are time-sliced: every call waits for each rank's turn, so with
    # many ranks per GPU the sweep keeps the odd sizes and one multi-chunk size.
    shared = n > torch.cuda.device_count()
    counts = (0, 7, 70001, 1 << 18) if shared else (0, 1, 7, 1023, 70001, 1 << 20)
    for dtype in DTYPES:
        for count in counts:
            for algorithm in (None, "one-shot", "two-shot"):
                x = values(rank, count, dtype).cuda()
                y = x.clone()
                assert comm.all_reduce(y, algorithm=algorithm) is y
                check(y, dtype, count, 0, comm.last_algorithm, f"in place ({algorithm or 'auto'})")
                out = torch.full_like(x, float("nan"))
                assert comm.all_reduce(x, out=out, algorithm=algorithm) is out
                check(out, dtype, count, 0, comm.last_algorithm, f"out= ({algorithm or 'auto'})")
                if not torch.equal(x.cpu(), values(rank, count, dtype)):
                    fail("out-of-place call changed its input")
                ran.add(comm.last_algorithm)
    print(f"ok eager ran {sorted(ran)}", flush=True)


def graph(comm):
    import tpar.ops

    for dtype in (torch.bfloat16, torch.float32):
        count = 21504  # 42 KB of bf16: one decode step's hidden state on a 70B model
        static = values(rank, count, dtype).cuda()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):  # warm up off the capture
            tpar.ops.all_reduce(static, comm)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with comm.capture(), torch.cuda.graph(g):
            once = tpar.ops.all_reduce(static, comm)
            twice = comm.all_reduce(once * 1, out=torch.empty_like(once))
        algorithm = comm.last_algorithm
        for replay in range(50):
            static.copy_(values(rank, count, dtype, seed=replay))
            g.replay()
            check(once, dtype, count, replay, algorithm, f"graph replay {replay}")
            # the second call sums n copies of the first result
            want = (expected(count, dtype, replay).float() * n).to(dtype)
            if algorithm != "nccl" and not torch.equal(twice.cpu(), want):
                fail(f"graph replay {replay}: the second captured call is wrong")
    print(f"ok graph 50 replays with new data via {algorithm}", flush=True)


def compiled(comm, backend):
    import tpar.ops

    def step(x, w):
        return tpar.ops.all_reduce(x @ w, comm) + 1.0

    fn = torch.compile(step, fullgraph=True, backend=backend)
    w = torch.eye(256, dtype=torch.float32, device="cuda")
    for seed in range(3):
        x = values(rank, 256 * 4, torch.float32, seed).cuda().view(4, 256)
        got = fn(x, w)
        want = expected(256 * 4, torch.float32, seed).view(4, 256) + 1.0
        if not torch.equal(got.cpu(), want):
            fail(f"torch.compile({backend}) result differs")
    print(f"ok compile {backend}", flush=True)


def adapter(comm):
    from tpar.adapter import TparAllreduce

    ca = TparAllreduce(comm, max_bytes=1 << 20)
    x = values(rank, 4096, torch.bfloat16).cuda()
    assert ca.should_custom_ar(x)
    assert not ca.should_custom_ar(torch.ones(1 << 20, dtype=torch.bfloat16, device="cuda")), (
        "over max_bytes"
    )
    assert not ca.should_custom_ar(torch.ones(64, dtype=torch.int32, device="cuda"))
    assert not ca.should_custom_ar(torch.ones(64, 64, dtype=torch.bfloat16, device="cuda")[:, ::2])
    y = ca.custom_all_reduce(x)
    check(y, torch.bfloat16, 4096, 0, comm.last_algorithm, "adapter")
    g = torch.cuda.CUDAGraph()
    with ca.capture(), torch.cuda.graph(g):
        z = ca.custom_all_reduce(x)
    g.replay()
    check(z, torch.bfloat16, 4096, 0, comm.last_algorithm, "adapter in a graph")
    print("ok adapter", flush=True)


def errors(comm):
    refused(
        lambda: comm.all_reduce(torch.ones(8, dtype=torch.int32, device="cuda")),
        "float32, float16 or bfloat16",
    )
    refused(lambda: comm.all_reduce(torch.ones(8, 8, device="cuda")[:, ::2]), "contiguous")
    refused(
        lambda: comm.all_reduce(torch.ones(comm.max_bytes // 4 + 1, device="cuda")), "max_bytes"
    )
    refused(lambda: comm.all_reduce(torch.ones(8, device="cuda"), algorithm="rings"), "rings")
    refused(
        lambda: comm.all_reduce(torch.ones(8, device="cuda"), out=torch.ones(9, device="cuda")),
        "must match",
    )
    if torch.cuda.device_count() > 1:
        other = (device + 1) % torch.cuda.device_count()
        refused(lambda: comm.all_reduce(torch.ones(8, device=f"cuda:{other}")), f"cuda:{device}")
    print("ok errors", flush=True)
    # A silent rank: the others' kernels give up at the deadline and the next call says who.
    x = torch.ones(4096, device="cuda")
    comm.all_reduce(x)
    torch.cuda.synchronize()
    if rank == n - 1:
        time.sleep(task["timeout"] * 3)
        return
    comm.all_reduce(x)
    torch.cuda.synchronize()
    refused(comm.check, "rank")
    print("ok silent rank named", flush=True)


def group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=n)
    comm = tpar.Communicator(group=dist.group.WORLD, device=device, nccl="own")
    x = values(rank, 5000, torch.float32).cuda()
    comm.all_reduce(x)
    reference = values(rank, 5000, torch.float32)
    dist.all_reduce(reference)
    if not torch.equal(x.cpu(), reference):
        fail("tpar and torch.distributed differ")
    footprint = comm.memory_footprint()
    if footprint["cuda"]["device_bytes"] <= 0:
        fail(f"memory_footprint reports no device memory: {footprint}")
    comm.close()
    dist.destroy_process_group()
    print(f"ok group; footprint {footprint['allocated_bytes']} bytes", flush=True)


if task.get("kind") == "group":
    group()
else:
    import warnings

    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        comm = tpar.Communicator(device=device, timeout=task.get("timeout", 120), nccl="own")
    # Processes sharing a GPU are time-sliced: tpar must say so, and only then.
    time_sliced = [str(w.message) for w in heard if "time-slices" in str(w.message)]
    if bool(time_sliced) != (n > torch.cuda.device_count()):
        fail(f"time-slicing warning {'missing' if not time_sliced else 'wrong'}: {time_sliced}")
    with comm:
        if comm.device != device or (comm.rank, comm.world_size) != (rank, n):
            fail("communicator does not describe this rank")
        for step in task["steps"]:
            began = time.monotonic()
            print(f"start {step}", flush=True)
            if step == "eager":
                eager(comm)
            elif step == "graph":
                graph(comm)
            elif step.startswith("compile-"):
                compiled(comm, step[len("compile-") :])
            elif step == "adapter":
                adapter(comm)
            elif step == "errors":
                errors(comm)
            print(f"done {step} in {time.monotonic() - began:.1f} s", flush=True)
        torch.cuda.synchronize()
