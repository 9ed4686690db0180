"""The peers tpar is measured against, timed the way `tpar bench` times tpar: one process per
GPU, each rank replaying its own CUDA graph holding a chain of allreduces, CUDA events around
the replays, p50/p99 per allreduce (replay time / chain length), every row's result checked.

Rows (bf16 by default):
  nccl              torch.distributed.all_reduce on a ProcessGroupNCCL (NCCL's default path)
  torch-symm-1shot  torch.ops.symm_mem.one_shot_all_reduce on a symmetric buffer
  torch-symm-2shot  torch.ops.symm_mem.two_shot_all_reduce_ (in place) on a symmetric buffer
  nccl-symmetric    torch.distributed.all_reduce on a buffer from symmetric memory allocated by
                    NCCL (torch's NCCL symmetric-memory backend: ncclMemAlloc + a registered
                    window, so NCCL may pick its symmetric kernels); the copy of the input into
                    the window is inside the timed op, as an engine would do it
A peer that cannot run here says why in its row (`skipped`, figures null), never 0 us.

The JSON follows `tpar bench --json`: top-level backend/world_size/dtype/device/date/command
and a `results` list of {bytes, algo, p50_us, p99_us, busbw_gbps, correct, chain, replays}.

    python3 bench/peers.py -n 2 --sizes 1K,4K,32K,256K,1M --json out.json

Needs torch with CUDA; NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import traceback

ALGOS = ("nccl", "torch-symm-1shot", "torch-symm-2shot", "nccl-symmetric")


def parse_size(text: str) -> int:
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("empty size in --sizes (write e.g. 4K,32K)")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(
            f"size {text!r} is not a whole number of bytes (write e.g. 4K)"
        )
    return int(digits) * scale


def rank_values(torch, rank: int, count: int, seed: int):
    """Small integers (exact in bf16 and in any summation order) that differ per rank and seed."""
    idx = torch.arange(count, dtype=torch.int64)
    return (((idx * 7 + rank * 13 + seed * 5) % 17) - 8).to(torch.float32)


def expected_sum(torch, world: int, count: int, seed: int):
    total = torch.zeros(count, dtype=torch.float32)
    for r in range(world):
        total += rank_values(torch, r, count, seed)
    return total


def time_graph(torch, step, chain: int, replays: int, warmup: int):
    """Captures `chain` calls of `step` into one graph, replays it, returns per-op times (us)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # eager warm-up outside capture (lazy inits, NCCL connections)
            step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(chain):
            step()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / chain)
    times.sort()
    return times[len(times) // 2], times[min(len(times) - 1, (len(times) * 99) // 100)]


def run_row(torch, dist, algo, nbytes, args, rank, world, group_name):
    dtype = getattr(torch, args.dtype)
    count = nbytes // torch.tensor([], dtype=dtype).element_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    seed = 1
    src = rank_values(torch, rank, count, seed).to(dtype).to(dev)
    want = expected_sum(torch, world, count, seed).to(dtype).to(dev)
    if algo == "nccl":
        buf = torch.empty_like(src)

        def step():
            buf.copy_(src)
            dist.all_reduce(buf)

        result = lambda: buf  # noqa: E731
    elif algo in ("torch-symm-1shot", "torch-symm-2shot"):
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(count, dtype=dtype, device=dev)
        symm_mem.rendezvous(buf, group_name)
        out = torch.empty_like(src)
        if algo == "torch-symm-1shot":

            def step():
                buf.copy_(src)
                out.copy_(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name))

            result = lambda: out  # noqa: E731
        else:

            def step():
                buf.copy_(src)
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group_name)

            result = lambda: buf  # noqa: E731
    elif algo == "nccl-symmetric":
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(symm_mem, "set_backend"):
            raise RuntimeError(
                "this torch has no symm_mem.set_backend (NCCL symmetric memory backend)"
            )
        buf = symm_mem.empty(count, dtype=dtype, device=dev)
        symm_mem.rendezvous(buf, group_name)

        def step():
            buf.copy_(src)
            dist.all_reduce(buf)

        result = lambda: buf  # noqa: E731
    else:
        raise ValueError(algo)
    chain = max(1, min(args.chain, (64 << 20) // max(nbytes, 1)))
    p50, p99 = time_graph(torch, step, chain, args.replays, args.warmup)
    correct = bool(torch.equal(result().float().cpu(), want.float().cpu()))
    bus = nbytes / (p50 * 1e-6) * 2 * (world - 1) / world / 1e9 if world > 1 else 0.0
    return {
        "bytes": nbytes,
        "algo": algo,
        "p50_us": p50,
        "p99_us": p99,
        "busbw_gbps": bus,
        "correct": correct,
        "chain": chain,
        "replays": args.replays,
    }


def worker(rank, world, args, port, queue):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    if args.nccl_symmetric_backend and "nccl-symmetric" in args.algos:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "set_backend"):
            symm_mem.set_backend("NCCL")
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )
    group_name = dist.group.WORLD.group_name
    rows = []
    for algo in args.algos:
        for nbytes in args.sizes:
            try:
                row = run_row(torch, dist, algo, nbytes, args, rank, world, group_name)
            except Exception as exc:  # a peer that cannot run says why in its row
                row = {
                    "bytes": nbytes,
                    "algo": algo,
                    "p50_us": None,
                    "p99_us": None,
                    "busbw_gbps": None,
                    "correct": None,
                    "skipped": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                }
                if os.environ.get("PEERS_TRACEBACK"):
                    traceback.print_exc()
            # Every rank must agree that a row ran: one rank's failure makes the row skipped.
            flag = torch.tensor([0 if row.get("skipped") else 1], device="cuda")
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
                torch.cuda.synchronize()
                if flag.item() == 0 and not row.get("skipped"):
                    row = {
                        **row,
                        "p50_us": None,
                        "p99_us": None,
                        "busbw_gbps": None,
                        "correct": None,
                        "skipped": "another rank could not run this row",
                    }
            except Exception as exc:
                row["skipped"] = f"agreement failed: {exc}"
            rows.append(row)
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "-n",
        "--world-size",
        type=int,
        default=None,
        help="processes, one per GPU (default: every GPU)",
    )
    ap.add_argument(
        "--sizes",
        default="1K,4K,16K,32K,64K,256K,1M,4M,16M,64M",
        help="message sizes in bytes, K/M/G = powers of 1024",
    )
    ap.add_argument(
        "--algos", default=",".join(ALGOS), help=f"peers to time, from {', '.join(ALGOS)}"
    )
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="element type",
    )
    ap.add_argument("--chain", type=int, default=50, help="allreduces per captured graph")
    ap.add_argument("--replays", type=int, default=50, help="timed graph replays per row")
    ap.add_argument("--warmup", type=int, default=5, help="untimed graph replays per row")
    ap.add_argument("--json", default=None, help="write the results as JSON here ('-' for stdout)")
    ap.add_argument(
        "--no-nccl-symmetric-backend",
        dest="nccl_symmetric_backend",
        action="store_false",
        help="do not switch torch's symmetric memory to its NCCL backend for nccl-symmetric",
    )
    args = ap.parse_args()
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        ap.error(f"--sizes: {exc}")
    args.algos = [a.strip() for a in args.algos.split(",")]
    for a in args.algos:
        if a not in ALGOS:
            ap.error(f"unknown peer {a!r}; choose from {', '.join(ALGOS)}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("peers: no CUDA device visible to torch; nothing to time", file=sys.stderr)
        return 1
    world = args.world_size or torch.cuda.device_count()
    if world < 1 or world > torch.cuda.device_count():
        ap.error(
            f"--world-size {world}: this machine has {torch.cuda.device_count()} GPU(s); one process per GPU"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=worker, args=(r, world, args, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        print(f"peers: a rank failed (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return 1
    rows = queue.get()
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    doc = {
        "backend": "torch",
        "world_size": world,
        "mode": "processes",
        "dtype": args.dtype,
        "device": f"cuda: {world} x {torch.cuda.get_device_name(0)} (torch {torch.__version__}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))})",
        "host": socket.gethostname(),
        "commit": commit or None,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([sys.executable, *sys.argv]),
        "timing": "CUDA events around graph replays; p50/p99 over replays; per allreduce = replay / chain",
        "results": rows,
    }
    print(f"{'bytes':>10} {'algo':<18} {'p50 us':>9} {'p99 us':>9}  correct / why skipped")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['bytes']:>10} {r['algo']:<18} {'-':>9} {'-':>9}  skipped: {r['skipped']}")
        else:
            print(
                f"{r['bytes']:>10} {r['algo']:<18} {r['p50_us']:>9.2f} {r['p99_us']:>9.2f}  {r['correct']}"
            )
    if args.json:
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if all(r.get("correct") in (True, None) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
