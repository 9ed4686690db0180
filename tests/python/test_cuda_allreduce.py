"""The tpar Python package on CUDA tensors, one process per rank (ranks share the GPU where
there are fewer GPUs than ranks): eager calls checked bitwise, a captured CUDA graph replayed
with new data, torch.compile, the engine adapter, the errors a user meets, and construction from
a torch.distributed group. Each rank runs tests/python/cuda_worker.py.

Skipped, with the reason, where torch or a GPU is missing; on such machines the CPU tests
cover the package and `tpar selftest --backend cuda` covers the kernels on the GPU machine.
"""

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile

import pytest

torch = pytest.importorskip(
    "torch", reason="torch is not installed: the CUDA path of the package needs it"
)
if not torch.cuda.is_available():
    pytest.skip(
        "no CUDA GPU visible to torch: the CUDA tests run on the GPU machine",
        allow_module_level=True,
    )

WORKER = os.path.join(os.path.dirname(__file__), "cuda_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(n, task, timeout=600, worker=WORKER):
    """Starts n worker processes as the ranks of one job; returns their (code, output). Each
    rank writes to a log file as it goes (kept in TPAR_TEST_LOGS when set), so a job stopped
    from outside still shows how far every rank got."""
    with tempfile.TemporaryDirectory(prefix="tpar-py-cuda-") as tmp:
        logs = os.environ.get("TPAR_TEST_LOGS") or tmp
        os.makedirs(logs, exist_ok=True)
        tag = f"{task.get('kind', '-'.join(task.get('steps', [])))}-n{n}"
        common = dict(
            os.environ,
            TPAR_RENDEZVOUS=os.path.join(tmp, "rdv"),
            TPAR_JOB_TOKEN=secrets.token_hex(16),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            NCCL_NVLS_ENABLE="0",
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            PYTHONUNBUFFERED="1",
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        files = [open(os.path.join(logs, f"{tag}-rank{r}.log"), "w+") for r in range(n)]
        procs = [
            subprocess.Popen(
                [sys.executable, worker, json.dumps(task)],
                env=dict(common, RANK=str(r)),
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r, f in enumerate(files)
        ]
        results = []
        for p, f in zip(procs, files, strict=False):
            try:
                p.wait(timeout=timeout)
                note = ""
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                note = "\n(killed: the test's time limit)"
            f.seek(0)
            results.append((p.returncode, f.read() + note))
            f.close()
        return results


def assert_steps(results, *steps):
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        for step in steps:
            assert f"ok {step}" in out, f"rank {rank} did not pass {step}:\n{out}"
    print(results[0][1])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_eager_graph_and_compile_give_exact_sums(n):
    steps = ["eager", "graph", "compile-aot_eager", "compile-inductor", "adapter"]
    assert_steps(
        run_job(n, {"steps": steps}),
        "eager",
        "graph",
        "compile aot_eager",
        "compile inductor",
        "adapter",
    )


def test_errors_name_the_problem_and_a_silent_rank():
    results = run_job(2, {"steps": ["errors"], "timeout": 5})
    assert_steps(results[:-1], "errors", "silent rank named")
    assert results[-1][0] == 0, results[-1][1]


def test_a_torch_distributed_group_builds_the_communicator():
    assert_steps(run_job(2, {"kind": "group"}), "group")


@pytest.mark.parametrize("n", [2, 4])
def test_the_tensor_parallel_mlp_example_on_gpus_matches_the_unsharded_mlp(n):
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tp_mlp.py")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TPAR_RENDEZVOUS", "TPAR_JOB_TOKEN", "RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    done = subprocess.run(
        [sys.executable, example, "--world-size", str(n), "--device", "cuda"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"tp_mlp: {n} ranks" in done.stdout and "torch.distributed" in done.stdout, done.stdout
    print(done.stdout)
