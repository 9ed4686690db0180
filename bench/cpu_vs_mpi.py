"""Open MPI's MPI_Allreduce against tpar's CPU backend, on this machine, in one run (issue 27).

For every world size (default 2 and 4 ranks) and dtype (f32 and bf16), over the same sizes
(default 4 KiB to 4 MiB), the script alternates the two peers for a few rounds:

  mpi    Open MPI's MPI_Allreduce, timed by bench/mpi_allreduce.c (compiled here with mpicc)
         the way `tpar bench` times tpar: warm-up calls, then the wall clock around each timed
         call on rank 0, every result checked against the exact sum. f32 is MPI_FLOAT with
         MPI_SUM. MPI has no bf16 type: bf16 travels as MPI_UINT16_T with a user-defined,
         commutative MPI_Op that sums in f32 and rounds to nearest even.
  tpar   `tpar bench --backend cpu` with the CPU algorithms named by --algos.

Each row's p50 and p99 are the medians over the rounds of each round's p50 and p99 (`runs`
lists every round's p50). One JSON file per world size and dtype goes to --out-dir (default
bench/results/), in the schema of `tpar bench --json` (bench/schema/bench.schema.json) with the
MPI rows as algo "mpi"; a table of p50s side by side goes to stdout, with tpar's best
algorithm at each size against MPI.

    python3 bench/cpu_vs_mpi.py
    python3 bench/cpu_vs_mpi.py --ranks 2 --dtypes bf16 --sizes 4K,1M --rounds 5
    python3 bench/cpu_vs_mpi.py --realtime     # both peers under chrt -f 10 (root)

Needs Open MPI (mpirun, mpicc): on Debian or Ubuntu `apt-get install openmpi-bin
libopenmpi-dev`. Builds tpar (`cargo build --release -p tpar-cli`) when target/release/tpar is
missing. Timings move with the machine's load: the load average is printed before and after and
kept in the JSON; compare on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIZES = "4K,8K,16K,32K,64K,128K,256K,512K,1M,2M,4M"
DEFAULT_ALGOS = "one-shot,one-shot-pull,two-shot"
INSTALL_HINT = (
    "Open MPI is not installed (mpirun and mpicc are needed). On Debian or Ubuntu: "
    "apt-get install openmpi-bin libopenmpi-dev; elsewhere install Open MPI with its compiler "
    "wrapper, or put it on PATH."
)


def parse_size(text: str) -> int:
    text = text.strip()
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    scale = units.get(text[-1:].upper(), 1)
    digits = text[:-1] if scale != 1 else text
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"size {text!r} is not a whole number of bytes (e.g. 4K)")
    return int(digits) * scale


def parse_list(text: str, item):
    try:
        return [item(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def human(size: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


# `chrt -f 10` in front of both peers' commands with --realtime.
PREFIX: list[str] = []


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        sys.exit(
            f"cpu_vs_mpi: {' '.join(cmd)} failed with status {done.returncode}:\n"
            f"{done.stdout}{done.stderr}"
        )
    return done


def open_mpi() -> tuple[str, str, str]:
    """mpirun, mpicc and Open MPI's version, or exit with how to install it."""
    mpirun, mpicc = shutil.which("mpirun"), shutil.which("mpicc")
    if not mpirun or not mpicc:
        sys.exit(f"cpu_vs_mpi: {INSTALL_HINT}")
    version = run([mpirun, "--version"]).stdout.splitlines()[0].strip()
    return mpirun, mpicc, version


def tpar_binary(given: str | None) -> str:
    if given:
        return given
    binary = ROOT / "target" / "release" / "tpar"
    if not binary.exists():
        print("cpu_vs_mpi: building tpar (cargo build --release -p tpar-cli)", file=sys.stderr)
        run(["cargo", "build", "--release", "-p", "tpar-cli"], cwd=ROOT)
    return str(binary)


def mpi_round(mpirun, exe, n, dtype, sizes, iters, warmup) -> dict[int, dict]:
    cmd = [*PREFIX, mpirun, "-np", str(n), "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [exe, dtype, str(iters), str(warmup)] + [str(s) for s in sizes]
    rows = [json.loads(line) for line in run(cmd).stdout.splitlines() if line.startswith("{")]
    return {row["bytes"]: row for row in rows}


def tpar_round(tpar, n, dtype, sizes, algos, iters, warmup) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tpar.json"
        cmd = [*PREFIX, tpar, "bench", "--backend", "cpu", "-n", str(n), "--dtype", dtype]
        cmd += ["--sizes", ",".join(str(s) for s in sizes), "--algos", algos]
        cmd += ["--iters", str(iters), "--warmup", str(warmup), "--json", str(out)]
        run(cmd)
        return json.loads(out.read_text())


def bus_bandwidth(size: int, micros: float, n: int) -> float:
    return size / (micros * 1e3) * 2 * (n - 1) / n if micros > 0 else 0.0


def combine(rounds: list[dict], size: int, algo: str, n: int) -> dict:
    """One row from the same (size, algo) of every round: medians of p50 and p99."""
    p50s = [r["p50_us"] for r in rounds]
    p50 = statistics.median(p50s)
    return {
        "bytes": size,
        "algo": algo,
        "p50_us": round(p50, 3),
        "p99_us": round(statistics.median(r["p99_us"] for r in rounds), 3),
        "busbw_gbps": bus_bandwidth(size, p50, n),
        "correct": all(r["correct"] for r in rounds),
        "runs": f"{len(rounds)} runs, p50 of each: " + " / ".join(f"{p:.2f}" for p in p50s),
    }


def compare(args, mpirun, exe, mpi_version, tpar, n, dtype) -> tuple[dict, list[str], int, int]:
    """Both peers at `n` ranks and `dtype`: the report, its table and (sizes won, sizes)."""
    algos = [a.strip() for a in args.algos.split(",")]
    loads = [load_average()]
    mpi_rounds: list[dict[int, dict]] = []
    tpar_rounds: list[dict] = []
    for r in range(args.rounds):
        # Alternate who goes first, so a change of load weighs on both alike.
        peers = ["mpi", "tpar"] if r % 2 == 0 else ["tpar", "mpi"]
        for peer in peers:
            if peer == "mpi":
                mpi_rounds.append(
                    mpi_round(mpirun, exe, n, dtype, args.sizes, args.iters, args.warmup)
                )
            else:
                tpar_rounds.append(
                    tpar_round(tpar, n, dtype, args.sizes, args.algos, args.iters, args.warmup)
                )
    loads.append(load_average())
    first = tpar_rounds[0]
    results = []
    table = []
    won = 0
    header = f"{'size':>8}  {'mpi':>9}  " + "  ".join(f"{a:>13}" for a in algos)
    table.append(header + f"  {'tpar best':>24}  {'best/mpi':>8}")
    for size in args.sizes:
        mpi = combine([m[size] for m in mpi_rounds], size, "mpi", n)
        tpar_rows = {
            a: combine(
                [
                    next(x for x in t["results"] if x["bytes"] == size and x["algo"] == a)
                    for t in tpar_rounds
                ],
                size,
                a,
                n,
            )
            for a in algos
        }
        results.append(mpi)
        results.extend(tpar_rows.values())
        best = min(tpar_rows.values(), key=lambda row: row["p50_us"])
        ratio = best["p50_us"] / mpi["p50_us"]
        won += ratio <= 1.0
        cells = "  ".join(f"{tpar_rows[a]['p50_us']:>13.2f}" for a in algos)
        best_cell = f"{best['p50_us']:.2f} ({best['algo']})"
        table.append(
            f"{human(size):>8}  {mpi['p50_us']:>9.2f}  {cells}  {best_cell:>24}  {ratio:>8.2f}"
        )
    report = {
        "backend": "cpu",
        "world_size": n,
        "dtype": dtype,
        "host": first["host"],
        "device": first["device"],
        "commit": first["commit"],
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join([sys.executable, *sys.argv]),
        "tpar_version": first["tpar_version"],
        "iters": args.iters,
        "warmup": args.warmup,
        "timing": (
            "wall clock per call on rank 0, p50/p99 over the timed calls, for both peers; each "
            f"row: the median over {args.rounds} alternating runs of each run's p50 and p99"
        ),
        "memory_per_rank_bytes": first["memory_per_rank_bytes"],
        "peers": {
            "mpi": (
                f"{mpi_version}: MPI_Allreduce timed by bench/mpi_allreduce.c under "
                f"mpirun -np {n} --oversubscribe (its default binding: a core per rank where "
                "there are enough, else none); "
                + (
                    "MPI_FLOAT with MPI_SUM"
                    if dtype == "f32"
                    else "bf16 as MPI_UINT16_T with a user-defined commutative MPI_Op summing "
                    "in f32 and rounding to nearest even (MPI has no bf16 type)"
                )
            ),
            "tpar": f"tpar bench --backend cpu --algos {args.algos}; binding: {first['binding']}",
        },
        "scheduling": "SCHED_FIFO (chrt -f 10)" if PREFIX else "the default (CFS)",
        "load_average": {"before": loads[0], "after": loads[1]},
        "results": results,
    }
    return report, table, won, len(args.sizes)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    parser.add_argument("--ranks", type=lambda t: parse_list(t, int), default=[2, 4])
    parser.add_argument("--dtypes", type=lambda t: parse_list(t, str), default=["f32", "bf16"])
    parser.add_argument("--sizes", type=lambda t: parse_list(t, parse_size), default=DEFAULT_SIZES)
    parser.add_argument("--algos", default=DEFAULT_ALGOS, help="tpar's CPU algorithms to time")
    parser.add_argument("--iters", type=int, default=200, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls first")
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each peer")
    parser.add_argument("--tpar", help="the tpar binary [default: target/release/tpar]")
    parser.add_argument(
        "--realtime",
        action="store_true",
        help="run both peers under `chrt -f 10` (SCHED_FIFO; needs root): on a machine that "
        "others load, other processes then take the cores only in the kernel's 5%% reserve",
    )
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument(
        "--name", default="", help="file name tag [default: the host name and the date]"
    )
    args = parser.parse_args()
    if isinstance(args.sizes, str):
        args.sizes = parse_list(args.sizes, parse_size)
    for d in args.dtypes:
        if d not in ("f32", "bf16"):
            parser.error(f"--dtypes: {d!r}: the comparison runs f32 and bf16")
    if min(args.ranks) < 2 or args.rounds < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--ranks need at least 2, --rounds and --iters at least 1")

    if args.realtime:
        PREFIX.extend(["chrt", "-f", "10"])
    mpirun, mpicc, mpi_version = open_mpi()
    tpar = tpar_binary(args.tpar)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    tag = args.name or f"{date}-{socket.gethostname().split('.')[0]}"
    print(f"cpu_vs_mpi: {mpi_version}; tpar {tpar}; load average {load_average()}")
    if load_average() > 1:
        print("cpu_vs_mpi: note: the load average is above 1: timings will be noisy")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = str(Path(tmp) / "mpi_allreduce")
        run([mpicc, "-O2", "-o", exe, str(ROOT / "bench" / "mpi_allreduce.c"), "-lm"])
        for n in args.ranks:
            for dtype in args.dtypes:
                report, table, won, total = compare(args, mpirun, exe, mpi_version, tpar, n, dtype)
                path = out_dir / f"{tag}-cpu-vs-mpi-{n}ranks-{dtype}.json"
                path.write_text(json.dumps(report, indent=2) + "\n")
                loads = report["load_average"]
                print(
                    f"\n{n} ranks, {dtype}: p50 in us (load average {loads['before']} -> "
                    f"{loads['after']}); JSON: {path}"
                )
                print("\n".join(table))
                wrong = [r for r in report["results"] if not r["correct"]]
                if wrong:
                    sys.exit(f"cpu_vs_mpi: wrong results in {len(wrong)} rows: {wrong}")
                summary.append(f"{n} ranks {dtype}: tpar <= mpi at {won} of {total} sizes")
    print("\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
