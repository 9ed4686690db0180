# Runs the fused worker's eager step at n ranks (processes sharing GPU 0), prints each rank's log tail.
import sys, os
sys.path.insert(0, "tests/python")
from test_cuda_allreduce import run_job
worker, n, prefix = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
res = run_job(n, {"steps": ["eager"], "timeout": 20}, timeout=70, worker=os.path.abspath(worker))
for r, (code, out) in enumerate(res):
    lines = [l for l in out.splitlines() if l.strip() and "RuntimeWarning" not in l and "with tpar.Communicator" not in l]
    print(f"-- rank {r} rc={code}"); print("\n".join(lines[-14:])[-2500:])
