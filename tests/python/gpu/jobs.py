"""What the GPU tests share: starting the ranks of one job (n processes of one program, each with
its RANK and WORLD_SIZE and tpar's rendezvous where asked, their output in one log file per rank
as it is written, so that a job stopped from outside still shows how far every rank got; one
deadline for all of them; the tagged JSON line each rank prints at the end), running a command
into a log, and skipping (or, on the GPU machine, failing) where something the test needs is
missing."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# Set by scripts/gpu-check.sh on the GPU machine: what would skip fails instead.
REQUIRED = os.environ.get("TPAR_GPU_REQUIRED") == "1"

# Variables of an outer job that must not leak into the ranks started here.
OUTER = ("TPAR_RENDEZVOUS", "TPAR_JOB_TOKEN", "RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")


def missing(why: str):
    """Skips the calling test naming `why`, or fails it on the GPU machine (TPAR_GPU_REQUIRED=1)."""
    if REQUIRED:
        pytest.fail(f"TPAR_GPU_REQUIRED is set but {why}", pytrace=False)
    pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    n: int,
    argv: list[str],
    *,
    log_dir: Path,
    tag: str,
    timeout: float,
    env: dict | None = None,
    rendezvous: bool = True,
) -> list[tuple[int, str]]:
    """Runs `argv` as ranks 0..n-1 of one job; returns each rank's (exit code, output). With
    `rendezvous`, the ranks get a private TPAR_RENDEZVOUS and TPAR_JOB_TOKEN (tpar's rank
    environment) and a MASTER_ADDR/MASTER_PORT for torch.distributed's env:// init."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tpar-gpu-job-") as tmp:
        common = {k: v for k, v in os.environ.items() if k not in OUTER}
        common.update(
            WORLD_SIZE=str(n),
            NCCL_NVLS_ENABLE="0",
            TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
            PYTHONUNBUFFERED="1",
            TORCHINDUCTOR_COMPILE_THREADS="1",
            STORE=os.path.join(tmp, "store"),
        )
        if rendezvous:
            common.update(
                TPAR_RENDEZVOUS=os.path.join(tmp, "rdv"),
                TPAR_JOB_TOKEN=secrets.token_hex(16),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()),
            )
        common.update(env or {})
        files = [open(log_dir / f"{tag}-rank{r}.log", "w+") for r in range(n)]
        procs = [
            subprocess.Popen(
                argv,
                env=dict(common, RANK=str(r)),
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r, f in enumerate(files)
        ]
        deadline = time.monotonic() + timeout
        results = []
        for p, f in zip(procs, files, strict=True):
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
                note = ""
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                note = f"\n(killed: the test's time limit of {timeout:.0f} s)"
            f.seek(0)
            results.append((p.returncode, f.read() + note))
            f.close()
        return results


def run_worker(n: int, worker: str, task: dict, log_dir: Path, timeout: float = 600):
    """Runs the worker script `worker` (cuda_worker.py, cuda_fused_worker.py) as the n ranks of
    one job on `task` (its argv[1], as JSON); returns their (code, output)."""
    tag = f"{task.get('kind', '-'.join(task.get('steps', [])))}-n{n}"
    argv = [sys.executable, worker, json.dumps(task)]
    return run_ranks(n, argv, log_dir=log_dir, tag=tag, timeout=timeout)


def tagged_json(output: str, tag: str):
    """The JSON after the last line starting with `tag` + a space, or None."""
    lines = [line for line in output.splitlines() if line.startswith(tag + " ")]
    return json.loads(lines[-1][len(tag) + 1 :]) if lines else None


def rank_reports(results, tag: str) -> list[dict]:
    """Each rank's tagged JSON; a rank that printed none fails the test with its output."""
    reports = []
    for rank, (code, out) in enumerate(results):
        report = tagged_json(out, tag)
        assert report is not None, (
            f"rank {rank} (exit {code}) printed no {tag} line:\n{out[-4000:]}"
        )
        reports.append(report)
    return reports


def write_json(path: Path, value) -> None:
    Path(path).write_text(json.dumps(value, indent=1))


def engine_pythonpath(variable: str, engine: str, marker: str) -> tuple[Path, str]:
    """The engine's Python sources named by `variable` (a folder, or a zip unpacked once into
    the temporary folder), holding `marker`, and the PYTHONPATH that puts them, the engine's
    pure-Python imports (TPAR_ENGINE_DEPS: the folder scripts/gpu-check.sh installs them into)
    and this process's path in that order; skips saying how to prepare them."""
    given = os.environ.get(variable)
    how = (
        f"set {variable} to {engine}'s sources (scripts/gpu-check.sh does, from the bundle "
        "that `scripts/gpu-check.sh --prepare-engines` builds)"
    )
    if not given:
        missing(f"{variable} is not set: {how}")
    path = Path(given)
    if path.suffix == ".zip" and path.is_file():
        stat = path.stat()  # one folder per zip, so that a changed bundle is unpacked again
        target = Path(tempfile.gettempdir()) / f"tpar-{engine}-{stat.st_size}-{stat.st_mtime_ns}"
        if not (target / marker).is_file():
            shutil.rmtree(target, ignore_errors=True)
            with zipfile.ZipFile(path) as archive:
                archive.extractall(target)
        path = target
    if not (path / marker).is_file():
        missing(f"no {marker} under {path}: {how}")
    parts = [str(path), os.environ.get("TPAR_ENGINE_DEPS", ""), os.environ.get("PYTHONPATH", "")]
    return path, os.pathsep.join(p for p in parts if p)


def run_logged(command, log: Path, timeout: float, env=None) -> tuple[int, str]:
    """Runs `command`, its output into `log` as it goes; returns (exit code, output). A command
    past `timeout` is killed with everything it started, and the log says so."""
    start = time.monotonic()
    with open(log, "w+") as out:
        out.write("$ " + " ".join(map(str, command)) + "\n")
        out.flush()
        proc = subprocess.Popen(
            list(map(str, command)),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code = proc.wait()
            out.write(f"\n(killed after {timeout:.0f} s: the test's time limit)\n")
        out.write(f"\n(exit {code} after {time.monotonic() - start:.1f} s)\n")
        out.seek(0)
        return code, out.read()
