"""What an engine does with tpar's Communicator (issue 12), on the CPU backend across real
processes: several communicators open at once over one rank environment, closed in any order
and created again (also after an error), subgroups named by ``members=``, 1,000
create/use/close cycles that leave descriptors, threads, RSS, /dev/shm and the rendezvous
directory where they were, bad arguments refused as TparError naming the argument (never a
PanicException), calls from 8 threads at once and a communicator closed or dropped on another
thread (issue 30), and Ctrl-C stopping a blocked call (also when the tests run from a
background job, where SIGINT starts ignored). The CPU backend has no streams: the many-streams
checks are GPU-only (scripts/gpu-check.sh engine-comm)."""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tpar
from jobs import job_env, run_program

# A job started from a background shell starts with SIGINT ignored, and Python then installs
# no KeyboardInterrupt handler: the workers that test Ctrl-C restore it first.
RESTORE_SIGINT = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"

WORKER = RESTORE_SIGINT + textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import tpar
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    task = json.loads(sys.argv[1])

    def check(comm, seed, count=1000):
        x = np.full(count, float(comm.rank + 1 + seed), dtype=np.float32)
        comm.all_reduce(x)
        want = sum(r + 1 + seed for r in range(comm.world_size))
        if not np.all(x == want):
            sys.exit(f"rank {rank}: wrong sum {x[0]} != {want} (seed {seed}, group of {comm.world_size})")

    if task["kind"] == "many":
        a = tpar.Communicator()
        b = tpar.Communicator()
        for seed in range(10):
            check(a, seed)
            check(b, seed + 50, 3000)
        a.close()
        c = tpar.Communicator()
        check(c, 1)
        check(b, 2)
        c.close(); b.close()
        for cycle in range(5):
            with tpar.Communicator() as d:
                check(d, cycle)
        # After an error: a mismatched call poisons the communicator; a new one works.
        e = tpar.Communicator(timeout=2)
        if n > 1:
            try:
                e.all_reduce(np.ones(10 if rank == 0 else 20, dtype=np.float32))
                sys.exit("a mismatched call did not fail")
            except tpar.TparError:
                pass
        e.close()
        with tpar.Communicator() as f:
            check(f, 9)
        del f
        # Dropped without close (garbage collection), then another.
        g = tpar.Communicator(); check(g, 3); del g
        with tpar.Communicator() as h:
            check(h, 4)
        # An exception during construction (ranks disagree on chunk_bytes): every rank fails,
        # nothing is left behind, and the next communicator works.
        if n > 1:
            try:
                tpar.Communicator(chunk_bytes=4096 if rank == 0 else 8192, timeout=10)
                sys.exit("disagreeing chunk_bytes were accepted")
            except tpar.TparError as e:
                assert "chunk_bytes=" in str(e), str(e)
            with tpar.Communicator() as k:
                check(k, 5)
        prefix = "tpar-" + os.environ["TPAR_JOB_TOKEN"]
        left = [e for e in os.listdir("/dev/shm") if e.startswith(prefix)]
        if left:
            sys.exit(f"left in /dev/shm: {left}")
        print("OK", flush=True)
    elif task["kind"] == "subgroups":
        pair = [0, 1] if rank < 2 else [2, 3]
        sub = tpar.Communicator(members=pair)
        world = tpar.Communicator(members=[0, 1, 2, 3])
        assert (sub.rank, sub.world_size) == (rank % 2, 2), (sub.rank, sub.world_size)
        for seed in range(5):
            check(sub, seed)
            check(world, seed)
        sub.close()
        again = tpar.Communicator(members=pair)
        check(again, 7)
        print("OK", flush=True)
    elif task["kind"] == "torch-groups":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + task["store"], rank=rank, world_size=n)
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        pair = groups[0] if rank < 2 else groups[1]
        sub = tpar.Communicator(group=pair, device="cpu")
        world = tpar.Communicator(group=dist.group.WORLD, device="cpu")
        assert (sub.rank, sub.world_size) == (rank % 2, 2), (sub.rank, sub.world_size)
        for seed in range(5):
            check(sub, seed)
            check(world, seed)
        sub.close()
        again = tpar.Communicator(group=pair, device="cpu")
        check(again, 3)
        again.close(); world.close()
        dist.destroy_process_group()
        print("OK", flush=True)
    elif task["kind"] == "threads":
        import threading
        comm = tpar.Communicator()
        errors, start = [], threading.Barrier(8)
        def calls(t):
            try:
                start.wait()
                for i in range(25):
                    # Every thread's call has the same size, algorithm and sum, so whichever
                    # call of the peer it pairs with (calls are ordered as issued, and threads
                    # issue in any order), the result is the sum over ranks.
                    x = np.full(4096, float(comm.rank + 1), dtype=np.float32)
                    comm.all_reduce(x)
                    if not np.all(x == n * (n + 1) / 2):
                        errors.append(f"thread {t}: wrong sum {x[0]}")
                try:
                    comm.all_reduce(np.ones(3, dtype=np.int8))
                except tpar.TparError:
                    pass
            except BaseException as e:  # a PanicException would land here
                errors.append(f"thread {t}: {type(e).__name__}: {e}")
        threads = [threading.Thread(target=calls, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Closed on another thread, then used: a TparError, not a panic.
        closer = threading.Thread(target=comm.close)
        closer.start(); closer.join()
        try:
            comm.all_reduce(np.ones(4, dtype=np.float32))
            errors.append("a closed communicator took a call")
        except tpar.TparError as e:
            assert "closed" in str(e), str(e)
        # Created on one thread, used and dropped on another.
        holder = [tpar.Communicator()]
        def use_and_drop():
            try:
                check(holder[0], 1)
                holder.clear()
            except BaseException as e:
                errors.append(f"other thread: {type(e).__name__}: {e}")
        other = threading.Thread(target=use_and_drop)
        other.start(); other.join()
        if errors:
            sys.exit("; ".join(errors[:5]))
        print("OK", flush=True)
    elif task["kind"] == "interrupt":
        comm = tpar.Communicator(timeout=60)
        check(comm, 0)
        if rank == 1:
            import time
            time.sleep(30)  # alive but never calls again: rank 0 blocks until interrupted
            sys.exit(0)
        print("BLOCKING", flush=True)
        import time
        start = time.monotonic()
        try:
            comm.all_reduce(np.ones(8, dtype=np.float32))
            sys.exit("the blocked call returned")
        except KeyboardInterrupt:
            print(f"INTERRUPTED {time.monotonic() - start:.3f}", flush=True)
        try:
            comm.all_reduce(np.ones(8, dtype=np.float32))
            sys.exit("the interrupted communicator was still usable")
        except tpar.TparError as e:
            print("BROKEN", e, flush=True)
        sys.exit(0)
    """
)


def run_job(n, task, tmp, timeout=120):
    """Runs ``n`` ranks of ``task``, their rendezvous in ``tmp`` (a test's own tmp_path, to look
    at after, and nothing left in the system's temporary directory); returns their (code,
    output)."""
    return run_program(n, WORKER, task, timeout=timeout, tmp=tmp)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_many_communicators_open_close_and_recreate(n, tmp_path):
    for code, output in run_job(n, {"kind": "many"}, tmp_path):
        assert code == 0 and "OK" in output, output
    # A finished creation leaves no record behind; the failed ones (n > 1) their abort records.
    left = [f for f in os.listdir(tmp_path / "rdv") if not f.startswith("abort.")]
    assert left == [], left


def test_subgroups_of_a_world_of_four_via_members(tmp_path):
    for code, output in run_job(4, {"kind": "subgroups"}, tmp_path):
        assert code == 0 and "OK" in output, output


@pytest.mark.parametrize("n", [1, 2])
def test_calls_from_eight_threads_at_once_and_close_on_another(n, tmp_path):
    """Issue 30, defect 1: one communicator, 8 threads calling at once on every rank, each
    call correct; closed and dropped on other threads; every error a TparError."""
    for code, output in run_job(n, {"kind": "threads"}, tmp_path):
        assert code == 0 and "OK" in output, output


def test_subgroups_of_a_world_of_four_via_torch_groups(tmp_path):
    pytest.importorskip(
        "torch", reason="torch is not installed here; group= needs torch.distributed"
    )
    store = str(tmp_path / "store")
    for code, output in run_job(4, {"kind": "torch-groups", "store": store}, tmp_path):
        assert code == 0 and "OK" in output, output


def test_ctrl_c_interrupts_a_blocked_call_and_breaks_the_communicator(tmp_path):
    common = job_env(2, tmp_path)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps({"kind": "interrupt"})],
            env=dict(common, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    blocked = procs[0]
    line = blocked.stdout.readline()
    while line and "BLOCKING" not in line:
        line = blocked.stdout.readline()
    assert "BLOCKING" in line, line
    time.sleep(0.5)
    blocked.send_signal(signal.SIGINT)
    sent = time.monotonic()
    code = blocked.wait(timeout=20)
    elapsed = time.monotonic() - sent
    output = blocked.stdout.read()
    procs[1].kill()
    procs[1].wait()
    assert code == 0, output
    assert "INTERRUPTED" in output and "BROKEN" in output and "create a new one" in output, output
    waited = float(output.split("INTERRUPTED")[1].split()[0])
    assert elapsed < 5, elapsed
    print(f"KeyboardInterrupt {elapsed:.3f} s after SIGINT (call had waited {waited:.3f} s)")


def test_ctrl_c_interrupts_a_creation_waiting_for_a_missing_rank(tmp_path):
    code = RESTORE_SIGINT + textwrap.dedent(f"""
        import time, tpar
        print("CREATING", flush=True)
        start = time.monotonic()
        try:
            tpar.Communicator(0, 2, rendezvous={str(tmp_path / "rdv")!r}, token={secrets.token_hex(16)!r}, timeout=60)
        except KeyboardInterrupt:
            print(f"INTERRUPTED {{time.monotonic() - start:.3f}}", flush=True)
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert "CREATING" in p.stdout.readline()
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    sent = time.monotonic()
    assert p.wait(timeout=20) == 0
    elapsed = time.monotonic() - sent
    output = p.stdout.read()
    assert "INTERRUPTED" in output, output
    assert elapsed < 5, elapsed
    print(f"KeyboardInterrupt {elapsed:.3f} s after SIGINT during creation")


def _figures(prefix):
    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    shm = len([e for e in os.listdir("/dev/shm") if e.startswith(prefix)])
    return fds, threads, rss, shm


def test_a_thousand_create_use_close_cycles_leak_nothing(tmp_path):
    token = secrets.token_hex(16)
    prefix = f"tpar-{token}-"
    rdv = str(tmp_path / "rdv")
    at = {}
    start = time.monotonic()
    for cycle in range(1, 1001):
        comm = tpar.Communicator(0, 1, rendezvous=rdv, token=token, chunk_bytes=4096)
        x = np.arange(100, dtype=np.float32)
        comm.all_reduce(x)
        assert x[99] == 99
        if cycle % 2:
            comm.close()
        del comm  # the even cycles are released by garbage collection alone
        if cycle in (10, 1000):
            at[cycle] = _figures(prefix)
    took = time.monotonic() - start
    for cycle, (fds, threads, rss, shm) in at.items():
        print(f"cycle {cycle}: {fds} fds, {threads} threads, RSS {rss} KiB, {shm} /dev/shm entries")
    (fds10, threads10, rss10, _), (fds1000, threads1000, rss1000, shm1000) = at[10], at[1000]
    assert (fds1000, threads1000) == (fds10, threads10), at
    assert shm1000 == 0, at
    assert rss1000 - rss10 < 8 << 10, f"RSS grew {rss1000 - rss10} KiB over 990 cycles"
    assert os.listdir(rdv) == [], os.listdir(rdv)
    print(f"1000 cycles in {took:.1f} s")


BAD = [
    (dict(rank=0, world_size=0), "world_size=0"),
    (dict(rank=5, world_size=2), "rank=5"),
    (dict(rank=-1, world_size=2), "rank=-1"),
    (dict(rank=0.5, world_size=2), "rank=0.5"),
    (dict(rank="0", world_size=2), "rank='0'"),
    (dict(rank=0, world_size=float("nan")), "world_size=nan"),
    (dict(rank=0, world_size=2**80), "world_size="),
    (dict(rank=0, world_size=17), "world_size=17: tpar serves 1 to 16 ranks"),
    (dict(rank=True, world_size=2), "rank=True"),
    (dict(timeout=1e30), "timeout="),
    (dict(timeout=float("nan")), "timeout="),
    (dict(timeout=float("inf")), "timeout="),
    (dict(timeout=-1), "timeout=-1"),
    (dict(timeout=0), "timeout=0"),
    (dict(timeout="5"), "timeout='5'"),
    (dict(max_bytes=-1), "max_bytes=-1"),
    (dict(max_bytes=0), "max_bytes=0"),
    (dict(max_bytes=1.5), "max_bytes=1.5"),
    (dict(max_bytes=float("inf")), "max_bytes=inf"),
    (dict(chunk_bytes=0), "chunk_bytes=0"),
    (dict(chunk_bytes=2**70), "chunk_bytes="),
    (dict(device=-1), "device=-1"),
    (dict(device="gpu"), "device='gpu'"),
    (dict(device=1.5), "device=1.5"),
    (dict(token=12345678), "token="),
    (dict(token="short"), "TPAR_JOB_TOKEN"),
    (dict(token="has spaces in it"), "TPAR_JOB_TOKEN"),
    (dict(nccl="mine"), "nccl='mine'"),
    (dict(nccl=-3), "nccl=-3"),
    (dict(nccl=1.0), "nccl=1.0"),
    (dict(members=[0, 0]), "twice"),
    (dict(world_size=2, members=[1]), "does not include this rank"),
    (dict(members=[0, 7]), "not a rank of this job"),
    (dict(members=[]), "at least one"),
    (dict(members=["a"]), "members[]"),
]


@pytest.mark.parametrize("kwargs,says", BAD, ids=[str(k) for k, _ in BAD])
def test_bad_arguments_are_refused_at_once_naming_them(tmp_path, kwargs, says):
    args = dict(
        rank=0,
        world_size=1,
        rendezvous=str(tmp_path / "rdv"),
        token=secrets.token_hex(16),
        timeout=5,
    )
    args.update(kwargs)
    rank, world_size = args.pop("rank"), args.pop("world_size")
    start = time.monotonic()
    with pytest.raises(tpar.TparError) as info:
        tpar.Communicator(rank, world_size, **args)
    assert time.monotonic() - start < 2, "refused only after waiting"
    assert says in str(info.value), str(info.value)
    assert type(info.value).__name__ == "TparError"


def test_a_gpu_asked_for_on_a_machine_without_one_points_to_the_cpu_backend(tmp_path):
    if shutil.which("nvidia-smi") is not None:
        pytest.skip("this machine has an NVIDIA driver: device=0 makes a CUDA communicator here")
    # In a process that has not imported torch, tpar's own driver check answers; where torch is
    # imported, torch's view of the device answers first. Either way the fix is named.
    code = (
        "import secrets, sys, tpar\n"
        "try:\n"
        f"    tpar.Communicator(0, 1, device=0, rendezvous={str(tmp_path / 'rdv')!r},"
        " token=secrets.token_hex(16), timeout=5)\n"
        "except tpar.TparError as e:\n"
        "    print(e)\n"
        "    sys.exit(3)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    said = run.stdout + run.stderr
    assert run.returncode == 3 and "torch" not in said, said
    assert "no NVIDIA driver" in said and "device='cpu' runs the CPU backend" in said, said


def test_call_arguments_never_panic(tmp_path):
    with tpar.Communicator(
        0, 1, rendezvous=str(tmp_path / "rdv"), token=secrets.token_hex(16)
    ) as comm:
        for bad in (
            None,
            3,
            "x",
            [1.0],
            np.ones(3, dtype=np.int8),
            np.ones((3, 3), dtype=np.float32)[:, ::2],
        ):
            with pytest.raises(tpar.TparError):
                comm.all_reduce(bad)
        for nbytes in (-1, 1.5, "x"):
            # plan() is the published name decision_for() is kept under.
            for ask in (comm.decision_for, comm.plan):
                with pytest.raises(tpar.TparError):
                    ask(nbytes)
        if shutil.which("nvidia-smi") is None:  # where there is a GPU, CUDA decides it
            for ask in (comm.decision_for, comm.plan):
                with pytest.raises(tpar.TparError, match="no GPU"):
                    ask(1024)
        fp = comm.memory_footprint()
        assert (
            fp["nccl_bytes"] == 0 and fp["shared_host_bytes"] > 0 and fp["nccl_estimated"] is False
        )


def test_a_peer_timeout_names_the_python_argument(tmp_path):
    tmp = str(tmp_path)
    token = secrets.token_hex(16)
    code = textwrap.dedent(f"""
        import numpy as np, os, sys, time, tpar
        rank = int(sys.argv[1])
        c = tpar.Communicator(rank, 2, rendezvous={os.path.join(tmp, "rdv")!r}, token={token!r}, timeout=1)
        if rank == 1:
            time.sleep(4); sys.exit(0)
        try:
            c.all_reduce(np.ones(4, dtype=np.float32))
        except tpar.TparError as e:
            print("ERROR", e)
    """)
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(r)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    out = [(p.wait(timeout=30), p.stdout.read()) for p in ps]
    assert "timeout= when creating the tpar.Communicator" in out[0][1], out
    assert "Config::" not in out[0][1], out
