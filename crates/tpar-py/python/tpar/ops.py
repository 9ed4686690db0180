"""``torch.ops.tpar.all_reduce``: tpar's allreduce as a torch custom op, so that it can sit
inside ``torch.compile``d code and captured CUDA graphs (importing this module registers it;
it needs torch >= 2.4).

The op is functional: it returns a new tensor holding the sum over ranks and leaves its input
as it was, so the compiler may reorder around it freely. Its fake implementation gives the
output's shape and dtype without running anything. The communicator is named by its
``handle`` (an int), because custom ops take plain values::

    import tpar, tpar.ops
    comm = tpar.Communicator(device=torch.cuda.current_device())
    y = tpar.ops.all_reduce(x, comm)          # == torch.ops.tpar.all_reduce(x, comm.handle)
"""

from __future__ import annotations

import torch

from . import _lookup


@torch.library.custom_op("tpar::all_reduce", mutates_args=())
def _all_reduce(tensor: torch.Tensor, comm_handle: int) -> torch.Tensor:
    comm = _lookup(comm_handle)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    comm.all_reduce(tensor.contiguous(), out=out)
    return out


@_all_reduce.register_fake
def _(tensor: torch.Tensor, comm_handle: int) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)


def all_reduce(tensor: torch.Tensor, comm) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks of ``comm`` (a :class:`tpar.Communicator`), as a
    new tensor, through ``torch.ops.tpar.all_reduce``."""
    return torch.ops.tpar.all_reduce(tensor, comm.handle)
