"""The engines' custom-allreduce contract over a communicator the caller built: a thin alias
of :class:`tpar.engines.TparCustomAllreduce` (the one class with the method names engines call:
``should_custom_ar``, ``custom_all_reduce``, ``capture``, ``close``), for an engine whose
plugin does not build it from the group itself. Whenever ``should_custom_ar`` says False
(``custom_all_reduce`` then returns None), the engine runs its usual path (NCCL), so nothing
is ever skipped silently::

    from tpar.adapter import TparAllreduce
    self.ca_comm = TparAllreduce(tpar.Communicator(), max_bytes=8 << 20)

    # the engine's existing call sites stay as they are:
    if self.ca_comm.should_custom_ar(x):
        out = self.ca_comm.custom_all_reduce(x)
    else:
        out = nccl_all_reduce(x)
"""

from __future__ import annotations

from .engines.contract import TparCustomAllreduce


def TparAllreduce(comm, max_bytes: int = 8 << 20) -> TparCustomAllreduce:  # noqa: N802
    """:meth:`TparCustomAllreduce.from_communicator`: ``comm`` (a :class:`tpar.Communicator`,
    closed by ``close()``) behind the engines' contract, for messages up to ``max_bytes``."""
    return TparCustomAllreduce.from_communicator(comm, max_size=max_bytes)
