"""tpar.verify and tpar.tune: the library's harness (what `tpar selftest` and `tpar tune` run)
called from Python by every rank of a job. On the CPU backend across real processes; the GPU
paths skip, saying why, where no GPU is visible."""

import json
import os
import secrets
import subprocess
import textwrap

import pytest
import tpar
from jobs import run_program

WORKER = textwrap.dedent(
    """
    import json, sys
    import tpar
    task = json.loads(sys.argv[1])
    try:
        report = tpar.verify(**task)
    except tpar.TparError as e:
        print("ERROR", e, flush=True)
        sys.exit(3)
    print("REPORT", json.dumps(report), flush=True)
    """
)


def run_job(n, task, timeout=180):
    """Runs n processes as the ranks of one job, each calling tpar.verify(**task); returns
    (exit code, output) per rank."""
    return run_program(n, WORKER, task, timeout=timeout)


def report_of(output):
    line = next(text for text in output.splitlines() if text.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :])


@pytest.mark.parametrize("n", [2, 3])
def test_verify_on_the_cpu_backend_checks_every_row_on_every_rank(n):
    task = {
        "backend": "cpu",
        "counts": [0, 7, 1023],
        "dtypes": ["f32", "bf16"],
        "algorithms": ["one-shot", "two-shot"],
    }
    for code, output in run_job(n, task):
        assert code == 0, output
        report = report_of(output)
        assert report["backend"] == "cpu" and report["world_size"] == n
        # A peer-timeout and a mismatch row per algorithm, then 2 algorithms x 2 dtypes x
        # 3 counts x 2 placements.
        assert len(report["rows"]) == 2 * 2 + 2 * 2 * 3 * 2, report
        assert report["failed"] == 0 and report["passed"] == len(report["rows"]), report
        first = report["rows"][0]
        assert first["case"] == "peer timeout, one-shot", first
        assert first["result"].startswith("pass"), first
        cases = {(r["case"], r["dtype"], r["elements"], r["placement"]) for r in report["rows"][4:]}
        assert ("two-shot", "bf16", "1023", "in place") in cases
        assert all(r["failed_ranks"] == 0 for r in report["rows"])


def test_verify_without_the_timeout_case_has_only_sweep_rows():
    task = {
        "backend": "cpu",
        "counts": [5],
        "dtypes": ["f16"],
        "algorithms": ["one-shot"],
        "timeout_case": False,
    }
    for code, output in run_job(2, task):
        assert code == 0, output
        rows = report_of(output)["rows"]
        assert [(r["case"], r["placement"]) for r in rows] == [
            ("one-shot", "out of place"),
            ("one-shot", "in place"),
        ]


def test_verify_refuses_what_it_cannot_run_with_the_fix(tmp_path):
    with pytest.raises(tpar.TparError, match='give "cpu" or "cuda"'):
        tpar.verify(backend="gpu")
    with pytest.raises(tpar.TparError, match="the CPU backend runs one-shot, two-shot"):
        tpar.verify(backend="cpu", algorithms=["host-staged"])
    with pytest.raises(tpar.TparError, match="unknown"):
        tpar.verify(backend="cpu", dtypes=["int8"])
    with pytest.raises(tpar.TparError, match="timeout="):
        tpar.verify(backend="cpu", timeout=0)
    with pytest.raises(tpar.TparError, match="rank=, world_size= and token="):
        tpar.verify(backend="cpu", rendezvous=str(tmp_path / "rdv"))


def test_verify_alone_passes_on_one_rank(tmp_path):
    report = tpar.verify(
        backend="cpu",
        counts=[3, 100],
        dtypes=["f32"],
        rank=0,
        world_size=1,
        rendezvous=str(tmp_path / "rdv"),
        token=secrets.token_hex(16),
    )
    # One rank has no peer to time out: the sweep rows only, for each of the CPU's 8
    # algorithms (one island partition of one rank) x 2 counts x 2 placements.
    assert report["failed"] == 0 and len(report["rows"]) == 8 * 2 * 2, report


def gpu_visible():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_tune_without_a_gpu_says_why(tmp_path):
    if gpu_visible():
        pytest.skip("a GPU is visible: the no-GPU error path is not reachable here")
    with pytest.raises(tpar.TparError, match="none is usable here"):
        tpar.tune(
            rank=0, world_size=1, rendezvous=str(tmp_path / "rdv"), token=secrets.token_hex(16)
        )
    with pytest.raises(tpar.TparError, match="whole number of bf16 elements"):
        tpar.tune(sizes=[3])


def test_verify_and_tune_on_a_gpu(tmp_path):
    if not gpu_visible():
        pytest.skip(
            "no GPU visible (nvidia-smi): tpar.verify(backend='cuda') and tpar.tune run on the GPU machine"
        )
    token = secrets.token_hex(16)
    report = tpar.verify(
        backend="cuda",
        counts=[7, 4099],
        dtypes=["bf16"],
        replays=10,
        rank=0,
        world_size=1,
        rendezvous=str(tmp_path / "rdv"),
        token=token,
    )
    assert report["failed"] == 0 and report["passed"] > 0, report
    tuned = tpar.tune(
        sizes=[4096, 65536],
        iters=10,
        rank=0,
        world_size=1,
        rendezvous=str(tmp_path / "rdv2"),
        token=token,
    )
    assert tuned["written_to"] and os.path.exists(tuned["written_to"]), tuned
    assert tuned["entries"] and tuned["entries"][-1][0] == 2**64 - 1, tuned
