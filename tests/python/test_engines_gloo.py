"""tpar.engines.TparCustomAllreduce across real processes on a gloo (CPU) group, as the
engines build it: the construction vote (every rank enabled, or every rank disabled with one
warning naming the failing rank and its cause), routing that is the same on every rank, and
``custom_all_reduce`` out of place on tpar's CPU backend.

Needs torch (for torch.distributed's gloo); skipped with the reason where torch is missing.
scripts/test.sh installs it once into .ci/torch unless TPAR_CI_TORCH=0 (PyPI's torch pulls
4.6 GB of CUDA libraries: 2-4 minutes here).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
from gloo_worker import GLOO_PREAMBLE
from jobs import run_python_ranks, run_ranks

pytest.importorskip(
    "torch",
    reason="torch is not installed: the gloo group tests need torch.distributed "
    "(scripts/test.sh installs it unless TPAR_CI_TORCH=0)",
)

WORKER = GLOO_PREAMBLE + textwrap.dedent(
    """
    import tpar
    from tpar.engines import TparCustomAllreduce

    scenario = os.environ["SCENARIO"]

    if scenario == "preflight" and rank == 1:
        # A rank that cannot even try (no CUDA, a missing library): no collective of tpar's.
        TparCustomAllreduce._preflight = lambda self, device: "no peer access to GPU 3 (test)"
    if scenario == "veto" and rank == n - 1:
        # A rank whose communicator opened and then refused (an init self-test veto).
        import functools
        real = tpar.Communicator
        @functools.wraps(real)  # the same signature, so tpar.engines passes the same arguments
        def vetoed(*args, **kwargs):
            comm = real(*args, **kwargs)
            comm.close()
            raise tpar.TparError("init self-test vetoed every path (test)")
        tpar.Communicator = vetoed

    ca = TparCustomAllreduce(group=group, device=torch.device("cpu"), max_size=64 << 10)
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    print("DISABLED", ca.disabled, ca.original_disabled, flush=True)
    print("WARNINGS", len(warnings), flush=True)
    for w in warnings:
        print("WARNING", w, flush=True)
    for line in infos:
        print("INFO", line, flush=True)

    sizes = [4, 1024, 16384, 16385, 1 << 20]
    routes = torch.tensor([int(ca.should_custom_ar(torch.ones(s, dtype=torch.float32))) for s in sizes]
                          + [int(ca.should_custom_ar(torch.ones(8, dtype=torch.int32)))], dtype=torch.int32)
    everyone = [torch.zeros_like(routes) for _ in range(n)]
    dist.all_gather(everyone, routes, group=group)
    print("ROUTES", routes.tolist(), all(torch.equal(r, routes) for r in everyone), flush=True)

    for count in (1, 1000, 16384):
        x = (torch.arange(count, dtype=torch.float32) % 97 + rank) / 4
        before = x.clone()
        if ca.should_custom_ar(x):
            y = ca.custom_all_reduce(x)
            expected = sum((torch.arange(count, dtype=torch.float32) % 97 + r) / 4 for r in range(n))
            assert y is not None and y.data_ptr() != x.data_ptr(), "not out of place"
            assert torch.equal(x, before), "custom_all_reduce changed its input"
            assert torch.equal(y, expected), f"wrong sum for {count}"
            print("REDUCED", count, flush=True)
        else:
            assert ca.custom_all_reduce(x) is None
    with ca.capture():
        pass
    assert ca.custom_all_gather(torch.ones(4)) is None and ca.custom_reduce_scatter(torch.ones(4)) is None
    ca.close()
    assert ca.disabled and not ca.should_custom_ar(torch.ones(4))
    dist.destroy_process_group()
    print("DONE", flush=True)
    """
)


def _run(n: int, scenario: str) -> list:
    return [
        lines for lines, _ in run_python_ranks(n, WORKER, timeout=180, env={"SCENARIO": scenario})
    ]


def _field(lines, key):
    return [
        line.split(" ", 1)[1] if " " in line else ""
        for line in lines
        if line.split(" ", 1)[0] == key
    ]


@pytest.mark.parametrize("n", [2, 4])
def test_every_rank_enables_routes_alike_and_reduces_out_of_place(n):
    for rank, lines in enumerate(_run(n, "ok")):
        assert _field(lines, "DISABLED") == ["False False"], lines
        assert _field(lines, "WARNINGS") == ["0"], lines
        info = _field(lines, "INFO")
        assert (
            len(info) == 1
            and f"rank {rank} of {n}" in info[0]
            and "over 64 KiB engine NCCL" in info[0]
        ), info
        # f32 of 4 B .. 64 KiB go to tpar; 16385 floats are over max_size; int32 never.
        assert _field(lines, "ROUTES") == ["[1, 1, 1, 0, 0, 0] True"], lines
        assert _field(lines, "REDUCED") == ["1", "1000", "16384"], lines
        assert _field(lines, "DONE") == [""], lines


@pytest.mark.parametrize(
    "scenario, culprit, cause",
    [
        ("preflight", 1, "no peer access to GPU 3 (test)"),
        ("veto", 2, "init self-test vetoed every path (test)"),
    ],
)
def test_one_failing_rank_disables_every_rank_with_one_warning(scenario, culprit, cause):
    n = 3
    for rank, lines in enumerate(_run(n, scenario)):
        assert _field(lines, "DISABLED") == ["True True"], (rank, lines)
        assert _field(lines, "WARNINGS") == ["1"], (rank, lines)
        warning = _field(lines, "WARNING")[0]
        assert f"group rank {culprit} could not open it" in warning and cause in warning, warning
        assert _field(lines, "INFO") == [], lines
        # Disabled on every rank: every size stays on the engine's NCCL, on every rank alike.
        assert _field(lines, "ROUTES") == ["[0, 0, 0, 0, 0, 0] True"], lines
        assert _field(lines, "REDUCED") == [], lines
        assert _field(lines, "DONE") == [""], lines


SHUTDOWN = textwrap.dedent(
    """
    import os
    import torch
    import torch.distributed as dist
    from tpar.engines import TparCustomAllreduce

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["STORE"], rank=rank, world_size=n)
    group = dist.new_group(list(range(n)), backend="gloo")
    ca = TparCustomAllreduce(group=group, device=torch.device("cpu"))
    assert not ca.disabled
    x = torch.ones(1024)
    assert ca.should_custom_ar(x) and torch.equal(ca.custom_all_reduce(x), x * n)
    # What engines do at shutdown, in this order.
    ca.close()
    dist.destroy_process_group()
    del group
    """
)


def test_close_then_destroy_process_group_exits_cleanly_fifty_times(tmp_path):
    """Issue 30, defect 7: TparCustomAllreduce.close() then destroy_process_group() on a
    2-rank gloo group, 50 times over (four jobs at a time): every process exits with 0."""
    import concurrent.futures

    def job(i):
        argv = [sys.executable, "-c", SHUTDOWN]
        return run_ranks(2, argv, timeout=180, rendezvous=False, tmp=tmp_path / f"job{i}")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        runs = list(pool.map(job, range(50)))
    failed = [
        (i, r, code, out[-2000:])
        for i, run in enumerate(runs)
        for r, (code, out) in enumerate(run)
        if code != 0
    ]
    assert not failed, f"{len(failed)} of 100 processes failed; first: {failed[0]}"
