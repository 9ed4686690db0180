"""An adapter with the method names engines already call on their custom allreduce (vLLM's
and SGLang's ``CustomAllreduce``): ``should_custom_ar``, ``custom_all_reduce``, ``capture`` and
``close``. An engine swaps its object for this one and keeps its own fallback: whenever
``should_custom_ar`` says False, the engine runs its usual path (NCCL), so nothing is ever
skipped silently.

Wiring it into an engine, where the engine builds its custom allreduce::

    from tpar.adapter import TparAllreduce
    self.ca_comm = TparAllreduce(tpar.Communicator(), max_bytes=8 << 20)

    # the engine's existing call sites stay as they are:
    if self.ca_comm.should_custom_ar(x):
        out = self.ca_comm.custom_all_reduce(x)
    else:
        out = nccl_all_reduce(x)

For CUDA tensors ``custom_all_reduce`` goes through ``torch.ops.tpar.all_reduce`` (see
tpar.ops), so the engine's CUDA-graph capture and torch.compile see one opaque op; numpy arrays
and CPU tensors go to the CPU backend.
"""

from __future__ import annotations

import contextlib

from . import Communicator, TparError


class TparAllreduce:
    """``CustomAllreduce``-shaped wrapper of a :class:`tpar.Communicator`."""

    def __init__(self, comm: Communicator, max_bytes: int = 8 << 20, algorithm: str = "one-shot"):
        self.comm = comm
        self.max_bytes = int(max_bytes)
        self.algorithm = algorithm
        self.disabled = False
        self._capturing = False

    def should_custom_ar(self, inp) -> bool:
        """True when tpar can reduce ``inp``: a contiguous CUDA tensor on the communicator's GPU,
        or an array or CPU tensor, of f32, f16 or bf16 of at most ``max_bytes``, and the
        adapter is open."""
        return not self.disabled and self.comm.should_use(inp, self.max_bytes)

    def custom_all_reduce(self, input):
        """Returns a new tensor (or array) holding the sum of ``input`` over all ranks; the
        input is left as it was. Raises TparError where ``should_custom_ar`` would say False."""
        if not self.should_custom_ar(input):
            raise TparError(
                "custom_all_reduce called on an input should_custom_ar refuses; call should_custom_ar first"
            )
        if type(input).__module__.startswith("torch") and input.device.type == "cuda":
            from . import ops

            return ops.all_reduce(input, self.comm)
        out = input.clone() if hasattr(input, "clone") else input.copy()
        return self.comm.all_reduce(input, out=out, algorithm=self.algorithm)

    @contextlib.contextmanager
    def capture(self):
        """The engines enter this around CUDA-graph capture: tpar plans every call inside for
        capture and raises, on exit, any error a kernel reported."""
        self._capturing = True
        try:
            with self.comm.capture():
                yield
        finally:
            self._capturing = False

    def close(self):
        """Releases the communicator; afterwards should_custom_ar says False."""
        if not self.disabled:
            self.disabled = True
            self.comm.close()
