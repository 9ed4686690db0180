"""SGLang's CUDA fused allreduce + residual + RMSNorm entry landing in tpar's fused kernel, on
GPUs, with SGLang 0.5.23's own code (sglang_fusion_rank.py is each rank; two ranks sharing GPU 0,
or one GPU each). Checked per case (bf16, hidden 8192 and 5120, 1 and 8 tokens): tpar's hooks
replaced SGLang's entry and gate, and SGLang's own gate says no where tpar's says yes; one call
of tpar's op and none of SGLang's allreduce or norm; tpar's decision runs it in the fused kernel;
``residual_out`` bitwise the fp32 sum rounded once plus the residual rounded once, the norm
within two bf16 roundings; the inputs unchanged; both ranks the same bits; the same call
captured in a CUDA graph inside SGLang's ``graph_capture`` and replayed with new data, checked
the same way. A call tpar declines (an fp32 weight beside bf16) runs SGLang's allreduce + norm
with the right result.

Needs SGLang's sources (TPAR_SGLANG_SRC) and its pure-Python imports (TPAR_ENGINE_DEPS):
scripts/gpu-check.sh prepares both from .ci/engines-gpu.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from jobs import engine_pythonpath, rank_reports, run_ranks, write_result

HERE = Path(__file__).resolve().parent
CASES = [(1, 8192), (8, 8192), (1, 5120), (8, 5120)]
REPLAYS = 3


def run_fusion(out, per_gpu):
    source, path = engine_pythonpath(
        "TPAR_SGLANG_SRC", "sglang", "sglang/srt/layers/flashinfer_comm_fusion.py"
    )
    env = {
        # tests/python holds sglang_fusion_standin.py.
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), path]),
        "CASES": json.dumps(CASES),
        "SGLANG_ROOT": str(source),
        "PER_GPU": "1" if per_gpu else "0",
        "REPLAYS": str(REPLAYS),
    }
    if not per_gpu:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    results = run_ranks(
        2,
        [sys.executable, str(HERE / "sglang_fusion_rank.py")],
        log_dir=out,
        tag="sglang-fusion",
        timeout=240,
        env=env,
        rendezvous=False,
    )
    reports = rank_reports(results, "REPORT")
    write_result(out / "sglang-fusion.json", {"ranks": reports})
    return reports


def assert_fused_in_tpar(reports):
    for report in reports:
        assert "error" not in report, report["error"]
    r0, r1 = reports
    assert r0["entry_is_tpar"] and r0["gate_is_tpar"], r0
    assert r0["gate"] == {"sglang": False, "tpar": True}, r0["gate"]
    assert len(r0["rows"]) == len(CASES) and len(r1["rows"]) == len(CASES)
    for a, b in zip(r0["rows"], r1["rows"], strict=True):
        case = f"{a['tokens']} x {a['hidden']}"
        assert "error" not in a and "error" not in b, (case, a, b)
        for row in (a, b):
            calls = (row["tpar_calls"], row["sglang_allreduces"], row["norm_forwards"])
            assert calls == (1, 0, 0), f"{case}: tpar, SGLang allreduce, norm calls {calls}"
            assert row["residual_bitwise"] and row["norm_ok"], (case, row)
            assert row["inputs_unchanged"], (case, row)
            assert "graph_error" not in row, (case, row["graph_error"])
            assert row["graph_ok"] and row["graph_tpar_calls"] == 2, (case, row)
        assert a["decision"].endswith(" fused"), f"{case}: tpar ran {a['decision']}"
        assert a["digest"] == b["digest"], f"{case}: the ranks got different bits"
        for i in range(REPLAYS):
            assert a[f"graph_digest_{i}"] == b[f"graph_digest_{i}"], (case, i)
    for decline in (r0["decline"], r1["decline"]):
        calls = (decline["tpar_calls"], decline["sglang_allreduces"], decline["norm_forwards"])
        assert calls == (0, 1, 1), f"decline: tpar, SGLang allreduce, norm calls {calls}"
        assert decline["residual_bitwise"] and decline["norm_ok"], decline
    assert r0["decline"]["digest"] == r1["decline"]["digest"]


def test_sglang_fused_entry_runs_tpars_kernel_with_ranks_sharing_a_gpu(gpu_out):
    assert_fused_in_tpar(run_fusion(gpu_out, per_gpu=False))


@pytest.mark.gpus(2)
def test_sglang_fused_entry_runs_tpars_kernel_with_a_gpu_per_rank(gpu_out):
    assert_fused_in_tpar(run_fusion(gpu_out, per_gpu=True))
