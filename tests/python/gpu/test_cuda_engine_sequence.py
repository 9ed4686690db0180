"""tpar.engines under vLLM's and SGLang's calling sequence for their custom allreduce, on GPUs
(engine_sequence.py is each rank): the plugin's class built as the engine builds it, every size
from a decode step's 1 KiB to over the engines' 8 MiB max_size through the engine's out-of-place
op (tpar where it takes the size, the engine's fallback elsewhere), then the engine's graph
capture and replays with new data; every result bitwise the known sum.

vLLM's sequence needs no vLLM (a stand-in module takes the plugin's class); SGLang's runs
SGLang 0.5.23's own GroupCoordinator and needs its sources (TPAR_SGLANG_SRC) and its
pure-Python imports (TPAR_ENGINE_DEPS), which scripts/gpu-check.sh prepares from .ci/engines-gpu.
Ranks share GPU 0, or (`gpus(2)`) get one GPU each, where the engine's NCCL fallback runs too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from jobs import engine_pythonpath, rank_reports, run_ranks, write_result

RANK = str(Path(__file__).resolve().parent / "engine_sequence.py")


def run_sequence(tp, out, sglang=False, shared=True):
    env = {"CUDA_VISIBLE_DEVICES": "0"} if shared else {}
    if sglang:
        _, env["PYTHONPATH"] = engine_pythonpath(
            "TPAR_SGLANG_SRC", "sglang", "sglang/srt/plugins/__init__.py"
        )
    name = f"{'sglang' if sglang else 'vllm'}-tp{tp}"
    argv = [sys.executable, RANK] + (["--sglang"] if sglang else [])
    results = run_ranks(tp, argv, log_dir=out, tag=name, timeout=200, env=env, rendezvous=False)
    reports = rank_reports(results, "REPORT")
    write_result(out / f"{name}.json", {"world_size": tp, "sequence": name, "ranks": reports})
    return reports


def assert_every_size_right(reports, sglang):
    for r in reports:
        assert "error" not in r and not r.get("disabled"), r
        assert r["ranks_agree"], "the ranks took different sizes for tpar"
        assert r["graph_error"] is None, r["graph_error"]
    rows = [r["rows"] for r in reports]
    for i, row in enumerate(rows[0]):
        per_rank = [ranks[i] for ranks in rows]
        assert all(x["eager_ok"] for x in per_rank), per_rank
        graph = [x["graph_ok"] for x in per_rank]
        assert all(g is None for g in graph) or all(graph), per_rank
        print(f"{row['dtype']:9} {row['bytes']:>9} {row['runs']:28} graph {graph[0]}")
    # The sizes up to tpar's max_size ran on tpar, in the graph too.
    small = [row for row in rows[0] if row["bytes"] <= 64 << 10]
    assert small and all(row["graph_ok"] for row in small), small
    if sglang:
        assert all(row["runs"] == "ca (tpar x3)" for row in small), small
    else:
        assert all(row["runs"] != "the engine's fallback" for row in small), small


@pytest.mark.parametrize("tp", [2, 4])
def test_vllm_sequence_with_ranks_sharing_a_gpu(tp, gpu_out):
    assert_every_size_right(run_sequence(tp, gpu_out), sglang=False)


@pytest.mark.gpus(2)
def test_vllm_sequence_with_a_gpu_per_rank(gpu_out, gpu_count):
    assert_every_size_right(run_sequence(min(gpu_count, 4), gpu_out, shared=False), sglang=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_sglang_sequence_with_ranks_sharing_a_gpu(tp, gpu_out):
    assert_every_size_right(run_sequence(tp, gpu_out, sglang=True), sglang=True)


@pytest.mark.gpus(2)
def test_sglang_sequence_with_a_gpu_per_rank(gpu_out, gpu_count):
    reports = run_sequence(min(gpu_count, 4), gpu_out, sglang=True, shared=False)
    assert_every_size_right(reports, sglang=True)
