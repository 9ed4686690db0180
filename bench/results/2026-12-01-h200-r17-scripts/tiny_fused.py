# One rank, one process: the fused op from Python on the GPU, each case synchronised, so an
# illegal access is pinned to its case (the 2-process test faulted on its first case).
import sys, torch, tpar, tpar.ops
torch.cuda.set_device(0)
import tempfile, os, secrets
comm = tpar.Communicator(0, 1, device=0, rendezvous=os.path.join(tempfile.mkdtemp(), "r"), token=secrets.token_hex(8))
print("plan", comm.fused_plan(1, 8192, torch.bfloat16), flush=True)
for tokens, hidden, dtype, in_place, out_x, algo in [
        (1, 8192, torch.bfloat16, False, False, None), (1, 8192, torch.bfloat16, True, False, None),
        (1, 8192, torch.bfloat16, False, True, "one-shot"), (8, 8192, torch.float16, False, False, "two-shot"),
        (3, 4099, torch.float32, True, True, None)]:
    x = torch.randn(tokens, hidden, device="cuda").to(dtype)
    r = torch.randn(tokens, hidden, device="cuda").to(dtype)
    w = torch.rand(hidden, device="cuda").to(dtype) + 0.5
    want_y, want_r = comm.fused_add_rms_norm(x.cpu(), r.cpu().clone(), w.cpu(), 1e-6, in_place=False)
    print("case", tokens, hidden, dtype, in_place, out_x, algo, flush=True)
    y, ro = comm.fused_add_rms_norm(x, r, w, 1e-6, out=x if out_x else None, in_place=in_place, algorithm=algo)
    torch.cuda.synchronize()
    print("  ran", comm.last_algorithm, comm.last_fused_path, "y equal:", torch.equal(y.cpu(), want_y),
          "r equal:", torch.equal(ro.cpu(), want_r), flush=True)
comm.close()
print("done")
