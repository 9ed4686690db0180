"""A tensor-parallel MLP decode step on the CPU with tpar, checked against the unsharded MLP.

Each rank holds a column slice of W1 (hidden -> ffn) and the matching row slice of W2
(ffn -> hidden): it computes relu(x @ W1_r) @ W2_r, a partial sum of the output, and tpar's
allreduce adds the partial sums of all ranks, as in an engine's row-parallel linear layer.

Run it as N processes, for example with tpar's rank environment:

    python examples/tp_mlp.py --world-size 4        # starts 4 ranks of itself

The CUDA version (torch tensors, CUDA graphs, a torch.distributed comparison) needs the CUDA
path of the Python package, which is not built yet.
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
            print(f"tp_mlp: {n} ranks, hidden {hidden}, ffn {ffn}: max relative error {error:.2e} against the unsharded MLP")
        if error > 1e-5:
            raise SystemExit(f"rank {r}: the tensor-parallel MLP differs from the unsharded one ({error:.2e})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=2048)
    args = parser.parse_args()
    if "TPAR_RENDEZVOUS" in os.environ:
        return rank_main(args.hidden, args.ffn)
    with tempfile.TemporaryDirectory(prefix="tpar-tp-mlp-") as tmp:
        token = secrets.token_hex(16)
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--hidden", str(args.hidden), "--ffn", str(args.ffn)],
                env=dict(os.environ, TPAR_RENDEZVOUS=os.path.join(tmp, "rdv"), TPAR_JOB_TOKEN=token,
                         RANK=str(r), WORLD_SIZE=str(args.world_size)),
            )
            for r in range(args.world_size)
        ]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks failed with exit codes {codes}")


if __name__ == "__main__":
    main()
