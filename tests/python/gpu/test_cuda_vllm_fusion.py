"""tpar's vLLM fusion pass (``tpar.engines.vllm_fusion``) on GPUs, with vLLM 0.33.0's own code:
two ranks (one GPU each where there are two, else both on GPU 0), each running
vllm_fusion_rank.py. Per case (bf16, tokens x hidden), checked: the pattern matched on both
ranks; the rewritten graph called tpar's fused op and not vLLM's allreduce (over tpar's
max_size: the other way round); ``residual_out`` bitwise the unfused graph's; the norm within
two bf16 roundings; both ranks the same bits; the Inductor-compiled layer the same as the
rewritten graph; a CUDA graph of the rewritten layer replayed gives the eager bits.

Needs vLLM's sources (TPAR_VLLM_SRC: a folder or vllm-src.zip) and the pure-Python imports its
IR needs (TPAR_ENGINE_DEPS): scripts/gpu-check.sh prepares both from .ci/vllm-gpu.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from jobs import engine_pythonpath, rank_reports, run_ranks, write_result

RANK = str(Path(__file__).resolve().parent / "vllm_fusion_rank.py")
CASES = [(1, 8192), (8, 8192), (64, 4096), (5, 5120)]


@pytest.mark.parametrize(
    "label, max_size, cases",
    [("tpar", 8 << 20, CASES), ("over-max-size", 4 << 10, CASES[:1])],
    ids=["tpar", "over-max-size"],
)
def test_vllm_fusion_pass_on_gpus(label, max_size, cases, gpu_out):
    _, path = engine_pythonpath("TPAR_VLLM_SRC", "vllm", "vllm/ir/ops/__init__.py")
    env = {
        "PYTHONPATH": path,
        "MAX_SIZE": str(max_size),
        "CASES": json.dumps(cases),
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"tpar-inductor-{label}"),
    }
    results = run_ranks(
        2,
        [sys.executable, RANK],
        log_dir=gpu_out,
        tag=f"vllm-fusion-{label}",
        timeout=240,
        env=env,
        rendezvous=False,
    )
    ranks = rank_reports(results, "ROWS")
    write_result(gpu_out / "vllm-fusion.json", {label: ranks})
    assert [len(rows) for rows in ranks] == [len(cases)] * 2, ranks
    for row0, row1 in zip(*ranks, strict=True):
        case = f"{row0['tokens']} x {row0['hidden']}"
        assert row0["path"] == ("tpar" if label == "tpar" else "fallback"), (case, row0)
        assert row0["matched"] == 1 and row1["matched"] == 1, (case, row0, row1)
        want = (1, 0) if row0["path"] == "tpar" else (0, 1)
        assert (row0["fused_calls"], row0["vllm_allreduces"]) == want, (case, row0)
        assert row0["residual_bitwise"] and row1["residual_bitwise"], (case, row0, row1)
        assert row0["norm_ok"] and row1["norm_ok"], (case, row0, row1)
        assert row0["digest"] == row1["digest"], f"{case}: the ranks got different bits"
        assert row0["inductor"] and row1["inductor"], (case, row0, row1)
        assert row0.get("graph_replay", True) and row1.get("graph_replay", True), (case, row0)
