"""One rank of test_cuda_engine_comm.py (an engine-grade communicator on GPU 0, issue 12), run as
a script with tpar's rank environment: `engine_comm_rank.py CHECK ARGS_JSON`. The ranks share
GPU 0 (time-sliced: correctness and memory, not speed); a CPU communicator over the same job
serves as barrier and for summing figures. Prints one line `RESULT {json}` at the end.

Checks (the test says what each must show):
- footprint: memory_footprint() and the drop in free device memory (cudaMemGetInfo) around
  creating and using a communicator, with nccl "none", "own" or "borrowed" (torch's
  ProcessGroupNCCL communicator, created before the first reading);
- leak: create/use/close cycles (odd cycles closed, even ones left to garbage collection):
  descriptors, threads, RSS, /dev/shm entries and free device memory at cycle 10 and at the end;
- streams: one communicator, calls on 2 or 3 streams with no ordering between them, eager or
  captured in one CUDA graph (fork/join), every result checked;
- many: two communicators at once (on one stream and on two), close/create, and subgroups
  {0,1},{2,3},{0..3} of 4 ranks via members=;
- initcost: communicators of one group created one after another (the first pays for the init
  self-test);
- firstuse: a communicator created under the test's TPAR_FIRST_USE=force and TPAR_CACHE_DIR:
  its decision and reason at the first-use sizes, the cached tables, one call checked.
"""

import json
import os
import sys
import time


def rank_main(check, args):
    import numpy as np
    import torch
    import tpar

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")  # the context exists before anything is measured
    torch.cuda.synchronize()
    # A CPU communicator over the same job serves as barrier and for summing figures.
    ctl = tpar.Communicator(device="cpu", members=list(range(n)))

    def barrier():
        ctl.all_reduce(np.zeros(1, dtype=np.float32))

    def total(value):
        x = np.array([value / 1024.0], dtype=np.float32)  # KiB: exact in f32 up to 16 GiB
        ctl.all_reduce(x)
        return float(x[0]) * 1024.0

    def free():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def values(count, seed, dtype=torch.float32):
        i = torch.arange(count, device="cuda", dtype=torch.int64)
        return ((((i * 7 + rank * 13 + seed * 5) % 1024) - 512).to(torch.float64) / 64.0).to(dtype)

    def want(count, seed, dtype=torch.float32, members=None):
        members = members if members is not None else range(n)
        i = torch.arange(count, device="cuda", dtype=torch.int64)
        # Each rank's input as the rank holds it (rounded to dtype: 1/64 steps over [-8, 8) need
        # 9 bits, bf16 keeps 8), summed exactly, rounded once: what tpar computes.
        s = sum(
            ((((i * 7 + r * 13 + seed * 5) % 1024) - 512).to(torch.float64) / 64.0)
            .to(dtype)
            .to(torch.float64)
            for r in members
        )
        return s.to(torch.float32).to(dtype)

    out = {"rank": rank, "check": check, "args": args}
    if check == "footprint":
        mode = args["nccl"]
        nccl_arg = mode
        if mode == "borrowed":
            # The engine's own NCCL (torch's ProcessGroupNCCL), created before measuring.
            import torch.distributed as dist

            dist.init_process_group(
                "nccl",
                init_method="file://" + args["store"],
                rank=rank,
                world_size=n,
                device_id=torch.device("cuda", 0),
            )
            ones = torch.ones(1, device="cuda")
            dist.all_reduce(ones)
            nccl_arg = dist.group.WORLD
        x = values(1 << 20, 1)  # 4 MiB: NCCL's size where NCCL is there
        small = values(4096, 2)
        barrier()
        before = free() if rank == 0 else 0
        barrier()
        try:
            comm = tpar.Communicator(device=0, nccl=nccl_arg, timeout=120)
        except tpar.TparError as e:
            out["error"] = f"creating with nccl={mode}: {e}"
            print("RESULT " + json.dumps(out), flush=True)
            return
        comm.all_reduce(small)
        nccl_call = None
        if mode in ("own", "borrowed"):
            try:
                comm.all_reduce(x, algorithm="nccl")
                nccl_call = "ran"
            except tpar.TparError as e:
                nccl_call = f"refused: {e}"
        torch.cuda.synchronize()
        barrier()
        after = free() if rank == 0 else 0
        fp = comm.memory_footprint()["cuda"]
        reported = total(fp["device_bytes"])
        # The modules are per process: each rank's own figure counts once per process, which
        # is what a process holds.
        out.update(
            footprint=fp,
            reported_sum=reported,
            nccl_call=nccl_call,
            # The binding's own flag (informational: the test does not read it).
            own_nccl_created=getattr(getattr(comm, "_comm", None), "own_nccl_created", None),
        )
        if rank == 0:
            out["measured_drop"] = before - after
        comm.close()
    elif check == "leak":
        cycles = args["cycles"]

        def figures():
            torch.cuda.synchronize()
            prefix = "tpar-"
            with open("/proc/self/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            return {
                "fds": len(os.listdir("/proc/self/fd")),
                "threads": len(os.listdir("/proc/self/task")),
                "rss_kib": rss,
                "shm": len([e for e in os.listdir("/dev/shm") if e.startswith(prefix)]),
                "free_device": torch.cuda.mem_get_info()[0],
            }

        x = values(21504, 3, torch.bfloat16)
        expect = want(21504, 3, torch.bfloat16)
        at = {}
        start = time.monotonic()
        for cycle in range(1, cycles + 1):
            comm = tpar.Communicator(device=0, nccl="none", timeout=60)
            y = x.clone()
            comm.all_reduce(y)
            if not torch.equal(y, expect):
                out["error"] = f"cycle {cycle}: wrong sum"
                break
            if cycle % 2:
                comm.close()
            del comm, y  # even cycles: released by garbage collection alone
            if cycle in (10, cycles):
                # Free device memory is the GPU's: every rank ends the cycle first, or a peer
                # still holding this cycle's communicator shows as a leak (6 MiB at 2 ranks
                # on one H200, 2026-12-02), and one that has made the next one's as a gain.
                barrier()
                at[cycle] = figures()
                barrier()
        out.update(at=at, seconds=time.monotonic() - start)
    elif check == "streams":
        k, graphed = args["streams"], args["graph"]
        # A short deadline: calls that ran concurrently by mistake fail in seconds, not minutes.
        comm = tpar.Communicator(device=0, nccl="none", timeout=20)
        streams = [torch.cuda.Stream() for _ in range(k)]
        count = 21504
        wrong = 0
        iters = 30 if graphed else 100
        if not graphed:
            for it in range(iters):
                xs = [values(count, it * k + j) for j in range(k)]
                torch.cuda.synchronize()
                for j, s in enumerate(streams):
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        comm.all_reduce(xs[j])
                torch.cuda.synchronize()
                wrong += sum(int(not torch.equal(xs[j], want(count, it * k + j))) for j in range(k))
        else:
            xs = [values(count, j) for j in range(k)]
            main = torch.cuda.Stream()
            with torch.cuda.stream(main):  # warm up off the capture
                comm.all_reduce(values(count, 0))
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with comm.capture(), torch.cuda.graph(g, stream=main):
                for j, s in enumerate(streams):
                    s.wait_stream(main)
                    with torch.cuda.stream(s):
                        comm.all_reduce(xs[j])
                for s in streams:
                    main.wait_stream(s)
            for it in range(iters):
                for j in range(k):
                    xs[j].copy_(values(count, it * k + j))
                g.replay()
                torch.cuda.synchronize()
                wrong += sum(int(not torch.equal(xs[j], want(count, it * k + j))) for j in range(k))
        out.update(wrong=wrong, total=iters * k)
        comm.close()
    elif check == "many":
        count = 4099
        a = tpar.Communicator(device=0, nccl="none", timeout=60)
        b = tpar.Communicator(device=0, nccl="none", timeout=60)
        s2 = torch.cuda.Stream()
        wrong = 0
        for it in range(20):
            xa, xb = values(count, it), values(count, it + 100)
            a.all_reduce(xa)
            s2.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s2):
                b.all_reduce(xb)
            ya = values(count, it + 200)
            b.all_reduce(ya)  # the two interleaved on one stream as well
            torch.cuda.synchronize()
            wrong += int(not torch.equal(xa, want(count, it))) + int(
                not torch.equal(xb, want(count, it + 100))
            )
            wrong += int(not torch.equal(ya, want(count, it + 200)))
        a.close()
        c = tpar.Communicator(device=0, nccl="none", timeout=60)
        xc = values(count, 7)
        c.all_reduce(xc)
        torch.cuda.synchronize()
        wrong += int(not torch.equal(xc, want(count, 7)))
        b.close()
        c.close()
        if n == 4:
            pair = [0, 1] if rank < 2 else [2, 3]
            sub = tpar.Communicator(device=0, members=pair, nccl="none", timeout=60)
            world = tpar.Communicator(device=0, members=[0, 1, 2, 3], nccl="none", timeout=60)
            for it in range(5):
                xs, xw = values(count, it), values(count, it + 50)
                sub.all_reduce(xs)
                world.all_reduce(xw)
                torch.cuda.synchronize()
                wrong += int(not torch.equal(xs, want(count, it, members=pair)))
                wrong += int(not torch.equal(xw, want(count, it + 50)))
            sub.close()
            world.close()
        out.update(wrong=wrong)
    elif check == "initcost":
        times = []
        comms = []
        for _ in range(args["groups"]):
            barrier()
            t = time.monotonic()
            comms.append(tpar.Communicator(device=0, nccl="none", timeout=60))
            times.append(time.monotonic() - t)
        x = values(4099, 1)
        for c in comms:
            c.all_reduce(x)
        for c in comms:
            c.close()
        out.update(seconds=times)
    elif check == "firstuse":
        from pathlib import Path

        cache = Path(os.environ["TPAR_CACHE_DIR"])
        t = time.monotonic()
        comm = tpar.Communicator(device=0, nccl="none", timeout=60)
        created = time.monotonic() - t
        reasons = {str(b): list(comm.decision_for(b)) for b in (4096, 16384, 65536, 262144)}
        count = 8192  # 16 KiB of bf16
        x = values(count, 3, torch.bfloat16)
        comm.all_reduce(x)
        torch.cuda.synchronize()
        wrong = int(not torch.equal(x, want(count, 3, torch.bfloat16)))
        comm.close()
        tables = sorted(str(p.relative_to(cache)) for p in cache.rglob("*-first-use.json"))
        out.update(seconds=created, reasons=reasons, wrong=wrong, tables=tables)
    ctl.close()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    rank_main(sys.argv[1], json.loads(sys.argv[2]))
