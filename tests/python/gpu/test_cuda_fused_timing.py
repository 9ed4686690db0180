"""The fused allreduce + residual add + RMSNorm from Python, timed (fused_op_timing.py): eager and
in a graph chain, against tpar's allreduce followed by torch's norm and the allreduce alone, 2
ranks as processes on GPU 0. The test holds what the run must show (each rank's fused result
bitwise tpar's CPU path, every op timed, the fused op's decision reported); the figures stay in
the test's folder as fused-py.json, for bench/README.md, not for a pass/fail threshold.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jobs import OUTER, run_logged

SCRIPT = Path(__file__).resolve().parent / "fused_op_timing.py"
OPS = {"fused_add_rms_norm", "all_reduce + torch norm", "all_reduce alone"}


def test_fused_op_from_python_is_checked_then_timed(gpu_out):
    env = {k: v for k, v in os.environ.items() if k not in OUTER}
    env.update(OUT=str(gpu_out), CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", "0"))
    command = [sys.executable, SCRIPT, "--world-size", "2", "--tokens", "1,8"]
    code, text = run_logged(command, gpu_out / "fused-py.log", 300, env=env)
    assert code == 0, text[-6000:]
    report = json.loads((gpu_out / "fused-py.json").read_text())
    rows = report["results"]
    assert {(r["tokens"], r["op"]) for r in rows} == {(t, op) for t in (1, 8) for op in OPS}, rows
    for row in rows:
        assert row["eager_us"] > 0 and row["graph_us_per_op"] > 0, row
        assert row["allreduce"], f"no algorithm reported: {row}"
