"""The start of a worker process of the gloo tests (test_engines_gloo.py, test_startup.py): rank
and world size from the environment, torch.distributed on a file store ($STORE), the gloo group
of all ranks the engines build their custom allreduce on (``group``), and tpar.engines' log
records kept in ``records``. Not a test module: the tests prepend it to their workers' code."""

import textwrap

GLOO_PREAMBLE = textwrap.dedent(
    """
    import logging, os, sys
    import torch
    import torch.distributed as dist
    from tpar.engines import contract

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)
    # The engines build their custom allreduce on a gloo group of the tensor-parallel ranks.
    group = dist.new_group(list(range(n)), backend="gloo")

    records = []
    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    contract.logger.addHandler(Keep())
    """
)
