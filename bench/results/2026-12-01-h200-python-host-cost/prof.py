# Host cost per call of tpar's Python CUDA path, one rank on GPU 0 (eager): the op, the method,
# the raw binding and the pieces of the method; then a cProfile of the op.
import cProfile, pstats, time, io, torch, tpar, tpar.ops
torch.cuda.set_device(0)
import tempfile, secrets
comm = tpar.Communicator(0, 1, device=0, rendezvous=tempfile.mkdtemp() + "/rdv", token=secrets.token_hex(8))
x = torch.randn(8192, dtype=torch.bfloat16, device="cuda"); out = torch.empty_like(x)
r = torch.randn(1, 8192, dtype=torch.bfloat16, device="cuda"); w = torch.ones(8192, dtype=torch.bfloat16, device="cuda")
x2 = x.view(1, 8192)
def t(name, f, n=5000):
    for _ in range(200): f()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): f()
    host = (time.perf_counter() - t0) / n * 1e6; torch.cuda.synchronize()
    print(f"{name:<44} {host:8.2f} us", flush=True)
@torch.library.custom_op("probe::ident", mutates_args=())
def ident(t_: torch.Tensor, h: int) -> torch.Tensor:
    return torch.empty(t_.shape, dtype=t_.dtype, device=t_.device)
@ident.register_fake
def _(t_, h): return torch.empty_like(t_)
lib = torch.library.Library("probe2", "DEF"); lib.define("ident(Tensor t, int h) -> Tensor")
lib.impl("ident", lambda t_, h: torch.empty(t_.shape, dtype=t_.dtype, device=t_.device), "CUDA")
stream = torch.cuda.current_stream(x.device).cuda_stream
t("torch.ops.tpar.all_reduce", lambda: torch.ops.tpar.all_reduce(x, comm.handle))
t("comm.all_reduce(x, out=out)", lambda: comm.all_reduce(x, out=out))
t("comm.all_reduce(x) in place", lambda: comm.all_reduce(x))
t("_comm.all_reduce_cuda (raw binding)", lambda: comm._comm.all_reduce_cuda("bf16", x.data_ptr(), out.data_ptr(), 8192, stream, False, None))
t("comm._cuda_refusal(x)", lambda: comm._cuda_refusal(x))
t("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream(x.device).cuda_stream)
t("torch.cuda.is_current_stream_capturing()", lambda: torch.cuda.is_current_stream_capturing())
t("torch.empty(8192 bf16 cuda)", lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device))
t("custom_op probe (python impl)", lambda: torch.ops.probe.ident(x, 1))
t("Library.define/impl probe", lambda: torch.ops.probe2.ident(x, 1))
t("tpar.ops.fused_add_rms_norm", lambda: tpar.ops.fused_add_rms_norm(x2, r, w, 1e-6, comm), 2000)
t("comm.fused_add_rms_norm(in_place=False)", lambda: comm.fused_add_rms_norm(x2, r, w, 1e-6, in_place=False), 2000)
pr = cProfile.Profile(); pr.enable()
for _ in range(3000): torch.ops.tpar.all_reduce(x, comm.handle)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[-4500:])
comm.close()
