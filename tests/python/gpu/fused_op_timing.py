"""Times tpar's fused allreduce + residual add + RMSNorm from Python (issue 15), one process per
rank as engines run it, rank r on GPU r % GPUs. Give each rank its own GPU for figures: ranks
sharing a GPU are processes time-sliced by the driver (milliseconds per call; the table says
so), and ranks as threads of one process on one GPU are refused by tpar (they would share a
CUDA context). For bf16, hidden 8192, 1 and 8 tokens, per rank and per op:

- eager: 200 calls of the Python op back to back (host-bound: Python, checks and launch);
- graph: one CUDA graph per rank holding a chain of 50 calls, replayed, divided by 50 (what the
  op adds inside an engine's decode graph);

for `tpar.ops.fused_add_rms_norm` (fused kernel where its decision says), `tpar.ops.all_reduce`
followed by torch's residual add + RMSNorm written in eager torch ops (several kernels: the
unfused sequence as plain PyTorch runs it; `tpar bench --fused` times the unfused sequence with
tpar's one-kernel norm), and `tpar.ops.all_reduce` alone. Before timing, each rank's fused
result is checked bit for bit against tpar's CPU path (a difference ends the run with exit 1).
Prints a table last; writes $OUT/fused-py.json. Run by test_cuda_fused_timing.py:

    python3 tests/python/gpu/fused_op_timing.py [--world-size 2] [--chain 50]
"""

import argparse
import json
import multiprocessing
import os
import secrets
import sys
import tempfile
import time

import torch
import tpar
import tpar.ops

EPS = 1e-6


def torch_add_rms_norm(y, residual, weight):
    r = (y.float() + residual.float()).to(y.dtype)
    v = r.float()
    normed = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + EPS)).to(y.dtype)
    return normed * weight, r


def rank_main(rank, n, chain, hidden, token_list, directory, job, barrier, results_queue):
    """One rank's process: checks the op against tpar's CPU path, then times it; puts its rows
    (or its error) on `results_queue`."""
    rows = {}
    try:
        device = rank % torch.cuda.device_count()
        torch.cuda.set_device(device)
        comm = tpar.Communicator(
            rank, n, device=device, rendezvous=os.path.join(directory, "rdv"), token=job, timeout=60
        )
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for tokens in token_list:
                g = torch.Generator().manual_seed(tokens)
                xs = [
                    (torch.rand(tokens, hidden, generator=g) * 2 - 1).to(torch.bfloat16)
                    for _ in range(n)
                ]
                residual = (torch.rand(tokens, hidden, generator=g) * 4 - 2).to(torch.bfloat16)
                weight = (torch.rand(hidden, generator=g) + 0.5).to(torch.bfloat16)
                x, r, w = xs[rank].cuda(), residual.cuda(), weight.cuda()
                # Correctness first: bitwise against tpar's CPU path, on every rank.
                y, r_out = tpar.ops.fused_add_rms_norm(x, r, w, EPS, comm)
                torch.cuda.synchronize()
                want_y, want_r = comm.fused_add_rms_norm(
                    xs[rank], residual.clone(), weight, EPS, in_place=False
                )
                if not (torch.equal(y.cpu(), want_y) and torch.equal(r_out.cpu(), want_r)):
                    raise AssertionError(
                        f"rank {rank}: {tokens} tokens: fused result differs from the CPU path"
                    )
                decision = comm.fused_plan(tokens, hidden, torch.bfloat16, capturing=True)
                ops = {
                    "fused_add_rms_norm": lambda x=x, r=r, w=w: tpar.ops.fused_add_rms_norm(
                        x, r, w, EPS, comm
                    ),
                    "all_reduce + torch norm": lambda x=x, r=r, w=w: torch_add_rms_norm(
                        tpar.ops.all_reduce(x, comm), r, w
                    ),
                    "all_reduce alone": lambda x=x: tpar.ops.all_reduce(x, comm),
                }
                for name, op in ops.items():
                    for _ in range(5):
                        op()
                    torch.cuda.synchronize()
                    barrier.wait()
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    began = time.perf_counter()
                    start.record()
                    for _ in range(200):
                        op()
                    end.record()
                    end.synchronize()
                    host_us = (time.perf_counter() - began) / 200 * 1e6
                    eager_us = start.elapsed_time(end) * 1e3 / 200
                    barrier.wait()
                    graph = torch.cuda.CUDAGraph()
                    with (
                        comm.capture(),
                        torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
                    ):
                        for _ in range(chain):
                            op()
                    barrier.wait()
                    graph.replay()
                    torch.cuda.synchronize()
                    barrier.wait()
                    start.record()
                    for _ in range(20):
                        graph.replay()
                    end.record()
                    end.synchronize()
                    graph_us = start.elapsed_time(end) * 1e3 / (20 * chain)
                    comm.check()
                    del graph
                    rows.setdefault((tokens, name), []).append(
                        {
                            "rank": rank,
                            "eager_us": eager_us,
                            "eager_host_us": host_us,
                            "graph_us": graph_us,
                            "allreduce": comm.last_algorithm,
                            "fused": decision[1],
                            "reason": decision[2],
                        }
                    )
        barrier.wait()
        comm.close()
        results_queue.put((rank, rows, None))
    except BaseException as e:  # noqa: BLE001 - reported by main, the other ranks stop on the barrier
        results_queue.put((rank, {}, f"rank {rank}: {type(e).__name__}: {e}"))
        barrier.abort()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--chain", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", default="1,8")
    args = parser.parse_args()
    n, chain, hidden = args.world_size, args.chain, args.hidden
    token_list = [int(t) for t in args.tokens.split(",")]
    directory = tempfile.mkdtemp(prefix="tpar-fused-py-")
    job = secrets.token_hex(16)
    spawn = multiprocessing.get_context("spawn")
    barrier, results_queue = spawn.Barrier(n), spawn.Queue()

    procs = [
        spawn.Process(
            target=rank_main,
            args=(r, n, chain, hidden, token_list, directory, job, barrier, results_queue),
        )
        for r in range(n)
    ]
    for p in procs:
        p.start()
    rows, errors = {}, []
    for _ in procs:
        _, rank_rows, error = results_queue.get(timeout=600)
        if error:
            errors.append(error)
        for key, value in rank_rows.items():
            rows.setdefault(key, []).extend(value)
    for p in procs:
        p.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(1)
    device = torch.cuda.get_device_name(0)
    gpus = torch.cuda.device_count()
    ranks_as = (
        f"processes, one per GPU ({n} GPUs)"
        if gpus >= n
        else f"processes sharing {gpus} GPU(s), time-sliced by the driver: the timings are not a machine's"
    )
    results = []
    for (tokens, name), per_rank in sorted(rows.items()):
        worst = max(per_rank, key=lambda row: row["graph_us"])
        results.append(
            {
                "tokens": tokens,
                "hidden": hidden,
                "dtype": "bf16",
                "op": name,
                "ranks": n,
                "eager_us": max(r["eager_us"] for r in per_rank),
                "eager_host_us": max(r["eager_host_us"] for r in per_rank),
                "graph_us_per_op": worst["graph_us"],
                "allreduce": worst["allreduce"],
                "fused_plan": [worst["fused"], worst["reason"]],
            }
        )
    report = {
        "script": "tests/python/gpu/fused_op_timing.py",
        "device": device,
        "ranks": n,
        "ranks_as": ranks_as,
        "chain": chain,
        "torch": torch.__version__,
        "tpar": tpar.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "timing": "eager: CUDA events around 200 back-to-back Python calls per rank (slowest rank); graph: a "
        f"chain of {chain} calls per rank in one graph, 20 replays, per op (slowest rank)",
        "results": results,
    }
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fused-py.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(
        f"== fused op from Python: {device}, {n} ranks as {ranks_as}, bf16 hidden {hidden}; us per op (slowest rank)"
    )
    print(f"{'tokens':>6}  {'op':<26} {'eager':>8} {'host':>8} {'graph':>8}  allreduce / path")
    for row in results:
        path = "fused" if row["fused_plan"][0] else "unfused"
        print(
            f"{row['tokens']:>6}  {row['op']:<26} {row['eager_us']:>8.2f} {row['eager_host_us']:>8.2f} "
            f"{row['graph_us_per_op']:>8.2f}  {row['allreduce']}"
            + (f" ({path})" if "fused_add" in row["op"] else "")
        )


if __name__ == "__main__":
    main()
