"""The rank setup of the CUDA worker scripts (cuda_worker.py, cuda_fused_worker.py), which run
one process per rank with tpar's rank environment: who this rank is, its task (the JSON of
argv[1]), its GPU (rank r uses GPU r % GPUs visible, so on a one-GPU machine all ranks share
it), and the two ways a worker reports a failure."""

import json
import os
import sys

import torch
import tpar

rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
task = json.loads(sys.argv[1])
device = rank % torch.cuda.device_count()
torch.cuda.set_device(device)
# Every rank builds its expected results on the CPU; with torch's default of one thread per
# core in each of n processes, 8 ranks on one host spent minutes fighting over the cores.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))


def fail(what):
    """Ends this rank naming the failure (the test reads the line and the exit code)."""
    print(f"FAIL rank {rank}: {what}", flush=True)
    sys.exit(1)


def refused(call, match):
    """`call()` must raise a TparError whose text contains `match`."""
    try:
        call()
    except tpar.TparError as e:
        if match not in str(e):
            fail(f"error {e!r} does not say {match!r}")
        return
    fail(f"no error where one says {match!r}")
