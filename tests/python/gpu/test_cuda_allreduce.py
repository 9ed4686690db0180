"""The tpar Python package on CUDA tensors, one process per rank (ranks share the GPU where
there are fewer GPUs than ranks): eager calls checked bitwise, a captured CUDA graph replayed
with new data, torch.compile, the engine adapter, the errors a user meets, and construction from
a torch.distributed group. Each rank runs cuda_worker.py; its log is kept in the test's folder
(TPAR_GPU_OUT on the GPU machine).

Part of the GPU suite (conftest.py: skipped, with the reason, where torch or a GPU is missing;
the CPU tests cover the package there).
"""

import os
import subprocess
import sys

import pytest
from jobs import OUTER, run_worker

WORKER = os.path.join(os.path.dirname(__file__), "cuda_worker.py")


def run_job(n, task, log_dir):
    return run_worker(n, WORKER, task, log_dir)


def assert_steps(results, *steps):
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        for step in steps:
            assert f"ok {step}" in out, f"rank {rank} did not pass {step}:\n{out}"
    print(results[0][1])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_eager_graph_and_compile_give_exact_sums(n, gpu_out):
    steps = ["eager", "graph", "compile-aot_eager", "compile-inductor", "adapter"]
    assert_steps(
        run_job(n, {"steps": steps}, gpu_out),
        "eager",
        "graph",
        "compile aot_eager",
        "compile inductor",
        "adapter",
    )


def test_errors_name_the_problem_and_a_silent_rank(gpu_out):
    results = run_job(2, {"steps": ["errors"], "timeout": 5}, gpu_out)
    assert_steps(results[:-1], "errors", "silent rank named")
    assert results[-1][0] == 0, results[-1][1]


def test_a_torch_distributed_group_builds_the_communicator(gpu_out):
    assert_steps(run_job(2, {"kind": "group"}, gpu_out), "group")


@pytest.mark.parametrize("n", [2, 4])
def test_the_tensor_parallel_mlp_example_on_gpus_matches_the_unsharded_mlp(n):
    example = os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "tp_mlp.py")
    env = {k: v for k, v in os.environ.items() if k not in OUTER}
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
