"""The fused allreduce + residual add + RMSNorm (issue 15) on the CPU backend, across real
processes: against an fp32 reference within the dtype's rounding (residual_out exactly, since
its two roundings are defined), bitwise the same on every rank, in place and not, out=x, odd
hidden sizes, 1 and many tokens, numpy and torch CPU tensors; the custom ops eagerly and under
torch.compile(fullgraph=True); and the errors for bad operands."""

import os
import secrets
import textwrap

import numpy as np
import pytest
import tpar
from jobs import run_program

WORKER = textwrap.dedent(
    """
    import hashlib, json, os, sys
    import numpy as np
    import tpar
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    task = json.loads(sys.argv[1])
    try:
        import torch
    except ImportError:
        torch = None
    UNIT = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}

    def operands(tokens, hidden, seed):
        rng = np.random.default_rng(seed)
        xs = [rng.uniform(-1, 1, (tokens, hidden)) for _ in range(n)]
        residual = rng.uniform(-2, 2, (tokens, hidden))
        weight = rng.uniform(0.5, 1.5, hidden)
        return xs, residual, weight

    def cast(a, dtype):
        # numpy has no bfloat16: those cases use torch CPU tensors.
        if dtype == "bfloat16":
            return torch.tensor(a, dtype=torch.float32).to(torch.bfloat16)
        return a.astype(dtype)

    def f32(a):
        return a.float().numpy() if torch is not None and isinstance(a, torch.Tensor) else a.astype(np.float32)

    def reference(xs, residual, weight, dtype, eps):
        # Step 1: fp32 sum in rank order, rounded once; step 2: one fp32 add, rounded once.
        acc = f32(xs[0]).copy()
        for x in xs[1:]:
            acc = acc + f32(x)
        s = f32(cast(acc, dtype))
        residual_out = f32(cast(s + f32(residual), dtype))
        v = residual_out.astype(np.float64)
        inv = 1.0 / np.sqrt((v * v).mean(-1, keepdims=True) + eps)
        return residual_out, v * inv * f32(weight).astype(np.float64)

    def raw(a):
        return (a.view(torch.int16).numpy() if isinstance(a, torch.Tensor) else a).tobytes()

    digests = []
    with tpar.Communicator(timeout=60) as comm:
        assert (comm.rank, comm.world_size) == (rank, n)
        dtypes = ["float32", "float16"] + (["bfloat16"] if torch is not None else [])
        case = 0
        for dtype in dtypes:
            for tokens, hidden in task["shapes"]:
                for in_place in (True, False):
                    for out_is_x in (False, True):
                        case += 1
                        eps = 1e-6 if case % 2 else 1e-5
                        xs, residual, weight = operands(tokens, hidden, case)
                        xs = [cast(x, dtype) for x in xs]
                        residual, weight = cast(residual, dtype), cast(weight, dtype)
                        x = xs[rank]
                        x_before = raw(x)
                        residual_in = residual.clone() if dtype == "bfloat16" else residual.copy()
                        algorithm = "two-shot" if case % 3 == 0 else "one-shot"
                        # Before the call: with out=x, x becomes y.
                        want_residual, want_y = reference(xs, residual, weight, dtype, eps)
                        y, residual_out = comm.fused_add_rms_norm(
                            x, residual_in, weight, eps, out=x if out_is_x else None, in_place=in_place,
                            algorithm=algorithm)
                        what = f"rank {rank}: {tokens}x{hidden} {dtype} in_place={in_place} out=x:{out_is_x} {algorithm}"
                        assert (residual_out is residual_in) == in_place, what
                        assert (y is x) == out_is_x, what
                        if not in_place:
                            assert raw(residual_in) == raw(residual), what + ": residual changed"
                        if not out_is_x:
                            assert raw(x) == x_before, what + ": x changed"
                        assert raw(cast(want_residual, dtype)) == raw(residual_out), what + ": residual_out"
                        u = UNIT[dtype]
                        error = np.abs(f32(y).astype(np.float64) - want_y)
                        bound = (2 * u + 1e-5) * np.abs(want_y) + u * 1e-3
                        if not (error <= bound).all():
                            i = int(np.argmax(error - bound))
                            sys.exit(f"{what}: y off by {error.flat[i]} > {bound.flat[i]} at {i}")
                        digests.append(hashlib.sha256(raw(y) + raw(residual_out)).hexdigest())
    print("DIGEST", hashlib.sha256("".join(digests).encode()).hexdigest(), len(digests), flush=True)
    """
)


def run_job(n, task, timeout=300):
    """Runs n worker processes as the ranks of one job; returns their (code, output)."""
    return run_program(n, WORKER, task, timeout=timeout, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_rank_gets_the_reference_within_rounding_and_the_same_bits(n):
    # Odd hidden sizes (a row that ends inside a quad), 1 and many tokens, a row over 4096.
    shapes = [(1, 1), (1, 7), (5, 33), (16, 1000), (1, 4099), (3, 8192)]
    results = run_job(n, {"shapes": shapes})
    digests = set()
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank}:\n{output}"
        line = [text for text in output.splitlines() if text.startswith("DIGEST")]
        assert line, output
        digests.add(line[0])
    assert len(digests) == 1, f"ranks disagree: {digests}"
    assert int(next(iter(digests)).split()[2]) >= 2 * 2 * len(shapes) * 2


def one_rank(tmp_path):
    return tpar.Communicator(0, 1, rendezvous=str(tmp_path / "rdv"), token=secrets.token_hex(16))


def test_one_rank_against_a_hand_computed_row_and_leading_dimensions(tmp_path):
    with one_rank(tmp_path) as comm:
        x = np.array([[[3.0, 4.0]], [[0.0, 0.0]]], dtype=np.float32)  # (2, 1, 2): two tokens
        residual = np.array([[[0.0, 0.0]], [[1.0, -1.0]]], dtype=np.float32)
        y, residual_out = comm.fused_add_rms_norm(
            x, residual, np.array([1.0, 2.0], dtype=np.float32), eps=0.0
        )
        assert residual_out is residual and residual.tolist() == [[[3.0, 4.0]], [[1.0, -1.0]]]
        # rms of (3, 4) is sqrt(12.5); of (1, -1) is 1.
        assert np.allclose(y, [[[3 / 12.5**0.5, 8 / 12.5**0.5]], [[1.0, -2.0]]], rtol=1e-6)
        assert y.shape == x.shape and y is not x
        # No tokens: nothing to do, and nothing is refused.
        empty = np.zeros((0, 2), dtype=np.float32)
        y, r = comm.fused_add_rms_norm(empty, empty.copy(), np.ones(2, dtype=np.float32))
        assert y.shape == (0, 2)


def test_bad_operands_are_refused_naming_the_problem(tmp_path):
    with one_rank(tmp_path) as comm:
        x = np.ones((2, 8), dtype=np.float32)
        r = np.ones((2, 8), dtype=np.float32)
        w = np.ones(8, dtype=np.float32)
        cases = [
            (dict(x=x, residual=np.ones((2, 9), np.float32), weight=w), "residual has shape"),
            (
                dict(x=x, residual=r, weight=np.ones(9, np.float32)),
                r"must be \(8,\), the hidden size",
            ),
            (dict(x=x, residual=r.astype(np.float16), weight=w), "residual is f16 but x is f32"),
            (dict(x=x, residual=r, weight=w.astype(np.float16)), "weight is f16 but x is f32"),
            (dict(x=x.astype(np.int32), residual=r, weight=w), "float32, float16 or bfloat16"),
            (dict(x=np.ones((2, 16), np.float32)[:, ::2], residual=r, weight=w), "C-contiguous"),
            (dict(x=x, residual=r, weight=w, eps=float("nan")), "eps=nan"),
            (dict(x=x, residual=r, weight=w, eps=-1.0), "eps=-1.0"),
            (dict(x=x, residual=r, weight=w, eps="small"), "eps='small'"),
            (dict(x=x, residual=r, weight=w, out=r), "out .y. overlaps residual"),
            (dict(x=x, residual=r, weight=w, out=np.ones((2, 4), np.float32)), "out is"),
            (dict(x=x, residual=r, weight=w, algorithm="rings"), "no such algorithm"),
            (dict(x=np.float32(1.0), residual=r, weight=w), "scalar"),
            (
                dict(
                    x=np.ones((2, 0), np.float32),
                    residual=np.ones((2, 0), np.float32),
                    weight=np.ones(0, np.float32),
                ),
                "hidden size of 0",
            ),
        ]
        for kwargs, message in cases:
            before = r.copy()
            with pytest.raises(tpar.TparError, match=message):
                comm.fused_add_rms_norm(**kwargs)
            assert np.array_equal(r, before), f"{message}: residual was written before the refusal"
        frozen = r.copy()
        frozen.flags.writeable = False
        with pytest.raises(tpar.TparError, match="residual is read-only"):
            comm.fused_add_rms_norm(x, frozen, w)
        # Read-only inputs are fine when nothing is written into them.
        y, out = comm.fused_add_rms_norm(x, frozen, w, in_place=False)
        assert out is not frozen and np.array_equal(out, x + r)
    with pytest.raises(tpar.TparError, match="closed"):
        comm.fused_add_rms_norm(x, r, w)


def test_torch_cpu_tensors_and_mixed_kinds(tmp_path):
    torch = pytest.importorskip(
        "torch", reason="torch is not installed here; the numpy tests cover the CPU path"
    )
    with one_rank(tmp_path) as comm:
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        r = torch.randn(3, 64, dtype=torch.bfloat16)
        w = torch.rand(64, dtype=torch.bfloat16) + 0.5
        y, r_out = comm.fused_add_rms_norm(x, r.clone(), w, 1e-6, in_place=False)
        # torch's own unfused sequence (fp32 math, bf16 rounding at the same two points).
        want_r = (x.float() + r.float()).to(torch.bfloat16)
        assert torch.equal(r_out, want_r)
        v = want_r.float()
        want_y = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(
            torch.bfloat16
        ).float() * w.float()
        assert torch.allclose(y.float(), want_y, rtol=2 * 2.0**-8, atol=1e-3)
        with pytest.raises(tpar.TparError, match="residual is a ndarray but x is a Tensor"):
            comm.fused_add_rms_norm(
                x, r.numpy() if r.dtype != torch.bfloat16 else np.ones((3, 64), np.float32), w
            )
        with pytest.raises(tpar.TparError, match="residual is bf16 but x is f32"):
            comm.fused_add_rms_norm(x.float(), r, w.float())


def test_the_custom_ops_eagerly_under_opcheck_and_torch_compile(tmp_path):
    torch = pytest.importorskip("torch", reason="torch is not installed here; the ops need it")
    import tpar.ops

    torch._inductor.config.compile_threads = 1
    with tpar.Communicator(
        0, 1, device="cpu", rendezvous=str(tmp_path / "rdv"), token=secrets.token_hex(16)
    ) as comm:
        x = torch.randn(4, 48, dtype=torch.float32)
        r = torch.randn(4, 48, dtype=torch.float32)
        w = torch.rand(48) + 0.5
        want_y, want_r = comm.fused_add_rms_norm(x, r.clone(), w, 1e-5, in_place=False)
        y, r_out = torch.ops.tpar.fused_add_rms_norm(x, r, w, 1e-5, comm.handle)
        assert torch.equal(y, want_y) and torch.equal(r_out, want_r)
        assert r_out is not r and torch.equal(r, r), "functional: residual left as it was"
        checks = torch.library.opcheck(
            torch.ops.tpar.fused_add_rms_norm.default, (x, r, w, 1e-5, comm.handle)
        )
        assert set(checks.values()) == {"SUCCESS"}, checks

        def layer(x, residual, weight):
            y, residual = tpar.ops.fused_add_rms_norm(x * 2, residual, weight, 1e-5, comm)
            return y + 1, residual

        want = comm.fused_add_rms_norm(x * 2, r.clone(), w, 1e-5, in_place=False)
        for backend in ("aot_eager", "inductor"):
            step = torch.compile(layer, fullgraph=True, backend=backend)
            got_y, got_r = step(x, r, w)
            assert torch.equal(got_y, want[0] + 1) and torch.equal(got_r, want[1]), backend

        # The in-place form: x becomes y, residual becomes residual_out.
        xi, ri = x.clone(), r.clone()
        tpar.ops.fused_add_rms_norm_(xi, ri, w, 1e-5, comm)
        assert torch.equal(xi, want_y) and torch.equal(ri, want_r)

        def inplace(x, residual, weight):
            tpar.ops.fused_add_rms_norm_(x, residual, weight, 1e-5, comm)
            return x * 1

        xi, ri = x.clone(), r.clone()
        got = torch.compile(inplace, fullgraph=True, backend="aot_eager")(xi, ri, w)
        assert torch.equal(got, want_y) and torch.equal(xi, want_y) and torch.equal(ri, want_r)
        # A non-contiguous x for the in-place form still gets its results.
        xt, rt = x.t().contiguous().t(), r.clone()
        tpar.ops.fused_add_rms_norm_(xt, rt, w, 1e-5, comm)
        assert torch.equal(xt, want_y) and torch.equal(rt, want_r)
    with pytest.raises(tpar.TparError, match="no open tpar communicator"):
        torch.ops.tpar.fused_add_rms_norm(x, r, w, 1e-5, comm.handle)


def test_the_cuda_fused_decision_question_needs_a_gpu(tmp_path):
    with one_rank(tmp_path) as comm:
        # fused_plan() is the published name fused_decision() is kept under.
        for ask in (comm.fused_decision, comm.fused_plan):
            with pytest.raises(tpar.TparError, match="no GPU"):
                ask(1, 8192)


def test_the_readme_example_of_the_fused_op_runs_as_written():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    blocks = [b.split("```", 1)[0] for b in readme.split("```python\n")[1:]]
    example = [b for b in blocks if "comm.fused_add_rms_norm(" in b]
    assert len(example) == 1, "the README's Python section has one example of the fused op"
    namespace = {}
    exec(compile(example[0], "README.md (fused op example)", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["y"].shape == (1, 4)
