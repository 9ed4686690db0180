"""What the Python tests share: starting the ranks of one job (n processes of one program, each
with its RANK and WORLD_SIZE and tpar's rendezvous where asked, their output in one log file per
rank as it is written, so that a job stopped from outside still shows how far every rank got, and
no pipe that a talkative rank could fill; one deadline for all of them, past which every rank
still running is killed with what it started, so that a hung or interrupted test leaves no
process behind; the tagged JSON line each
rank prints at the end), running a command into a log, and skipping (or, on the GPU machine,
failing) where something the test needs is missing. The CPU tests (tests/python) and the GPU
tests (tests/python/gpu, whose conftest puts this folder on the path) both use it."""

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

ROOT = Path(__file__).resolve().parents[2]
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


def job_env(n: int, folder: Path, *, env: dict | None = None, rendezvous: bool = True) -> dict:
    """The environment every rank of a job of `n` shares (each adds its RANK): this process's,
    less an outer job's variables (OUTER), with the job's WORLD_SIZE, a STORE file in `folder`
    for torch.distributed's file:// init and, with `rendezvous`, tpar's rank environment
    (TPAR_RENDEZVOUS in `folder`, a fresh TPAR_JOB_TOKEN) and a MASTER_ADDR/MASTER_PORT for
    env:// init; then `env` laid over it, where a variable given as None is taken out."""
    common = {k: v for k, v in os.environ.items() if k not in OUTER}
    common.update(
        WORLD_SIZE=str(n),
        NCCL_NVLS_ENABLE="0",
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
        PYTHONUNBUFFERED="1",
        TORCHINDUCTOR_COMPILE_THREADS="1",
        STORE=str(Path(folder) / "store"),
    )
    if rendezvous:
        common.update(
            TPAR_RENDEZVOUS=str(Path(folder) / "rdv"),
            TPAR_JOB_TOKEN=secrets.token_hex(16),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    common.update(env or {})
    return {k: v for k, v in common.items() if v is not None}


def run_ranks(
    n: int,
    argv: list[str],
    *,
    timeout: float,
    log_dir: Path | None = None,
    tag: str = "job",
    env: dict | None = None,
    rendezvous: bool = True,
    tmp: Path | None = None,
    apart: bool = False,
) -> list[tuple]:
    """Runs `argv` as ranks 0..n-1 of one job; returns each rank's (exit code, output), or with
    `apart` its (exit code, stdout, stderr). With `rendezvous`, the ranks get a private
    TPAR_RENDEZVOUS and TPAR_JOB_TOKEN (tpar's rank environment) and a MASTER_ADDR/MASTER_PORT
    for torch.distributed's env:// init; STORE names a file for a file:// init either way
    (`job_env`, with `env` laid over it). The rendezvous folder and the store are in `tmp` (a
    test's tmp_path, to look at after), else in a temporary folder removed at the end; the
    logs (`tag`-rank`r`.log, or .out and .err) are in `log_dir`, else beside them."""
    with tempfile.TemporaryDirectory(prefix="tpar-test-job-") as scratch:
        folder = Path(tmp if tmp is not None else scratch)
        log_dir = Path(log_dir if log_dir is not None else folder)
        log_dir.mkdir(parents=True, exist_ok=True)
        common = job_env(n, folder, env=env, rendezvous=rendezvous)
        streams = ("out", "err") if apart else ("log",)
        files = [[open(log_dir / f"{tag}-rank{r}.{s}", "w+") for s in streams] for r in range(n)]
        # Each rank leads a process group of its own, so that killing it kills what it started
        # (torch's compile workers, a launcher's children) too. A Ctrl-C at the terminal then
        # reaches only the test, which kills every group still running on its way out.
        procs = []
        try:
            for r, f in enumerate(files):
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=dict(common, RANK=str(r)),
                        stdout=f[0],
                        stderr=f[-1] if apart else subprocess.STDOUT,
                        text=True,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout
            results = []
            for p, f in zip(procs, files, strict=True):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                    note = ""
                except subprocess.TimeoutExpired:
                    kill_group(p)
                    note = f"\n(killed: the test's time limit of {timeout:.0f} s)"
                texts = []
                for stream in f:
                    stream.seek(0)
                    texts.append(stream.read())
                    stream.close()
                texts[-1] += note
                results.append((p.returncode, *texts))
            return results
        finally:
            for p in procs:
                kill_group(p)


def kill_group(proc: subprocess.Popen) -> None:
    """Kills the process group `proc` leads (started with start_new_session) and reaps `proc`;
    a no-op once the group is gone."""
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def run_program(n: int, program: str, task, *, timeout: float, **options):
    """Runs the Python program `program` as the n ranks of one tpar job, each with `task` as
    JSON in argv[1]; returns each rank's (code, output). `options` are run_ranks' (env, tmp)."""
    return run_ranks(
        n, [sys.executable, "-c", program, json.dumps(task)], timeout=timeout, **options
    )


def run_python_ranks(
    n: int, code: str, *, timeout: float, env: dict | None = None, path=()
) -> list[tuple[list[str], str]]:
    """Runs the Python program `code` as the n ranks of a job whose ranks meet through their
    own torch.distributed group (an engine's way: STORE names its file, no tpar rendezvous),
    with the folders `path` ahead of PYTHONPATH; fails the test where a rank exits other than
    0, else returns each rank's (stdout lines, stderr)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pythonpath = os.pathsep.join([*map(str, path), *inherited]) or None
    results = run_ranks(
        n,
        [sys.executable, "-c", code],
        timeout=timeout,
        env={**(env or {}), "PYTHONPATH": pythonpath},
        rendezvous=False,
        apart=True,
    )
    for rank, (status, out, err) in enumerate(results):
        assert status == 0, f"rank {rank} exited {status}:\n{out[-4000:]}\n{err[-4000:]}"
    return [(out.splitlines(), err) for _, out, err in results]


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


def write_result(path: Path, value: dict) -> None:
    """A GPU test's record (`value`) under the envelope bench/results asks of every JSON file
    (bench/schema/envelope.schema.json), so that a record copied there says where it came
    from: the test that wrote it, the first visible GPU and its driver (nvidia-smi), the date
    and the commit (TPAR_COMMIT, which scripts/gpu-check.sh exports, else the binary's
    `--version`). Keys of `value` win over the envelope's."""
    gpu, driver = "unknown", None
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        first = next((line for line in text.splitlines() if line.strip()), "")
        if "," in first:
            gpu, driver = (part.strip() for part in first.split(",", 1))
    except (OSError, subprocess.SubprocessError):
        pass
    commit = os.environ.get("TPAR_COMMIT")
    if not commit and os.environ.get("TPAR_BIN"):
        try:
            commit = subprocess.run(
                [os.environ["TPAR_BIN"], "--version"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = None
    envelope = {
        # "tests/python/gpu/test_x.py::test_y[case] (call)": the test, without pytest's phase.
        "command": os.environ.get("PYTEST_CURRENT_TEST", " ".join(sys.argv)).removesuffix(
            " (call)"
        ),
        "device": gpu,
        "driver": driver,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit or "unknown",
    }
    write_json(path, {**envelope, **value})


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
            kill_group(proc)
            code = proc.returncode
            out.write(f"\n(killed after {timeout:.0f} s: the test's time limit)\n")
        finally:
            kill_group(proc)
        out.write(f"\n(exit {code} after {time.monotonic() - start:.1f} s)\n")
        out.seek(0)
        return code, out.read()
