"""The tpar Python package across real processes on the CPU backend: numpy arrays (and torch
CPU tensors where torch is installed), every world size up to 4, both algorithms, in place and
into out=, and the errors a user meets (mismatched calls, a silent rank, bad arrays)."""

import os
import secrets
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tpar
from jobs import run_program

WORKER = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import tpar
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    task = json.loads(sys.argv[1])
    def values(r, count, dtype):
        # Multiples of 1/64 in [-8, 8): sums of a few ranks are exact in every dtype.
        i = np.arange(count, dtype=np.int64)
        return (((i * 7 + r * 13) % 1024) - 512).astype(np.float64) / 64.0 + (1 / 64.0)
    with tpar.Communicator(timeout=task.get("timeout", 30)) as comm:
        assert (comm.rank, comm.world_size) == (rank, n)
        if task["kind"] == "sum":
            for dtype in ("float32", "float16"):
                for count in (0, 1, 7, 1023, 70001):
                    for algo in ("one-shot", "two-shot"):
                        x = values(rank, count, dtype).astype(dtype)
                        expected = sum(values(r, count, dtype).astype(dtype).astype(np.float32) for r in range(n)).astype(dtype) if count else x
                        y = x.copy()
                        comm.all_reduce(y, algorithm=algo)
                        out = np.full_like(x, np.nan)
                        comm.all_reduce(x, out=out, algorithm=algo)
                        if count and not (np.array_equal(y, expected) and np.array_equal(out, expected)):
                            sys.exit(f"rank {rank}: wrong sum for {count} {dtype} {algo}")
            assert comm.memory_footprint()["shared_host_bytes"] > 0
        elif task["kind"] == "mismatch":
            x = np.ones(1024 if rank == 0 else 2048, dtype=np.float32)
            try:
                comm.all_reduce(x)
            except tpar.TparError as e:
                print("ERROR", e, flush=True)
                sys.exit(3)
        elif task["kind"] == "silent":
            x = np.ones(16, dtype=np.float32)
            comm.all_reduce(x)
            if rank == n - 1:
                import time
                time.sleep(3)  # alive but silent: the others must hit their deadline
                sys.exit(0)
            try:
                comm.all_reduce(x)
            except tpar.TparError as e:
                print("ERROR", e, flush=True)
                sys.exit(3)
    """
)


def run_job(n, task, timeout=120):
    """Runs n worker processes as the ranks of one job; returns their (code, output)."""
    return run_program(n, WORKER, task, timeout=timeout)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sums_are_exact_on_every_rank(n):
    for code, output in run_job(n, {"kind": "sum"}):
        assert code == 0, output


def test_mismatched_sizes_fail_on_every_rank_naming_both():
    for code, output in run_job(2, {"kind": "mismatch"}):
        assert code == 3, output
        assert "1024 elements of f32" in output and "2048 elements of f32" in output, output


def test_a_silent_rank_is_named_after_the_deadline():
    results = run_job(3, {"kind": "silent", "timeout": 1})
    for code, output in results[:-1]:
        assert code == 3, output
        assert "rank 2" in output and "timed out" in output, output


def test_bad_input_is_refused_with_the_fix(tmp_path):
    token = secrets.token_hex(16)
    with tpar.Communicator(0, 1, rendezvous=str(tmp_path / "rdv"), token=token) as comm:
        with pytest.raises(tpar.TparError, match="C-contiguous"):
            comm.all_reduce(np.ones((4, 4), dtype=np.float32)[:, ::2])
        with pytest.raises(tpar.TparError, match="float32, float16 or bfloat16"):
            comm.all_reduce(np.ones(4, dtype=np.int32))
        with pytest.raises(tpar.TparError, match="must match"):
            comm.all_reduce(np.ones(4, dtype=np.float32), out=np.ones(5, dtype=np.float32))
        with pytest.raises(tpar.TparError, match="no such algorithm.*runs one-shot, two-shot"):
            comm.all_reduce(np.ones(4, dtype=np.float32), algorithm="rings")
        # GPU algorithms are named as such; auto is the CPU backend's choice, as None is.
        with pytest.raises(tpar.TparError, match="host-staged runs on CUDA tensors only"):
            comm.all_reduce(np.ones(4, dtype=np.float32), algorithm="host-staged")
        with pytest.raises(tpar.TparError, match="nccl runs on CUDA tensors only"):
            comm.all_reduce(np.ones(4, dtype=np.float32), algorithm="nccl")
        y = np.ones(4, dtype=np.float32)
        assert comm.all_reduce(y, algorithm="auto") is y and comm.last_algorithm == "one-shot"
        assert comm.all_reduce(y, algorithm="ring") is y and comm.last_algorithm == "ring"
        x = np.arange(5, dtype=np.float32)
        assert comm.all_reduce(x) is x and list(x) == [0, 1, 2, 3, 4]
        assert (
            comm.should_use(x)
            and comm.should_use(x, max_bytes=20)
            and not comm.should_use(x, max_bytes=19)
        )
        assert not comm.should_use(np.ones(4, dtype=np.int64)) and not comm.should_use([1.0, 2.0])
    with pytest.raises(tpar.TparError, match="closed"):
        comm.all_reduce(np.ones(4, dtype=np.float32))
    # A GPU that is not there is an error naming why (no driver here; no such GPU on a GPU box).
    with pytest.raises(tpar.TparError, match="driver|GPU 99"):
        tpar.Communicator(0, 1, device="cuda:99", rendezvous=str(tmp_path / "rdv2"), token=token)
    with pytest.raises(tpar.TparError, match="device='gpu'"):
        tpar.Communicator(0, 1, device="gpu", rendezvous=str(tmp_path / "rdv3"), token=token)


def test_no_rank_environment_says_what_to_set(monkeypatch):
    for key in ("TPAR_RENDEZVOUS", "TPAR_JOB_TOKEN", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(tpar.TparError, match="TPAR_RENDEZVOUS"):
        tpar.Communicator()


def test_torch_cpu_tensors_reduce_like_arrays(tmp_path):
    torch = pytest.importorskip(
        "torch", reason="torch is not installed here; the numpy tests cover the CPU path"
    )
    token = secrets.token_hex(16)
    with tpar.Communicator(0, 1, rendezvous=str(tmp_path / "rdv"), token=token) as comm:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            t = torch.arange(10, dtype=dtype)
            assert torch.equal(comm.all_reduce(t.clone()), t)


@pytest.mark.parametrize("n", [2, 4])
def test_the_tensor_parallel_mlp_example_matches_the_unsharded_mlp(n):
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tp_mlp.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TPAR_RENDEZVOUS", "TPAR_JOB_TOKEN", "RANK", "WORLD_SIZE")
    }
    done = subprocess.run(
        [sys.executable, example, "--world-size", str(n)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tp_mlp: {n} ranks" in done.stdout and "max relative error" in done.stdout, done.stdout


def test_python_edges_say_what_is_wrong(tmp_path):
    """Issue 30, defect 6: out of another shape, last_algorithm on the CPU, a meta tensor, a
    numpy scalar; refusals are TparRefused with a reason code."""
    token = secrets.token_hex(16)
    with tpar.Communicator(0, 1, rendezvous=str(tmp_path / "rdv"), token=token) as comm:
        assert comm.last_algorithm is None
        with pytest.raises(tpar.TparError, match=r"out is \(2, 4\) f32, the input \(8,\) f32"):
            comm.all_reduce(np.arange(8, dtype=np.float32), out=np.zeros((2, 4), np.float32))
        comm.all_reduce(np.ones(4, np.float32), algorithm="two-shot")
        assert comm.last_algorithm == "two-shot"
        comm.all_reduce(np.ones(4, np.float32))
        assert comm.last_algorithm == "one-shot"
        with pytest.raises(tpar.TparError, match="numpy scalar cannot be reduced in place"):
            comm.all_reduce(np.float32(1.0))
        out = np.zeros((), np.float32)
        assert comm.all_reduce(np.float32(2.5), out=out) is out and out == 2.5
        with pytest.raises(tpar.TparRefused) as refused:
            comm.all_reduce(np.ones(4, np.int32))
        assert refused.value.reason == "dtype" and isinstance(refused.value, tpar.TparError)
        torch = pytest.importorskip("torch", reason="torch is not installed: the meta tensor case")
        with pytest.raises(tpar.TparRefused, match="meta device: it has a shape but no data"):
            comm.all_reduce(torch.empty(4, device="meta"))
        with pytest.raises(tpar.TparError, match="out must be a torch tensor"):
            comm.all_reduce(torch.ones(4), out=np.zeros(4, np.float32))
        with pytest.raises(tpar.TparError, match=r"out is \(2, 2\)"):
            comm.all_reduce(torch.ones(4), out=torch.zeros(2, 2))
        assert comm.decision(torch.ones(4))[0] == "one-shot"
        assert comm.decision(torch.ones(4, dtype=torch.int64))[0] is None


def test_a_rank_claimed_by_two_processes_is_named_at_once(tmp_path):
    """Issue 30, defect 6: two processes passing rank=0 hear "rank 0 was claimed twice", not an
    OS error, and neither waits out its deadline."""
    token = secrets.token_hex(16)
    code = textwrap.dedent(f"""
        import time, tpar
        start = time.monotonic()
        try:
            tpar.Communicator(0, 2, rendezvous={str(tmp_path / "rdv")!r}, token={token!r}, timeout=30)
        except tpar.TparError as e:
            print(f"ERROR {{time.monotonic() - start:.2f}} {{e}}", flush=True)
    """)
    first = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    import time

    time.sleep(1.0)
    second = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    outputs = [p.communicate(timeout=60)[0] for p in (first, second)]
    for output in outputs:
        assert "ERROR" in output and "rank 0 was claimed twice" in output, outputs
        waited = float(output.split("ERROR ")[1].split()[0])
        assert waited < 15, f"waited {waited} s of a 30 s deadline: {outputs}"


def test_the_example_refuses_what_it_cannot_run_with_usage_errors():
    """Issue 30: --world-size 0 exited 0 silently; --device cuda without a GPU divided by 0."""
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tp_mlp.py")
    cases = [(["--world-size", "0"], "--world-size 0: give 1 or more")]
    torch = None
    try:
        import torch
    except ImportError:
        cases.append((["--device", "cuda"], "needs torch"))
    if torch is not None and not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "torch sees no CUDA GPU here; run --device cpu"))
    for args, says in cases:
        done = subprocess.run(
            [sys.executable, example, *args], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2 and says in done.stderr, (args, done.stdout, done.stderr)


def test_the_engine_adapter_answers_like_a_custom_allreduce(tmp_path):
    from tpar.adapter import TparAllreduce

    token = secrets.token_hex(16)
    ca = TparAllreduce(
        tpar.Communicator(0, 1, rendezvous=str(tmp_path / "rdv"), token=token), max_bytes=1024
    )
    small, large = np.arange(8, dtype=np.float32), np.ones(1024, dtype=np.float32)
    assert ca.should_custom_ar(small)
    assert not ca.should_custom_ar(large), "over max_bytes: the engine keeps its own path"
    assert not ca.should_custom_ar(np.ones(8, dtype=np.int32))
    assert not ca.should_custom_ar(np.ones((4, 4), dtype=np.float32)[:, ::2])
    with ca.capture():
        out = ca.custom_all_reduce(small)
    assert out is not small and np.array_equal(out, small), (
        "one rank: the sum is the input, in a new array"
    )
    # The one contract class: None where should_custom_ar says False, as the engines' own.
    assert ca.custom_all_reduce(large) is None
    assert type(ca).__name__ == "TparCustomAllreduce"
    ca.close()
    assert not ca.should_custom_ar(small)


def test_the_torch_custom_op_runs_eagerly_and_under_torch_compile(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed here; the op needs it")
    import tpar.ops

    # One compile worker: a pool sized to a many-core machine takes longer to start than the
    # two tiny graphs here take to compile.
    torch._inductor.config.compile_threads = 1
    token = secrets.token_hex(16)
    with tpar.Communicator(
        0, 1, device="cpu", rendezvous=str(tmp_path / "rdv"), token=token
    ) as comm:
        x = torch.arange(8, dtype=torch.float32)
        y = torch.ops.tpar.all_reduce(x, comm.handle)
        assert y is not x and torch.equal(y, x), "one rank: the sum is the input, in a new tensor"
        for backend in ("aot_eager", "inductor"):
            step = torch.compile(
                lambda t: tpar.ops.all_reduce(t * 2, comm) + 1, fullgraph=True, backend=backend
            )
            assert torch.equal(step(x), x * 2 + 1), backend
        checks = torch.library.opcheck(torch.ops.tpar.all_reduce.default, (x, comm.handle))
        assert set(checks.values()) == {"SUCCESS"}, checks
    with pytest.raises(tpar.TparError, match="no open tpar communicator"):
        torch.ops.tpar.all_reduce(x, comm.handle)


def test_device_names_are_read_like_torch_reads_them():
    from tpar import _cuda_ordinal

    assert _cuda_ordinal("cpu") is None
    torch = sys.modules.get("torch")
    if torch is None:
        assert _cuda_ordinal(3) == 3 and _cuda_ordinal("cuda:2") == 2
    elif not torch.cuda.is_available():
        # Where torch is imported it says at once that a GPU is not there, before any rank waits.
        with pytest.raises(tpar.TparError, match="device=cuda:3: torch sees no CUDA GPU here"):
            _cuda_ordinal(3)
    else:
        count = torch.cuda.device_count()
        assert _cuda_ordinal(count - 1) == count - 1
        with pytest.raises(tpar.TparError, match=f"there is no GPU {count}"):
            _cuda_ordinal(f"cuda:{count}")
    for bad in ("gpu", "cuda:x", -1, "cuda:"):
        with pytest.raises(tpar.TparError, match="device="):
            _cuda_ordinal(bad)


def test_a_group_needs_torch_distributed_initialised(tmp_path):
    torch = pytest.importorskip(
        "torch", reason="torch is not installed here; group= needs torch.distributed"
    )
    if torch.distributed.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    with pytest.raises(tpar.TparError, match="init_process_group"):
        tpar.Communicator(group=object())
    with pytest.raises(tpar.TparError, match="not both"):
        tpar.Communicator(group=object(), rendezvous=str(tmp_path / "rdv"))
