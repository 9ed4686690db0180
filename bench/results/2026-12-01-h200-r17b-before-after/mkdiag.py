# Writes diag_worker.py: cuda_fused_worker.py that synchronises and prints after every GPU op
# and every CPU reference, so the first faulting call is named.
src = open("tests/python/cuda_fused_worker.py").read()
src = src.replace("""                want_y, want_r = reference(comm, x, residual, weight)
                xg, rg, wg = x.cuda(), residual.cuda(), weight.cuda()""",
"""                print("case", case, tokens, hidden, dtype, algorithm, flush=True)
                want_y, want_r = reference(comm, x, residual, weight)
                print("  cpu reference done", flush=True)
                xg, rg, wg = x.cuda(), residual.cuda(), weight.cuda()
                torch.cuda.synchronize()
                print("  copies done", flush=True)""")
src = src.replace("""                what = f"{tokens}x{hidden}""", """                print("  queued", comm.last_algorithm, comm.last_fused_path, flush=True)
                torch.cuda.synchronize()
                print("  gpu op done", flush=True)
                what = f"{tokens}x{hidden}""")
assert src.count("gpu op done") == 1 and src.count("cpu reference done") == 1
open("tests/python/diag_worker.py", "w").write(src)
