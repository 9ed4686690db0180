"""TparCustomAllreduce's per-call decisions with a stand-in for the tpar communicator that
records what it is asked: ``should_custom_ar`` follows tpar's plan (a size planned for NCCL
stays on the engine's NCCL), asks the plan once per (dtype, size, capture state), refuses what
the engines' own class refuses, and ``custom_all_reduce`` hands tpar a new output tensor.
Needs torch (tensors); skipped with the reason where it is missing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed: these tests build torch tensors "
    "(scripts/test.sh installs it unless TPAR_CI_TORCH=0)",
)

from tpar.engines import TparCustomAllreduce  # noqa: E402


class PlanningComm:
    """Plans tpar's one-shot up to 64 KiB, two-shot up to 1 MiB, NCCL above; counts the asks."""

    def __init__(self):
        self.asked = []
        self.reduced = []

    def plan(self, nbytes, dtype, capturing):
        self.asked.append((nbytes, str(dtype), capturing))
        return (
            "one-shot" if nbytes <= 64 << 10 else "two-shot" if nbytes <= 1 << 20 else "nccl"
        ), "test"

    def should_use(self, tensor, max_bytes=None):
        return True

    def all_reduce(self, tensor, out=None):
        self.reduced.append((tensor, out))
        out.copy_(tensor * 2)
        return out

    def close(self):
        self.closed = True


def enabled_object(max_size=4 << 20):
    """An enabled object as a successful vote leaves it, on a stand-in communicator."""
    ca = TparCustomAllreduce.__new__(TparCustomAllreduce)
    ca.disabled = ca.original_disabled = False
    ca._IS_CAPTURING = False
    ca.max_size = max_size
    ca.comm = PlanningComm()
    ca._routes = {}
    ca._cuda = True
    ca._plan_warned = False
    ca.device = torch.device("cpu")  # the tensors below live there; the route logic is the same
    ca.rank, ca.world_size = 0, 4
    return ca


def test_routes_follow_the_plan_and_are_asked_once_per_size():
    ca = enabled_object()
    bf16 = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    assert ca.should_custom_ar(bf16(512))  # 1 KiB: one-shot
    assert ca.should_custom_ar(bf16(256 << 10))  # 512 KiB: two-shot
    assert not ca.should_custom_ar(bf16(1 << 20))  # 2 MiB: planned for NCCL, the engine's
    assert not ca.should_custom_ar(bf16(4 << 20))  # 8 MiB: over max_size, not even planned
    for _ in range(3):
        ca.should_custom_ar(bf16(512))
    assert [a[0] for a in ca.comm.asked] == [1024, 512 << 10, 2 << 20]
    with _capturing(ca):
        assert ca.should_custom_ar(bf16(512))
    assert ca.comm.asked[-1] == (1024, "torch.bfloat16", True)


class _capturing:
    def __init__(self, ca):
        self.ca = ca

    def __enter__(self):
        self.ca._IS_CAPTURING = True

    def __exit__(self, *exc):
        self.ca._IS_CAPTURING = False


def test_refuses_what_the_engines_refuse():
    ca = enabled_object()
    assert not ca.should_custom_ar(torch.ones(16, dtype=torch.int32))
    assert not ca.should_custom_ar(torch.ones(0, dtype=torch.float32))
    assert not ca.should_custom_ar(torch.ones(8, 8, dtype=torch.float32).t())
    ca.disabled = True
    assert not ca.should_custom_ar(torch.ones(16, dtype=torch.float32))
    assert ca.custom_all_reduce(torch.ones(16, dtype=torch.float32)) is None


def test_custom_all_reduce_is_out_of_place_and_never_none_when_routed():
    ca = enabled_object()
    x = torch.arange(64, dtype=torch.float32)
    y = ca.custom_all_reduce(x)
    assert y is not None and y.data_ptr() != x.data_ptr()
    assert torch.equal(x, torch.arange(64, dtype=torch.float32))
    assert torch.equal(y, x * 2)
    ((given, out),) = ca.comm.reduced
    assert given is x and out is y


def test_log_line_names_the_route_per_size():
    ca = enabled_object()
    line = ca.describe()
    assert "rank 0 of 4" in line
    assert (
        "bf16 1 KiB-64 KiB one-shot, 128 KiB-1 MiB two-shot, 2 MiB-4 MiB engine NCCL; over 4 MiB engine NCCL"
        in line
    ), line


def test_a_failing_plan_keeps_the_size_on_nccl_and_warns_once():
    ca = enabled_object()

    def broken(*args):
        raise RuntimeError("no plan (test)")

    ca.comm.plan = broken
    assert not ca.should_custom_ar(torch.ones(16, dtype=torch.float32))
    assert not ca.should_custom_ar(torch.ones(32, dtype=torch.float32))
    assert ca._plan_warned
