"""An engine-grade communicator on GPU 0 (issue 12): what it says it holds against what the
device lost, no leak over 1,000 create/use/close cycles, calls from several streams eager and
in one graph, several communicators and subgroups at once, and the init self-test paid once per
group. The ranks are processes sharing GPU 0 (engine_comm_rank.py); each test keeps every rank's
result and log tail in its folder (engine-comm.json).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from jobs import rank_reports, run_ranks, write_result

RANK = str(Path(__file__).resolve().parent / "engine_comm_rank.py")
MIB = 1 << 20


def run_check(check, n, args, out, timeout, env=None, tag=None):
    """Every rank's RESULT of `check` (with `env` added to the ranks' environment); the ranks'
    logs and results go to out/engine-comm.json (out/TAG-rankR.log, TAG defaulting to `check`)."""
    results = run_ranks(
        n,
        [sys.executable, RANK, check, json.dumps(args)],
        log_dir=out,
        tag=tag or check,
        timeout=timeout,
        env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"), **(env or {})},
    )
    reports = rank_reports(results, "RESULT")
    write_result(
        out / "engine-comm.json",
        {"check": check, "ranks": n, "args": args, "results": reports},
    )
    for report in reports:
        assert "error" not in report, report["error"]
    return reports


@pytest.mark.parametrize(
    "n, nccl", [(1, "none"), (1, "own"), (1, "borrowed"), (2, "none"), (2, "own")]
)
def test_footprint_reported_matches_the_drop_in_free_device_memory(n, nccl, gpu_out):
    store = os.path.join(tempfile.mkdtemp(prefix="tpar-store-"), "store")
    r0 = run_check("footprint", n, {"nccl": nccl, "store": store}, gpu_out, timeout=120)[0]
    drop, reported = r0["measured_drop"], r0["reported_sum"]
    fp = r0["footprint"]
    print(
        f"reported {reported / MIB:.1f} MiB (rank 0: buffers {fp['device_buffer_bytes'] / MIB:.1f}, "
        f"modules {fp['module_bytes'] / MIB:.1f}, nccl {fp['nccl_bytes'] / MIB:.1f}) vs measured drop "
        f"{drop / MIB:.1f} MiB; nccl call: {r0.get('nccl_call')}"
    )
    assert abs(drop - reported) <= max(2 * MIB, 0.02 * drop), (drop, reported, fp)
    if nccl in ("own", "borrowed") and n == 1:
        # (Two ranks on one GPU: NCCL refuses them, and the call says so.)
        assert r0["nccl_call"] == "ran", r0["nccl_call"]


@pytest.mark.parametrize("n, cycles", [(1, 1000), (2, 100)])
def test_create_use_close_cycles_leak_nothing(n, cycles, gpu_out):
    r0 = run_check("leak", n, {"cycles": cycles}, gpu_out, timeout=240)[0]
    a, b = r0["at"]["10"], r0["at"][str(cycles)]
    print(
        f"cycle 10 -> {cycles}: fds {a['fds']}->{b['fds']}, threads {a['threads']}->{b['threads']}, "
        f"RSS {a['rss_kib']}->{b['rss_kib']} KiB, shm {a['shm']}->{b['shm']}, free device "
        f"{a['free_device'] / MIB:.1f}->{b['free_device'] / MIB:.1f} MiB, {r0['seconds']:.1f} s"
    )
    assert (a["fds"], a["threads"]) == (b["fds"], b["threads"]), (a, b)
    # /dev/shm may only shrink: at cycle 10 a peer process can still be unlinking its segment
    # of the cycle before when rank 0 counts (seen once: 1 -> 0 at 2 ranks).
    assert b["shm"] <= a["shm"], (a, b)
    assert abs(a["free_device"] - b["free_device"]) <= 2 * MIB, (a, b)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("streams", [2, 3])
def test_calls_from_unordered_streams_are_all_right(streams, graph, gpu_out):
    reports = run_check("streams", 2, {"streams": streams, "graph": graph}, gpu_out, timeout=120)
    assert [r["wrong"] for r in reports] == [0, 0], reports


def test_several_communicators_and_subgroups_at_once(gpu_out):
    reports = run_check("many", 4, {}, gpu_out, timeout=150)
    assert [r["wrong"] for r in reports] == [0] * 4, reports


def test_the_init_self_test_is_paid_once_per_group(gpu_out):
    seconds = run_check("initcost", 4, {"groups": 8}, gpu_out, timeout=150)[0]["seconds"]
    print(f"first {seconds[0]:.2f} s, the other 7: {', '.join(f'{t:.2f}' for t in seconds[1:])} s")
    assert sum(seconds[1:]) < 1.0, seconds


def test_an_engines_communicator_measures_at_first_use_and_every_rank_agrees(gpu_out, tmp_path):
    """The first-use measurement on an engine's path (a process per rank, each timing its own
    probes, the times gathered), which runs only where each rank has a GPU of its own; forced
    here on one GPU (TPAR_FIRST_USE=force: the ranks time-slice it, so the times are the
    driver's). Every rank ends with the same choice and reason at each probed size, the reasons
    cite the measurement, rank 0 cached one table, and a call after it is right. A second job on
    that cache reads the table instead of measuring again (the file is not rewritten), and names
    a `tpar tune` table of other kernels planted beside it, which no longer decides."""
    cache = tmp_path / "cache"
    env = {"TPAR_FIRST_USE": "force", "TPAR_CACHE_DIR": str(cache)}
    first = run_check("firstuse", 2, {}, gpu_out, timeout=300, env=env, tag="firstuse-measure")
    print("created in", [f"{r['seconds']:.1f} s" for r in first], first[0]["reasons"])
    assert [r["wrong"] for r in first] == [0, 0], first
    assert first[0]["reasons"] == first[1]["reasons"], first
    reasons = [why for _, why in first[0]["reasons"].values()]
    assert all("first-use measurement" in why for why in reasons), reasons
    assert any("corrected by the first-use measurement" in why for why in reasons), reasons
    assert len(first[0]["tables"]) == 1, first[0]["tables"]
    table = cache / first[0]["tables"][0]
    written = table.stat().st_mtime_ns
    # A `tpar tune` table of an older build, where tpar tune keeps its tables.
    tuned = json.loads(table.read_text())
    tuned.update(kernels="an-older-build", probes=[])
    tuned["entries"] = [{"max_bytes": 4096, "choice": "one-shot", "p50_us": 3.0}]
    stale = table.with_name(table.name.replace("-first-use", ""))
    stale.write_text(json.dumps(tuned))
    again = run_check("firstuse", 2, {}, gpu_out, timeout=300, env=env, tag="firstuse-cached")
    assert [r["wrong"] for r in again] == [0, 0], again
    assert again[0]["reasons"] == first[0]["reasons"] == again[1]["reasons"], again
    assert table.stat().st_mtime_ns == written, "the second job measured again"
    for rank in range(2):
        log = (gpu_out / f"firstuse-cached-rank{rank}.log").read_text()
        assert f"the tuning table {stale} is not read" in log, log
