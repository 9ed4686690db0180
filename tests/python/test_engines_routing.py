"""TparCustomAllreduce's per-call answers with a stand-in for tpar's native communicator that
records what it is asked: ``should_custom_ar`` asks the call's own decision once per question
(one crossing into tpar; the cache is the communicator's) and follows it (a size decided for
NCCL stays on the engine's NCCL), refuses what the engines' own class refuses, and
``custom_all_reduce`` is one call that makes its output, returning None where the call refuses.
Needs torch (tensors); skipped with the reason where it is missing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip(
    "torch",
    reason="torch is not installed: these tests build torch tensors "
    "(scripts/test.sh installs it unless TPAR_CI_TORCH=0)",
)

import tpar  # noqa: E402
from tpar.engines import TparCustomAllreduce  # noqa: E402


class DecidingNative:
    """Decides tpar's one-shot up to 64 KiB, two-shot up to 1 MiB, NCCL above (refused: as with
    nccl="none"); refuses over max_bytes as the native communicator does; counts the asks."""

    def __init__(self):
        self.asked = []
        self.reduced = []

    def _decide(self, tensor, max_bytes):
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return None, "dtype"
        if not tensor.is_contiguous():
            return None, "contiguous"
        if max_bytes is not None and nbytes > max_bytes:
            return None, "max-bytes"
        if nbytes > 1 << 20:
            return None, "planned for nccl; this communicator was created with nccl=none"
        return ("one-shot" if nbytes <= 64 << 10 else "two-shot"), "test"

    def decision(self, tensor, algorithm, max_bytes):
        self.asked.append((tensor.numel() * tensor.element_size(), max_bytes))
        return self._decide(tensor, max_bytes)

    def all_reduce_new(self, tensor, algorithm, max_bytes):
        choice, why = self._decide(tensor, max_bytes)
        if choice is None:
            raise tpar.TparRefused(why)
        out = tensor * 2
        self.reduced.append((tensor, out))
        return out

    def decision_for_bytes(self, dtype, nbytes, capturing):
        return (
            "one-shot" if nbytes <= 64 << 10 else "two-shot" if nbytes <= 1 << 20 else "nccl"
        ), "test"


class StandIn:
    """The Communicator around the stand-in native object."""

    def __init__(self):
        self._comm = DecidingNative()
        self.rank, self.world_size, self.device = 0, 4, None

    def decision_for(self, nbytes, dtype="bf16", capturing=False):
        return self._comm.decision_for_bytes(dtype, nbytes, capturing)

    def close(self):
        self.closed = True


def enabled_object(max_size=4 << 20):
    """An enabled object over the stand-in, as tpar.adapter builds one."""
    return TparCustomAllreduce.from_communicator(StandIn(), max_size=max_size)


def test_routes_follow_the_calls_decision_and_ask_it_once_per_question():
    ca = enabled_object()
    native = ca.comm._comm
    bf16 = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    assert ca.should_custom_ar(bf16(512))  # 1 KiB: one-shot
    assert ca.should_custom_ar(bf16(256 << 10))  # 512 KiB: two-shot
    assert not ca.should_custom_ar(bf16(1 << 20))  # 2 MiB: decided for NCCL, the engine's
    assert not ca.should_custom_ar(bf16(4 << 20))  # 8 MiB: over max_size
    assert [a for a in native.asked] == [
        (1024, 4 << 20),
        (512 << 10, 4 << 20),
        (2 << 20, 4 << 20),
        (8 << 20, 4 << 20),
    ], "one question into tpar per call, with the engine's max_size"


def test_refuses_what_the_engines_refuse():
    ca = enabled_object()
    assert not ca.should_custom_ar(torch.ones(16, dtype=torch.int32))
    assert not ca.should_custom_ar(torch.ones(0, dtype=torch.float32))
    assert not ca.should_custom_ar(torch.ones(8, 8, dtype=torch.float32).t())
    assert ca.custom_all_reduce(torch.ones(16, dtype=torch.int32)) is None
    assert ca.custom_all_reduce(torch.ones(1 << 19, dtype=torch.float32)) is None, "NCCL-sized"
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
    ((given, out),) = ca.comm._comm.reduced
    assert given is x and out is y


def test_log_line_names_the_choice_per_size():
    ca = enabled_object()
    ca._cuda = True  # the line lists tpar's decisions per size on a GPU
    line = ca.describe()
    assert "rank 0 of 4" in line
    assert (
        "bf16 1 KiB-64 KiB one-shot, 128 KiB-1 MiB two-shot, 2 MiB-4 MiB engine NCCL; over 4 MiB engine NCCL"
        in line
    ), line


def test_a_failing_decision_keeps_the_log_line_on_nccl_and_warns_once():
    ca = enabled_object()
    ca._cuda = True

    def broken(*args):
        raise RuntimeError("no decision (test)")

    ca.comm.decision_for = broken
    assert "engine NCCL" in ca.describe()
    assert ca._decision_warned
