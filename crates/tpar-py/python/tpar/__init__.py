"""tpar: low-latency allreduce for tensor-parallel inference on one host.

This package drives tpar's Rust library. Today it carries the CPU backend: allreduce of numpy
arrays (and torch CPU tensors) between the processes of one host through shared memory, with
the same protocol, deadlines and error messages as the GPU path. The CUDA path (torch CUDA
tensors, CUDA graphs, torch.compile) is not in this package yet and is refused by name.

Ranks find each other like `tpar`'s own ranks: TPAR_RENDEZVOUS (a private directory),
TPAR_JOB_TOKEN (a secret shared by the job), RANK and WORLD_SIZE in the environment, or the same
values passed to :class:`Communicator`.
"""

from __future__ import annotations

from ._tpar import CpuComm as _CpuComm
from ._tpar import TparError
from ._tpar import __version__

__all__ = ["Communicator", "TparError", "__version__"]  # tpar.adapter.TparAllreduce: the engine-shaped wrapper

_ALGORITHMS = ("one-shot", "two-shot")


def _describe(array):
    """(dtype name, address, element count, writeable) of a C-contiguous numpy array or torch
    CPU tensor, or TparError saying why it cannot be used."""
    module = type(array).__module__
    if module.startswith("torch"):
        if array.device.type != "cpu":
            raise TparError(
                f"tensor on {array.device}: this tpar package runs the CPU backend only; "
                "the CUDA path is not in the Python package yet"
            )
        if not array.is_contiguous():
            raise TparError("tensor is not contiguous; call .contiguous() first")
        names = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}
        dtype = names.get(str(array.dtype))
        if dtype is None:
            raise TparError(f"dtype {array.dtype} is not supported; use float32, float16 or bfloat16")
        return dtype, array.data_ptr(), array.numel(), True
    if module.startswith("numpy"):
        if not array.flags["C_CONTIGUOUS"]:
            raise TparError("array is not C-contiguous; use numpy.ascontiguousarray first")
        names = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
        dtype = names.get(str(array.dtype))
        if dtype is None:
            raise TparError(f"dtype {array.dtype} is not supported; use float32, float16 or bfloat16")
        address = array.__array_interface__["data"][0]
        return dtype, address, array.size, bool(array.flags["WRITEABLE"])
    raise TparError(f"cannot reduce a {type(array).__name__}: pass a numpy array or a torch CPU tensor")


class Communicator:
    """One rank's allreduce.

    ``Communicator()`` reads the rank environment; ``Communicator(rank, world_size,
    rendezvous=DIR, token=SECRET)`` gives it explicitly. Every rank must create its
    communicators in the same order and make the same calls with the same sizes and dtypes;
    a rank that calls differently gets a TparError naming both sides, and a rank that stops
    calling makes the others fail after ``timeout`` seconds naming it.
    """

    def __init__(self, rank=None, world_size=None, device=None, *, rendezvous=None, token=None,
                 timeout=30.0, chunk_bytes=128 << 10):
        if device not in (None, "cpu"):
            raise TparError(
                f"device={device!r}: this tpar package runs the CPU backend only; "
                "the CUDA path is not in the Python package yet"
            )
        self._comm = _CpuComm(rank, world_size, rendezvous, token, float(timeout), int(chunk_bytes))

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    def all_reduce(self, array, out=None, *, algorithm="one-shot"):
        """Sums ``array`` over all ranks, in place or into ``out`` (same shape and dtype), and
        returns the array holding the result. Every rank gets bitwise the same result: the
        sum is accumulated in fp32 in rank order."""
        if algorithm not in _ALGORITHMS:
            raise TparError(f"unknown algorithm {algorithm!r}; use one of {', '.join(_ALGORITHMS)}")
        dtype, address, count, writeable = _describe(array)
        if out is None:
            if not writeable:
                raise TparError("array is read-only; pass out= or a writeable array")
            self._comm.all_reduce_ptr(dtype, None, address, count, algorithm)
            return array
        out_dtype, out_address, out_count, out_writeable = _describe(out)
        if (out_dtype, out_count) != (dtype, count):
            raise TparError(f"out holds {out_count} {out_dtype} elements, input {count} {dtype}; they must match")
        if not out_writeable:
            raise TparError("out is read-only")
        self._comm.all_reduce_ptr(dtype, address, out_address, count, algorithm)
        return out

    def should_use(self, array, max_bytes=None) -> bool:
        """True when :meth:`all_reduce` can take ``array`` (a contiguous numpy array or torch
        CPU tensor of float32, float16 or bfloat16) and, if given, it holds at most
        ``max_bytes``. False otherwise, so a caller can take another path knowingly."""
        try:
            dtype, _, count, _ = _describe(array)
        except TparError:
            return False
        size = {"f32": 4, "f16": 2, "bf16": 2}[dtype] * count
        return max_bytes is None or size <= max_bytes

    def memory_footprint(self) -> dict:
        """Bytes this rank allocated (shared_host_bytes for the CPU backend) and peers' memory
        mapped into it."""
        return self._comm.memory_footprint()

    def close(self):
        """Releases the shared memory. Later calls raise TparError."""
        self._comm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
