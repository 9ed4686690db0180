"""The `tpar` binary and the Rust span tests on GPUs: every CUDA path of the command once, each
checked by what it must say (exit status, "0 failed", every timed row verified), its log and JSON
kept in the test's folder. Ranks share GPU 0 as threads of one process (`-n N`) or as processes
(`--processes`); the `gpus(n)` tests give each rank a GPU of its own and skip on a smaller
machine.

No cargo on the GPU machine: the binaries come prebuilt (scripts/gpu-check.sh --prepare), named
by TPAR_BIN and TPAR_CUDA_SPANS.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from jobs import ROOT, run_logged

MODELS = ROOT / "crates" / "tpar-harness" / "fixtures" / "models"


def tpar(binary, args, out, name, timeout=180, **env):
    """Runs `tpar args...` with its log in out/name.log; returns its output (the test fails on
    a non-zero exit, showing the output's end)."""
    code, text = run_logged(
        [binary, *args], out / f"{name}.log", timeout, env=dict(os.environ, **env)
    )
    assert code == 0, f"tpar {' '.join(map(str, args))} exited {code}:\n{text[-6000:]}"
    return text


def selftest_passed(text):
    found = re.findall(r"^selftest: (\d+) passed, (\d+) failed", text, re.M)
    assert found, f"no `selftest: N passed, M failed` line:\n{text[-4000:]}"
    passed, failed = map(int, found[-1])
    assert failed == 0 and passed > 0, found[-1]
    return passed


def provenance(report):
    for key in ("command", "device", "date", "commit"):
        assert report.get(key), f"the JSON has no {key}: {sorted(report)}"


def bench_rows_verified(path, algos=None):
    """A `tpar bench --json` file: provenance, and each row timed and correct or skipped with
    a reason (never a timed row that failed its check)."""
    report = json.loads(path.read_text())
    provenance(report)
    rows = report["results"]
    assert rows, report
    for row in rows:
        if row.get("skipped"):
            assert row["p50_us"] is None and row["correct"] is None, row
        else:
            assert row["correct"] is True and row["p50_us"] > 0, row
    if algos:
        assert {row["algo"] for row in rows} == set(algos), rows
        assert any(not row.get("skipped") for row in rows), rows
    return rows


# ---------------------------------------------------------------------------------------------
# Rust


def test_rust_span_tests(cuda_spans_bin, gpu_out):
    """crates/tpar/tests/cuda_spans.rs, ignored by `cargo test` (no GPU there), run here."""
    code, text = run_logged(
        [cuda_spans_bin, "--ignored", "--test-threads=1"], gpu_out / "cuda_spans.log", 300
    )
    assert code == 0, text[-6000:]
    result = re.findall(r"test result: ok\. (\d+) passed; (\d+) failed", text)
    assert result and int(result[-1][0]) >= 3 and result[-1][1] == "0", text[-3000:]


# ---------------------------------------------------------------------------------------------
# selftest


@pytest.mark.parametrize(
    "n, extra",
    [
        (1, ["--counts", "0,7,4099,70001"]),
        (2, ["--counts", "0,7,4099,1048579"]),
        (8, ["--counts", "0,7,4099", "--dtypes", "bf16"]),
    ],
    ids=["1", "2", "8"],
)
def test_selftest_ranks_as_threads(tpar_bin, gpu_out, n, extra):
    args = ["selftest", "--backend", "cuda", "-n", str(n), *extra, "--replays", "20"]
    text = tpar(tpar_bin, args, gpu_out, f"selftest-threads-{n}", timeout=240)
    selftest_passed(text)
    if n > 1:
        # The fused op's rows and the failure cases run too.
        assert re.search(r"^fused one-shot .*pass", text, re.M), "no fused one-shot rows"
        assert "peer timeout" in text and "mismatch" in text, "no failure-case rows"


@pytest.mark.parametrize("n", [2, 3])
def test_selftest_ranks_as_processes(tpar_bin, gpu_out, n):
    args = ["selftest", "--backend", "cuda", "-n", str(n), "--processes"]
    args += ["--counts", "0,7,4099,65541", "--replays", "20"]
    selftest_passed(tpar(tpar_bin, args, gpu_out, f"selftest-processes-{n}", timeout=180))


@pytest.mark.gpus(2)
def test_selftest_one_process_per_gpu(tpar_bin, gpu_out, gpu_count):
    args = ["selftest", "--backend", "cuda", "-n", str(gpu_count), "--processes"]
    args += ["--counts", "0,7,4099,65541", "--replays", "20"]
    selftest_passed(tpar(tpar_bin, args, gpu_out, f"selftest-{gpu_count}-gpus", timeout=240))


# ---------------------------------------------------------------------------------------------
# bench


def test_bench_threads_json_and_plot(tpar_bin, gpu_out):
    json_path, plot = gpu_out / "bench-2.json", gpu_out / "bench-2.svg"
    args = ["bench", "--backend", "cuda", "-n", "2", "--sizes", "0,4K,42K,1M"]
    args += ["--iters", "20", "--chain", "20", "--json", json_path, "--plot", plot]
    tpar(tpar_bin, args, gpu_out, "bench-threads-2")
    rows = bench_rows_verified(json_path)
    assert {"one-shot", "two-shot", "host-staged"} <= {r["algo"] for r in rows}, rows
    assert plot.read_text().lstrip().startswith("<svg"), "the plot is not an SVG"


def test_bench_processes_with_nccl_skipped_on_a_shared_gpu(tpar_bin, gpu_out, gpu_count):
    json_path = gpu_out / "bench-processes-2.json"
    args = ["bench", "--backend", "cuda", "-n", "2", "--processes", "--sizes", "4K,256K"]
    args += ["--algos", "one-shot,nccl,auto", "--iters", "20", "--chain", "20"]
    tpar(tpar_bin, [*args, "--json", json_path], gpu_out, "bench-processes-2", timeout=240)
    rows = bench_rows_verified(json_path, ["one-shot", "nccl", "auto"])
    nccl = [r for r in rows if r["algo"] == "nccl"]
    if gpu_count < 2:
        assert all(r.get("skipped") for r in nccl), nccl
    for row in rows:
        if row["algo"] == "auto" and not row.get("skipped"):
            assert row.get("runs"), f"an auto row says what it ran: {row}"


def test_forced_algorithm_steers_auto(tpar_bin, gpu_out):
    json_path = gpu_out / "bench-forced-host-staged.json"
    args = ["bench", "--backend", "cuda", "-n", "2", "--sizes", "4K,42K", "--algos", "auto"]
    text = tpar(
        tpar_bin,
        [*args, "--iters", "20", "--json", json_path],
        gpu_out,
        "bench-forced",
        TPAR_ALGO="host-staged",
    )
    assert "TPAR_ALGO=host-staged" in text, text[-2000:]
    rows = bench_rows_verified(json_path, ["auto"])
    assert all(r.get("runs") == "host-staged" for r in rows), rows


def test_bench_auto_measures_at_first_use_as_an_engine_would(tpar_bin, gpu_out, tmp_path):
    """Ranks as threads on a machine with no table: the bench makes the first-use measurement
    an engine's communicator makes, caches it, and says why auto ran what it ran; the next run
    reads the cached table; with TPAR_FIRST_USE=0 the fabric model decides and says so."""
    cache = {"TPAR_CACHE_DIR": str(tmp_path / "cache")}
    args = ["bench", "--backend", "cuda", "-n", "8", "--sizes", "4K,64K", "--algos", "auto"]
    args += ["--iters", "10", "--chain", "10"]

    def bench(name, **env):
        json_path = gpu_out / f"{name}.json"
        text = tpar(tpar_bin, [*args, "--json", json_path], gpu_out, name, **env)
        assert "auto at each size, and why:" in text, text[-3000:]
        report = json.loads(json_path.read_text())
        rows = bench_rows_verified(json_path, ["auto"])
        assert all(r.get("runs") and r.get("why") for r in rows), rows
        return report, rows

    first, rows = bench("bench-auto-first-use", **cache)
    assert "candidates timed in" in first.get("first_use", ""), first
    # Both sizes are within 4x of a probed size: the measurement decides there (a choice the
    # model put far behind, not timed, must not win because its rivals were timed).
    assert all("corrected by the first-use measurement" in r["why"] for r in rows), rows
    assert list((tmp_path / "cache").rglob("*first-use*.json")), "no cached first-use table"

    again, rows = bench("bench-auto-cached", **cache)
    assert "first_use" not in again, again["first_use"]
    assert all("corrected by the first-use measurement" in r["why"] for r in rows), rows

    off, rows = bench("bench-auto-model", TPAR_FIRST_USE="0", TPAR_CACHE_DIR=str(tmp_path / "none"))
    assert "first_use" not in off, off["first_use"]
    assert all("no tuning table" in r["why"] for r in rows), rows


@pytest.mark.gpus(2)
def test_bench_one_process_per_gpu_against_nccl(tpar_bin, gpu_out, gpu_count):
    json_path = gpu_out / f"bench-{gpu_count}-gpus.json"
    algos = ["one-shot", "two-shot", "host-staged", "nccl", "auto"]
    args = ["bench", "--backend", "cuda", "-n", str(gpu_count), "--processes"]
    args += ["--algos", ",".join(algos), "--sizes", "4K,42K,256K,4M", "--iters", "30"]
    tpar(tpar_bin, [*args, "--json", json_path], gpu_out, "bench-gpus", timeout=300)
    rows = bench_rows_verified(json_path, algos)
    assert all(not r.get("skipped") for r in rows if r["algo"] == "nccl"), rows


def test_bench_anatomy(tpar_bin, gpu_out):
    json_path = gpu_out / "anatomy-2.json"
    tpar(tpar_bin, ["bench", "--anatomy", "-n", "2", "--iters", "10", "--json", json_path],
         gpu_out, "anatomy-2")  # fmt: skip
    report = json.loads(json_path.read_text())
    provenance(report)
    assert report["rows"] and all(r["p50_us"] > 0 for r in report["rows"]), report["rows"][:3]


def test_bench_fused(tpar_bin, gpu_out):
    json_path = gpu_out / "fused-2.json"
    args = ["bench", "--fused", "-n", "2", "--iters", "20", "--chain", "20", "--json", json_path]
    tpar(tpar_bin, args, gpu_out, "fused-2")
    report = json.loads(json_path.read_text())
    provenance(report)
    assert report["errors"] == [], report["errors"]
    assert report["rows"] and not [r for r in report["rows"] if r.get("correct") is False]


@pytest.mark.parametrize("model", ["llama-3.1-70b", "deepseek-v3"])
def test_bench_step(tpar_bin, gpu_out, model):
    json_path = gpu_out / f"step-{model}.json"
    args = ["bench", "step", "--config", MODELS / f"{model}.json", "-n", "2", "--layers", "2"]
    tpar(tpar_bin, [*args, "--replays", "3", "--json", json_path], gpu_out, f"step-{model}")
    report = json.loads(json_path.read_text())
    provenance(report)
    rows = report["results"]
    assert any(r["reduce"].startswith("none") for r in rows), rows
    for row in rows:
        assert row.get("skipped") or row["pass_p50_us"] > 0, row


@pytest.mark.gpus(2)
def test_bench_step_one_process_per_gpu(tpar_bin, gpu_out, gpu_count):
    json_path = gpu_out / f"step-tp{gpu_count}.json"
    args = ["bench", "step", "--config", MODELS / "llama-3.1-70b.json", "--tp", str(gpu_count)]
    args += ["--tokens", "4", "--layers", "8", "--processes", "--json", json_path]
    tpar(tpar_bin, args, gpu_out, "step-gpus", timeout=240)
    rows = json.loads(json_path.read_text())["results"]
    assert any(r["reduce"] == "nccl" and not r.get("skipped") for r in rows), rows


# ---------------------------------------------------------------------------------------------
# doctor and tune


def test_doctor_text_and_json(tpar_bin, gpu_out):
    text = tpar(tpar_bin, ["doctor"], gpu_out, "doctor")
    assert "NVRTC" in text, text[-3000:]
    done = subprocess.run(
        [tpar_bin, "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    (gpu_out / "doctor.json").write_text(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True, done.stdout[:3000]


def test_tune_writes_a_table_that_doctor_then_uses(tpar_bin, gpu_out, tmp_path):
    cache = {"TPAR_CACHE_DIR": str(tmp_path / "cache")}
    json_path = gpu_out / "tune-1.json"
    args = ["tune", "-n", "1", "--sizes", "4K,64K,1M", "--iters", "10", "--json", json_path]
    tpar(tpar_bin, args, gpu_out, "tune-1", timeout=240, **cache)
    report = json.loads(json_path.read_text())
    assert report["table"]["entries"], report
    assert all(m["correct"] for m in report["measurements"] if not m.get("skipped")), report
    text = tpar(tpar_bin, ["doctor", "-n", "1"], gpu_out, "doctor-tuned", **cache)
    assert "tuning table" in text, text[-3000:]
