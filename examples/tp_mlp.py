"""A tensor-parallel MLP decode step with tpar, checked against the unsharded MLP.

Each rank holds a column slice of W1 (hidden -> ffn) and the matching row slice of W2
(ffn -> hidden): it computes relu(x @ W1_r) @ W2_r, a partial sum of the output, and an
allreduce adds the partial sums of all ranks, as in an engine's row-parallel linear layer.

    python examples/tp_mlp.py --world-size 4                 # numpy on the CPU backend
    python examples/tp_mlp.py --world-size 4 --device cuda   # torch on GPUs (rank r: GPU r % GPUs)

With --device cuda each rank reduces with tpar and with torch.distributed (NCCL where every
rank has its own GPU, else gloo), checks both against the unsharded MLP, and times the step's
allreduce both ways (eager calls, and tpar inside a captured CUDA graph).
"""

import argparse
import os
import secrets
import subprocess
import sys
import tempfile

import numpy as np


def weights(hidden, ffn, seed=0):
    rng = np.random.default_rng(seed)
    # Multiples of 1/64: products and sums stay exact enough to compare tightly.
    w1 = rng.integers(-32, 33, size=(hidden, ffn)).astype(np.float32) / 64
    w2 = rng.integers(-32, 33, size=(ffn, hidden)).astype(np.float32) / 64
    x = rng.integers(-64, 65, size=(1, hidden)).astype(np.float32) / 64
    return x, w1, w2


def rank_main(hidden, ffn):
    import tpar

    with tpar.Communicator() as comm:
        r, n = comm.rank, comm.world_size
        if ffn % n:
            raise SystemExit(f"ffn {ffn} does not split over {n} ranks")
        x, w1, w2 = weights(hidden, ffn)
        cols = slice(r * ffn // n, (r + 1) * ffn // n)
        partial = np.maximum(x @ w1[:, cols], 0) @ w2[cols, :]
        out = comm.all_reduce(np.ascontiguousarray(partial, dtype=np.float32))
        reference = np.maximum(x @ w1, 0) @ w2
        error = float(np.max(np.abs(out - reference)) / max(1.0, float(np.max(np.abs(reference)))))
        if r == 0:
            print(
                f"tp_mlp: {n} ranks, hidden {hidden}, ffn {ffn}: max relative error {error:.2e} against the unsharded MLP"
            )
        if error > 1e-5:
            raise SystemExit(
                f"rank {r}: the tensor-parallel MLP differs from the unsharded one ({error:.2e})"
            )


def rank_main_cuda(hidden, ffn, iters):
    import time

    import torch
    import torch.distributed as dist
    import tpar

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    backend = "nccl" if n <= torch.cuda.device_count() else "gloo"
    dist.init_process_group(
        backend,
        rank=rank,
        world_size=n,
        device_id=torch.device("cuda", device) if backend == "nccl" else None,
    )
    comm = tpar.Communicator(group=dist.group.WORLD, device=device)
    if ffn % n:
        raise SystemExit(f"ffn {ffn} does not split over {n} ranks")
    x, w1, w2 = (torch.from_numpy(a).cuda() for a in weights(hidden, ffn))
    cols = slice(rank * ffn // n, (rank + 1) * ffn // n)
    w1_r, w2_r = w1[:, cols].contiguous(), w2[cols, :].contiguous()
    reference = torch.relu(x @ w1) @ w2

    def step(reduce):
        return reduce(torch.relu(x @ w1_r) @ w2_r)

    def with_tpar(p):
        return comm.all_reduce(p)

    def with_dist(p):
        dist.all_reduce(p)
        return p

    scale = max(1.0, float(reference.abs().max()))
    errors = {
        name: float((step(f) - reference).abs().max()) / scale
        for name, f in (("tpar", with_tpar), ("torch.distributed", with_dist))
    }

    # The step's allreduce alone, at the decode shape in bf16 (what an engine sends per layer).
    msg = torch.ones(1, hidden, dtype=torch.bfloat16, device="cuda")

    def timed(call):
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / iters * 1e6

    eager_tpar = timed(lambda: comm.all_reduce(msg))
    eager_dist = timed(lambda: dist.all_reduce(msg))
    graph = torch.cuda.CUDAGraph()
    with comm.capture(), torch.cuda.graph(graph):
        for _ in range(20):
            comm.all_reduce(msg)
    graph_tpar = timed(graph.replay) / 20
    ran = comm.last_algorithm
    comm.close()
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"tp_mlp: {n} ranks on {torch.cuda.device_count()} GPU(s) ({torch.cuda.get_device_name()}), hidden {hidden}, ffn {ffn}, f32: "
            f"max relative error against the unsharded MLP: tpar {errors['tpar']:.2e}, torch.distributed ({backend}) {errors['torch.distributed']:.2e}"
        )
        print(
            f"tp_mlp: allreduce of {hidden * 2} bytes bf16, mean of {iters} calls: tpar {eager_tpar:.1f} us eager, "
            f"{graph_tpar:.1f} us per call in a CUDA graph ({ran}); torch.distributed ({backend}) {eager_dist:.1f} us eager"
        )
    worst = max(errors.values())
    if worst > 1e-5:
        raise SystemExit(
            f"rank {rank}: the tensor-parallel MLP differs from the unsharded one ({errors})"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: numpy arrays, tpar's CPU backend; cuda: torch tensors on GPUs, tpar and torch.distributed",
    )
    parser.add_argument(
        "--iters", type=int, default=200, help="timed allreduce calls (--device cuda)"
    )
    args = parser.parse_args()
    for name in ("world_size", "hidden", "ffn", "iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 1 or more")
    if args.device == "cuda":
        try:
            import torch
        except ImportError:
            parser.error(
                "--device cuda needs torch (pip install torch); --device cpu needs numpy only"
            )
        if not torch.cuda.is_available():
            parser.error(
                "--device cuda: torch sees no CUDA GPU here; run --device cpu (numpy arrays on "
                "tpar's CPU backend)"
            )
    if "TPAR_RENDEZVOUS" in os.environ or "MASTER_PORT" in os.environ:
        if args.device == "cuda":
            return rank_main_cuda(args.hidden, args.ffn, args.iters)
        return rank_main(args.hidden, args.ffn)
    if args.ffn % args.world_size:
        parser.error(f"--ffn {args.ffn} does not split over {args.world_size} ranks")
    with tempfile.TemporaryDirectory(prefix="tpar-tp-mlp-") as tmp:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        token = secrets.token_hex(16)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--hidden",
                    str(args.hidden),
                    "--ffn",
                    str(args.ffn),
                    "--device",
                    args.device,
                    "--iters",
                    str(args.iters),
                ],
                env=dict(
                    os.environ,
                    TPAR_RENDEZVOUS=os.path.join(tmp, "rdv"),
                    TPAR_JOB_TOKEN=token,
                    RANK=str(r),
                    WORLD_SIZE=str(args.world_size),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                ),
            )
            for r in range(args.world_size)
        ]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks failed with exit codes {codes}")


if __name__ == "__main__":
    main()
