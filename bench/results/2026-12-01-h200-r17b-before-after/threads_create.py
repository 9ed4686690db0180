# Ranks as threads of one process, each creating tpar.Communicator(device=0): does creation finish?
import faulthandler, os, sys, tempfile, secrets, threading, time, torch, tpar
faulthandler.dump_traceback_later(35, exit=False)
n = int(sys.argv[1]); d = tempfile.mkdtemp(); job = secrets.token_hex(8); out = {}
def rank_main(r):
    t0 = time.time()
    try:
        torch.cuda.set_device(0)
        c = tpar.Communicator(r, n, device=0, rendezvous=os.path.join(d, "rdv"), token=job, timeout=20)
        out[r] = f"created in {time.time()-t0:.2f}s"
        x = torch.full((1024,), float(r + 1), device="cuda")
        c.all_reduce(x); torch.cuda.synchronize()
        out[r] += f"; allreduce {float(x[0])} (want {n*(n+1)/2})"
        c.close()
    except Exception as e:
        out[r] = f"ERROR after {time.time()-t0:.2f}s: {e!r}"
ts = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
[t.start() for t in ts]; [t.join() for t in ts]
for r in range(n): print("rank", r, out.get(r), flush=True)
