"""``torch.ops.tpar.all_reduce`` and ``torch.ops.tpar.fused_add_rms_norm``: tpar's allreduce,
and the allreduce fused with the residual add + RMSNorm after it, as torch custom ops, so that
they can sit inside ``torch.compile``d code and captured CUDA graphs (importing this module
registers them; it needs torch >= 2.4).

The op is functional: it returns a new tensor holding the sum over ranks and leaves its input
as it was, so the compiler may reorder around it freely. Its fake implementation gives the
output's shape and dtype without running anything. The communicator is named by its
``handle`` (an int), because custom ops take plain values::

    import tpar, tpar.ops
    comm = tpar.Communicator(device=torch.cuda.current_device())
    y = tpar.ops.all_reduce(x, comm)          # == torch.ops.tpar.all_reduce(x, comm.handle)
    y, residual = tpar.ops.fused_add_rms_norm(x, residual, weight, 1e-6, comm)

``fused_add_rms_norm`` is functional too: it returns new ``(y, residual_out)`` tensors and
leaves ``x``, ``residual`` and ``weight`` as they were (the semantics are
:meth:`tpar.Communicator.fused_add_rms_norm`'s). ``fused_add_rms_norm_`` is the mutating form
with vLLM's and SGLang's in-place convention (``x`` becomes ``y``, ``residual`` becomes
``residual_out``), declared as mutating both, for callers whose code is written around that
convention; under torch.compile, functionalisation turns it into the functional op plus copies.

The ops are declared with ``torch.library.Library`` (a schema, one implementation for every
backend, a fake one) rather than ``torch.library.custom_op``: an eager call through custom_op's
Python dispatch cost about 12 us more per call on an H200 host (19.1 against 6.8 us for an op
that does nothing; bench/results/2026-12-01-h200-python-host-cost/), as much as the allreduce.
Their kernels call the native communicator directly (one crossing into tpar per call);
``bench/host_cost.py`` times them beside an empty op registered the same way.
"""

from __future__ import annotations

import torch

from . import _native

_LIB = torch.library.Library("tpar", "DEF")  # noqa: TOR901 (kept alive by the module)
_LIB.define("all_reduce(Tensor tensor, int comm_handle) -> Tensor")
_LIB.define(
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int comm_handle)"
    " -> (Tensor, Tensor)"
)
_LIB.define(
    "fused_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, int comm_handle)"
    " -> ()"
)


def _implements(name: str):
    """Registers the decorated function as op ``name``'s kernel for every backend (the
    communicator decides what it can run, and says so)."""

    def register(fn):
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


@_implements("all_reduce")
def _all_reduce(tensor: torch.Tensor, comm_handle: int) -> torch.Tensor:
    return _native(comm_handle).all_reduce_new(tensor.contiguous(), None)


@torch.library.register_fake("tpar::all_reduce", lib=_LIB)
def _(tensor: torch.Tensor, comm_handle: int) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def all_reduce(tensor: torch.Tensor, comm) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``comm`` (a :class:`tpar.Communicator`), as a
    new tensor, through ``torch.ops.tpar.all_reduce``."""
    return torch.ops.tpar.all_reduce(tensor, comm.handle)


@_implements("fused_add_rms_norm")
def _fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_handle: int
) -> tuple[torch.Tensor, torch.Tensor]:
    comm = _native(comm_handle)
    return comm.fused_add_rms_norm(
        x.contiguous(), residual.contiguous(), weight.contiguous(), eps, None, False, None
    )


@torch.library.register_fake("tpar::fused_add_rms_norm", lib=_LIB)
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_handle: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        residual, memory_format=torch.contiguous_format
    )


@_implements("fused_add_rms_norm_")
def _fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_handle: int
) -> None:
    comm = _native(comm_handle)
    if not (x.is_contiguous() and residual.is_contiguous()):
        # The results must land in the caller's tensors: compute into contiguous copies.
        y, residual_out = comm.fused_add_rms_norm(
            x.contiguous(), residual.contiguous(), weight.contiguous(), eps, None, False, None
        )
        x.copy_(y)
        residual.copy_(residual_out)
        return
    comm.fused_add_rms_norm(x, residual, weight.contiguous(), eps, x, True, None)


@torch.library.register_fake("tpar::fused_add_rms_norm_", lib=_LIB)
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm_handle: int
) -> None:
    return None


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, residual_out)`` as new tensors: ``residual_out = allreduce(x) + residual`` and
    ``y = rmsnorm(residual_out) * weight`` over the ranks of ``comm`` (a
    :class:`tpar.Communicator`), through ``torch.ops.tpar.fused_add_rms_norm``; exact
    semantics in :meth:`tpar.Communicator.fused_add_rms_norm`."""
    return torch.ops.tpar.fused_add_rms_norm(x, residual, weight, float(eps), comm.handle)


def fused_add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, comm
) -> None:
    """In place, as the engines' ``fused_add_rms_norm``: ``x`` becomes ``y`` and ``residual``
    becomes ``residual_out`` (``torch.ops.tpar.fused_add_rms_norm_``)."""
    torch.ops.tpar.fused_add_rms_norm_(x, residual, weight, float(eps), comm.handle)
