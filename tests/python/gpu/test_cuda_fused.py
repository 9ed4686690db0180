"""The fused allreduce + residual add + RMSNorm (issue 15) on CUDA tensors, one process per rank
(ranks share the GPU where there are fewer GPUs than ranks): eager over dtypes, hidden sizes
(odd, and above the fused kernel's 16384), 1 and many tokens, auto / one-shot (fused kernel) /
two-shot (allreduce + norm kernel), in place and not; a captured CUDA graph replayed with new
data (functional and in-place ops); torch.compile(fullgraph=True); the errors. Every result is
checked bit for bit against tpar's CPU path of the op and across ranks. Each rank runs
cuda_fused_worker.py.

Part of the GPU suite (conftest.py: skipped, with the reason, where torch or a GPU is missing;
test_cpu_fused.py covers the op on the CPU backend there).
"""

import os

import pytest
from jobs import run_worker

WORKER = os.path.join(os.path.dirname(__file__), "cuda_fused_worker.py")


def digests_agree(results, *steps):
    seen = set()
    for rank, (code, out) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        for step in steps:
            assert f"ok {step}" in out, f"rank {rank} did not pass {step}:\n{out}"
        lines = [line for line in out.splitlines() if line.startswith("DIGEST")]
        assert lines, out
        seen.add(lines[-1])
    assert len(seen) == 1, f"ranks got different bits: {seen}"
    print(results[0][1])


@pytest.mark.parametrize("n", [2, 4])
def test_fused_op_eager_graph_and_compiled_match_the_cpu_path_bitwise_on_every_rank(n, gpu_out):
    steps = ["eager", "graph", "compile-inductor"]
    digests_agree(
        run_worker(n, WORKER, {"steps": steps}, gpu_out), "eager", "graph", "compile inductor"
    )


def test_fused_op_errors_name_the_problem(gpu_out):
    digests_agree(run_worker(2, WORKER, {"steps": ["errors"]}, gpu_out), "errors")
