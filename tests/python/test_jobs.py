"""The tests' job starter (jobs.py) does what the tests rely on: a rank past the job's deadline is
killed and says so, with what it started (no process left behind, also when the test is
interrupted), a rank that prints more than a pipe holds does not block, each rank sees its own
RANK and the job's shared variables, and a test's record carries the envelope bench/results asks
of every JSON file."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import run_python_ranks, run_ranks, write_result


def test_a_rank_past_the_deadline_is_killed_and_says_so():
    argv = [
        sys.executable,
        "-c",
        "import os, time; print('up', flush=True); time.sleep(60 * int(os.environ['RANK']))",
    ]
    start = time.monotonic()
    results = run_ranks(2, argv, timeout=3)
    took = time.monotonic() - start
    assert took < 20, f"the job took {took:.1f} s past a 3 s deadline"
    (code0, out0), (code1, out1) = results
    assert code0 == 0 and "killed" not in out0, out0
    assert (
        code1 != 0 and out1.startswith("up") and "killed: the test's time limit of 3 s" in out1
    ), out1


def test_output_larger_than_a_pipe_does_not_block_and_ranks_share_the_job():
    code = (
        "import os, sys; sys.stdout.write('x' * (1 << 20));"
        "print(); print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['TPAR_JOB_TOKEN'])"
    )
    results = run_ranks(3, [sys.executable, "-c", code], timeout=60)
    tokens = set()
    for rank, (status, out) in enumerate(results):
        assert status == 0, out[-2000:]
        assert out.count("x") == 1 << 20
        got_rank, world, token = out.splitlines()[-1].split()
        assert (got_rank, world) == (str(rank), "3")
        tokens.add(token)
    assert len(tokens) == 1, tokens


def test_python_ranks_keep_stderr_apart_and_fail_the_test_on_a_bad_exit():
    code = "import os, sys; print('out', os.environ['RANK']); print('err', file=sys.stderr)"
    assert run_python_ranks(2, code, timeout=60) == [(["out 0"], "err\n"), (["out 1"], "err\n")]
    with pytest.raises(AssertionError, match="rank 1 exited 5"):
        run_python_ranks(2, "import os, sys; sys.exit(int(os.environ['RANK']) * 5)", timeout=60)


# A rank that starts a child which outlives it unless killed, prints the child's pid, and then
# sleeps for a minute.
PARENT_OF_A_SLEEPER = (
    "import subprocess, sys, time;"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
    "print('child', child.pid, flush=True); time.sleep(60)"
)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by whoever adopted it, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def child_pid(output: str) -> int:
    return int(next(line.split()[1] for line in output.splitlines() if line.startswith("child ")))


def wait_until_gone(pid: int, seconds: float = 10) -> bool:
    end = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not alive(pid)


def test_a_rank_killed_at_the_deadline_takes_what_it_started_with_it():
    ((code, out),) = run_ranks(1, [sys.executable, "-c", PARENT_OF_A_SLEEPER], timeout=3)
    assert code != 0 and "killed: the test's time limit" in out, out
    pid = child_pid(out)
    assert wait_until_gone(pid), f"rank 0's child {pid} outlived the killed rank"


def test_an_interrupted_job_leaves_no_rank_or_child_behind(tmp_path):
    # A test run interrupted (Ctrl-C: KeyboardInterrupt in the test's process) while its ranks
    # run: every rank and what it started must go, though they lead groups of their own.
    driver = (
        "import signal, sys;"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r});"
        "from jobs import run_ranks;"
        "signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()));"
        "signal.alarm(3);"
        f"run_ranks(2, [sys.executable, '-c', {PARENT_OF_A_SLEEPER!r}], timeout=60,"
        f" log_dir={str(tmp_path)!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=60
    )
    assert "KeyboardInterrupt" in done.stderr, done.stderr
    for rank in range(2):
        out = (tmp_path / f"job-rank{rank}.log").read_text()
        pid = child_pid(out)
        assert wait_until_gone(pid), f"rank {rank}'s child {pid} outlived the interrupted job"


def test_a_tests_record_says_which_test_machine_date_and_commit_made_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TPAR_COMMIT", "0123abc")
    path = tmp_path / "record.json"
    write_result(path, {"ranks": [1, 2], "date": "kept"})
    record = json.loads(path.read_text())
    # bench/schema/envelope.schema.json's required keys, each a string.
    for key in ("command", "device", "date", "commit"):
        assert isinstance(record[key], str) and record[key], (key, record)
    assert (
        "test_a_tests_record_says_which_test_machine_date_and_commit_made_it" in record["command"]
    )
    assert not record["command"].endswith("(call)"), record["command"]
    assert record["commit"] == "0123abc"
    # The record's own keys win over the envelope's.
    assert record["ranks"] == [1, 2] and record["date"] == "kept"
