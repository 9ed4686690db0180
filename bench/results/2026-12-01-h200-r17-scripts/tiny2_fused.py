# Two ranks in two processes sharing GPU 0 (as tests/python/test_cuda_fused.py runs them): the
# fused op from Python case by case, synchronised, each case checked against tpar's CPU path.
import sys, os, torch, tpar
rank, n, rdv, token = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3]
torch.cuda.set_device(0)
comm = tpar.Communicator(rank, n, device=0, rendezvous=rdv, token=token, timeout=60)
print(rank, "plan", comm.fused_plan(1, 8192, torch.bfloat16), flush=True)
for case, (tokens, hidden, dtype, algo) in enumerate([(1, 8192, torch.bfloat16, "two-shot"), (1, 8192, torch.bfloat16, None),
        (8, 8192, torch.bfloat16, "one-shot"), (3, 4099, torch.float32, "one-shot")]):
    g = torch.Generator().manual_seed(case)
    xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(n)]
    r = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    print(rank, "case", tokens, hidden, dtype, algo, flush=True)
    y, ro = comm.fused_add_rms_norm(xs[rank].cuda(), r.cuda(), w.cuda(), 1e-6, in_place=False, algorithm=algo)
    torch.cuda.synchronize()
    print(rank, "  ran", comm.last_algorithm, comm.last_fused_path, flush=True)
    print(rank, "  sums", float(y.float().sum()), float(ro.float().sum()), flush=True)
comm.close()
print(rank, "done", flush=True)
