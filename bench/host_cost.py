"""Host time of one eager tpar call from Python (issue 29's targets), every row beside an
empty op timed in the same run: one rank (world size 1), 10,000 eager calls of 4 KiB bf16 per
timing, the best of 5 timings, the host time per call with the GPU's work excluded (the loop is
timed on the host; the GPU is synchronised before and after a timing, never inside it).

Rows, on a GPU (``--device cuda``, the default where torch sees one):
  empty torch op             x.add_(0)
  comm.all_reduce(x)         in place (at world size 1 nothing is queued)
  comm.all_reduce(x, out=o)  out of place (a device-to-device copy is queued)
  torch.ops.tpar.all_reduce  the registered op (allocates its output)
  empty registered op        a torch.library op declared and implemented like tpar's
                             ("CompositeExplicitAutograd", a Python kernel) that returns its input
  registered op, torch work  the same, its kernel doing what tpar's does besides tpar: allocate
                             the output like the input and copy into it (what is left over it
                             is tpar's own cost)
  custom_all_reduce          the engines' TparCustomAllreduce (allocates its output)
  should_custom_ar           its question (one decision into tpar)
  comm.decision(x)           the same question on the Communicator
  torch.distributed NCCL     torch.distributed.all_reduce on a one-rank NCCL group
  graph replay               a CUDA graph of 100 out-of-place comm.all_reduce, per call (CUDA
                             events over 200 replays), to compare builds: the host path must
                             not change what a captured call costs

"over" is the row minus the empty torch op (for the ops: minus the empty registered op as
well). On the CPU (``--device cpu``, or no GPU) the same rows run on CPU tensors through tpar's
CPU backend where they can, gloo instead of NCCL, and the rows that need a GPU say why they were
skipped: it answers where the registered op's time goes (the dispatcher calling a Python
kernel, measured beside a direct call of the same Python function), not the GPU targets.

    python3 bench/host_cost.py                       # JSON into $OUT/host_cost.json, or ./
    python3 bench/host_cost.py --json results.json --calls 10000 --repeats 5

With an older tpar on PYTHONPATH (to compare builds in one run) the rows it lacks the API for
say so and are skipped.

The JSON has the command, device, host, date, commit and load average beside every row's
"us_per_call" and "over_empty_us". Times taken while other work runs on the host are noisy:
check ``load_average``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time

ELEMENTS = 2048  # 4 KiB of bf16


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def best_per_call(call, calls: int, repeats: int, sync) -> float:
    """The best of ``repeats`` timings of ``calls`` calls, in us per call (host time)."""
    for _ in range(min(calls, 500)):
        call()
    sync()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter_ns()
        for _ in range(calls):
            call()
        took = time.perf_counter_ns() - start
        sync()
        best = min(best, took / calls / 1000)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None)
    parser.add_argument("--calls", type=int, default=10_000, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings per row (the best is kept)")
    parser.add_argument("--json", help="where the JSON goes (default: $OUT/host_cost.json or ./)")
    args = parser.parse_args()
    if args.calls < 1 or args.repeats < 1:
        parser.error("--calls and --repeats: give 1 or more")

    import torch
    import torch.distributed as dist
    import tpar
    import tpar.ops
    from tpar.engines import TparCustomAllreduce

    cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here; use --device cpu")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    tmp = tempfile.mkdtemp(prefix="tpar-host-cost-")
    comm = tpar.Communicator(
        0,
        1,
        device=0 if cuda else "cpu",
        rendezvous=os.path.join(tmp, "rdv"),
        token=secrets.token_hex(16),
    )
    x = torch.randn(ELEMENTS, device=device).to(torch.bfloat16)
    out = torch.empty_like(x)

    # Declared and implemented as tpar.ops declares its ops (one Library, DEF, a Python kernel
    # for CompositeExplicitAutograd).
    lib = torch.library.Library("tpar_host_cost", "DEF")  # noqa: TOR901
    lib.define("empty(Tensor tensor, int comm_handle) -> Tensor")
    lib.define("torch_work(Tensor tensor, int comm_handle) -> Tensor")

    def empty(tensor, comm_handle):
        return tensor

    def torch_work(tensor, comm_handle):
        new = torch.empty_like(tensor.contiguous())
        new.copy_(tensor)
        return new

    lib.impl("empty", empty, "CompositeExplicitAutograd")
    lib.impl("torch_work", torch_work, "CompositeExplicitAutograd")

    try:
        ca = TparCustomAllreduce.from_communicator(comm, max_size=8 << 20)
        no_ca = None
    except AttributeError as error:  # a tpar before issue 29 (to compare builds in one run)
        ca, no_ca = None, f"this tpar has no TparCustomAllreduce.from_communicator ({error})"
    handle = comm.handle

    rows: list[dict] = []

    def row(name, call, skipped=None, over=("empty torch op",)):
        entry = {"name": name, "us_per_call": None, "skipped": skipped}
        if skipped is None:
            try:
                entry["us_per_call"] = round(best_per_call(call, args.calls, args.repeats, sync), 3)
            except Exception as error:  # noqa: BLE001 - a row that fails says why, never 0 us
                entry["skipped"] = f"{type(error).__name__}: {error}"
        entry["over"] = list(over)
        rows.append(entry)
        shown = f"{entry['us_per_call']:8.2f} us" if entry["us_per_call"] is not None else "skipped"
        print(f"{name:<34} {shown}  {entry['skipped'] or ''}", flush=True)

    no_gpu = None if cuda else "needs a CUDA GPU (this run is on the CPU)"
    row("empty torch op", lambda: x.add_(0), over=())
    row("comm.all_reduce(x)", lambda: comm.all_reduce(x))
    row("comm.all_reduce(x, out=o)", lambda: comm.all_reduce(x, out=out))
    row("native all_reduce(x, o)", lambda: comm._comm.all_reduce(x, out, None))
    row("python call of the kernel", lambda: empty(x, handle), over=())
    row("empty registered op", lambda: torch.ops.tpar_host_cost.empty(x, handle))
    row(
        "registered op, torch work",
        lambda: torch.ops.tpar_host_cost.torch_work(x, handle),
        over=("empty torch op", "empty registered op"),
    )
    row(
        "torch.ops.tpar.all_reduce",
        lambda: torch.ops.tpar.all_reduce(x, handle),
        over=("empty torch op", "empty registered op", "registered op, torch work"),
    )
    row("custom_all_reduce", lambda: ca.custom_all_reduce(x), skipped=no_ca)
    row("should_custom_ar", lambda: ca.should_custom_ar(x), skipped=no_ca)
    row("comm.decision(x)", lambda: comm.decision(x))
    row("torch.empty_like(x)", lambda: torch.empty_like(x))

    # torch.distributed beside it: NCCL on a GPU, gloo on the CPU (one rank).
    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    backend = "nccl" if cuda else "gloo"
    try:
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
        row(f"torch.distributed {backend}", lambda: dist.all_reduce(x))
    except Exception as error:  # noqa: BLE001
        row(f"torch.distributed {backend}", None, skipped=f"{type(error).__name__}: {error}")

    graph = {"name": "graph replay", "us_per_call": None, "skipped": no_gpu, "over": []}
    if cuda:
        chain, replays = 100, 200
        g = torch.cuda.CUDAGraph()
        with comm.capture(), torch.cuda.graph(g):
            for _ in range(chain):
                comm.all_reduce(x, out=out)
        for _ in range(20):
            g.replay()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(replays):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        graph["us_per_call"] = round(begin.elapsed_time(end) * 1000 / replays / chain, 3)
        graph["note"] = f"{chain} out-of-place calls per graph, {replays} replays, CUDA events"
    rows.append(graph)
    print(f"{'graph replay':<34} {graph['us_per_call'] or 'skipped'}  {graph['skipped'] or ''}")

    by_name = {r["name"]: r["us_per_call"] for r in rows}
    for r in rows:
        r["over_us"] = {
            base: round(r["us_per_call"] - by_name[base], 3)
            for base in r["over"]
            if r["us_per_call"] is not None and by_name.get(base) is not None
        }
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "tpar": tpar.__version__,
        "torch": torch.__version__,
        "world_size": 1,
        "dtype": "bf16",
        "bytes": ELEMENTS * 2,
        "calls": args.calls,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "last_algorithm": comm.last_algorithm,
        "rows": rows,
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    comm.close()
    path = args.json or os.path.join(os.environ.get("OUT", "."), "host_cost.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
