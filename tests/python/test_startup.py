"""Start-up that never stalls (issue 29): when one rank of a group cannot create its tpar
communicator, every rank hears of it at once and says which rank and why, instead of waiting
out the 30 s rendezvous deadline. Across real processes on the CPU:

- the engines' ``TparCustomAllreduce`` on a gloo group of 3: a device that is not there and a
  group over two hosts (a fake host name) are declined by the first vote, before any of tpar's
  collectives; a rank whose creation fails in the middle (its shared memory cannot be reserved:
  a file-size limit, a real failure inside the library) tells the others, and every rank is
  disabled with the same warning naming that rank and its own reason;
- ``tpar.Communicator(group=...)`` with the same failures: every rank raises the same error;
- ranks of a plain rank environment (no torch): the ranks waiting for the failed one raise
  within a fraction of a second, naming it.

The times are each rank's own, around the constructor, after a barrier; they are asserted
against the 30 s deadline (a rank that waited for the deadline would fail), not as a speed.
Needs torch for the group cases (skipped with the reason where it is missing).
"""

from __future__ import annotations

import json
import secrets
import sys
import textwrap

import pytest
from gloo_worker import GLOO_PREAMBLE
from jobs import run_ranks

DEADLINE_S = 30
# "Disabled within 2 s" (issue 29); a rank that waited for the deadline takes 30.
WITHIN_S = 2.0

# The failures one rank meets, set up before it creates anything.
FAILURES = textwrap.dedent(
    """
    import resource, signal, socket
    def fail_as(scenario):
        if scenario == "creation":
            # A real failure inside the library, on this rank only: its shared memory cannot
            # be reserved (writes past 64 KiB fail with EFBIG instead of a signal).
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))
        if scenario == "hosts":
            socket.gethostname = lambda: "another-host"
    """
)

GROUP_WORKER = (
    FAILURES
    + GLOO_PREAMBLE
    + textwrap.dedent(
        """
    import json, time
    import tpar
    from tpar.engines import TparCustomAllreduce

    scenario, api = os.environ["SCENARIO"], os.environ["API"]
    device = "cpu"
    if rank == n - 1:
        fail_as(scenario)
        if scenario == "device":
            device = "cuda:7"
    dist.barrier(group=group)
    start = time.monotonic()
    if api == "contract":
        ca = TparCustomAllreduce(group=group, device=torch.device(device), max_size=1 << 20)
        took = time.monotonic() - start
        warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
        result = {"disabled": ca.disabled, "warnings": warnings}
        ca.close()
    else:
        try:
            tpar.Communicator(group=group, device=device, timeout=float(os.environ["DEADLINE"]))
            result = {"error": None}
        except tpar.TparError as e:
            result = {"error": str(e), "cause_rank": getattr(e, "cause_rank", None)}
        took = time.monotonic() - start
    result["took"] = took
    print("RESULT", json.dumps(result), flush=True)
    dist.destroy_process_group()
    """
    )
)

ENV_WORKER = FAILURES + textwrap.dedent(
    """
    import json, os, time
    import tpar
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == n - 1:
        time.sleep(1.0)  # the others are waiting for it when it fails
        fail_as("creation")
    try:
        tpar.Communicator(timeout=float(os.environ["DEADLINE"]))
        result = {"error": None}
    except tpar.TparError as e:
        result = {"error": str(e), "cause_rank": getattr(e, "cause_rank", None)}
    result["ended"] = time.time()
    print("RESULT", json.dumps(result), flush=True)
    """
)


def _run(worker, n, env, tmp_path):
    env = {"DEADLINE": str(DEADLINE_S), **env}
    argv = [sys.executable, "-c", worker]
    # STORE (the group cases' torch.distributed store) is in tmp_path.
    outputs = run_ranks(n, argv, timeout=DEADLINE_S * 4, env=env, rendezvous=False, tmp=tmp_path)
    results = []
    for rank, (code, out) in enumerate(outputs):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        assert code == 0 and lines, f"rank {rank} exited {code}:\n{out}"
        results.append(json.loads(lines[-1].split(" ", 1)[1]))
    return results


CAUSES = {
    "device": "cuda:7",
    "hosts": "another-host",
    "creation": "File too large",
}


def _group(tmp_path, scenario, api):
    pytest.importorskip(
        "torch",
        reason="torch is not installed: the group cases need torch.distributed "
        "(scripts/test.sh installs it unless TPAR_CI_TORCH=0)",
    )
    env = {"SCENARIO": scenario, "API": api}
    return _run(GROUP_WORKER, 3, env, tmp_path)


@pytest.mark.parametrize("scenario", sorted(CAUSES))
def test_one_failing_rank_disables_every_engine_rank_at_once_naming_it(tmp_path, scenario):
    for rank, result in enumerate(_group(tmp_path, scenario, "contract")):
        assert result["disabled"], (rank, result)
        (warning,) = result["warnings"]
        assert "group rank 2" in warning and CAUSES[scenario] in warning, (rank, warning)
        assert result["took"] < WITHIN_S, (
            f"rank {rank} was disabled after {result['took']:.2f} s (deadline {DEADLINE_S} s)"
        )
        print(f"{scenario}: rank {rank} disabled after {result['took']:.3f} s: {warning}")


def test_a_group_over_two_hosts_is_declined_at_preflight_saying_why(tmp_path):
    for rank, result in enumerate(_group(tmp_path, "hosts", "contract")):
        (warning,) = result["warnings"]
        assert "spans 2 hosts" in warning and "one host" in warning, warning
        assert result["took"] < 1.0, f"rank {rank}: {result['took']:.2f} s"


@pytest.mark.parametrize("scenario", sorted(CAUSES))
def test_a_group_communicator_raises_the_same_error_on_every_rank(tmp_path, scenario):
    results = _group(tmp_path, scenario, "communicator")
    errors = {r["error"] for r in results}
    assert len(errors) == 1 and None not in errors, results
    (error,) = errors
    assert "group rank 2" in error and CAUSES[scenario] in error, error
    for rank, result in enumerate(results):
        assert result["cause_rank"] == 2, result
        assert result["took"] < WITHIN_S, f"rank {rank}: {result['took']:.2f} s"


def test_ranks_waiting_for_a_rank_that_failed_stop_at_once_naming_it(tmp_path):
    env = {"TPAR_RENDEZVOUS": str(tmp_path / "rdv"), "TPAR_JOB_TOKEN": secrets.token_hex(16)}
    results = _run(ENV_WORKER, 3, env, tmp_path)
    assert "File too large" in results[2]["error"], results[2]
    for rank in (0, 1):
        error = results[rank]["error"]
        assert error and "rank 2 could not create its communicator" in error, error
        assert "File too large" in error and results[rank]["cause_rank"] == 2, error
        # It stopped once rank 2 had failed, not at the 30 s deadline.
        after = results[rank]["ended"] - results[2]["ended"]
        assert after < 1.0, f"rank {rank} stopped {after:.2f} s after rank 2 failed"
