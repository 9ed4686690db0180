"""The tests' job starter (jobs.py) does what the tests rely on: a rank past the job's deadline is
killed and says so (no process left behind), a rank that prints more than a pipe holds does not
block, and each rank sees its own RANK and the job's shared variables."""

import sys
import time

import pytest
from jobs import run_python_ranks, run_ranks


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
