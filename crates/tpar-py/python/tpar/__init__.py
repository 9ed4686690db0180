"""tpar: low-latency allreduce for tensor-parallel inference on one host.

This package drives tpar's Rust library:

- CUDA tensors (torch) go to tpar's CUDA communicator, which picks tpar's own kernels or NCCL
  for each message (see :meth:`Communicator.plan`), queues the work on the tensor's current
  stream with no extra synchronisation, and works inside CUDA-graph capture; ``tpar.ops``
  registers ``torch.ops.tpar.all_reduce`` for torch.compile.
- :meth:`Communicator.fused_add_rms_norm` runs the allreduce with the residual add and RMSNorm
  that follow it in a transformer layer, fused into one kernel where tpar's algorithm allows
  (``tpar.ops.fused_add_rms_norm`` for torch.compile); on the CPU with the same semantics.
- numpy arrays and torch CPU tensors go to the CPU backend (shared memory between the
  processes of one host), with the same protocol, deadlines and error messages.

Ranks find each other through tpar's rank environment (TPAR_RENDEZVOUS, TPAR_JOB_TOKEN, RANK,
WORLD_SIZE), the same values passed to :class:`Communicator`, or an existing torch.distributed
process group (``group=``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import socket
import sys
import tempfile
import warnings
import weakref

from ._tpar import Comm as _Comm
from ._tpar import (  # the harness: `tpar tune` and `tpar selftest` for one rank
    TparError,
    __version__,
    environment,
    tune,
    verify,
)  # the set-up `import tpar` ran: NVRTC found, CUDA_DEVICE_MAX_CONNECTIONS

__all__ = [
    "Communicator",
    "TparError",
    "__version__",
    "environment",
    "tune",
    "verify",
]  # tpar.adapter, tpar.ops: see there

_CPU_ALGORITHMS = ("one-shot", "two-shot")
_TORCH_DTYPES = {
    "torch.float32": ("f32", 4),
    "torch.float16": ("f16", 2),
    "torch.bfloat16": ("bf16", 2),
}
_NUMPY_DTYPES = {"float32": ("f32", 4), "float16": ("f16", 2), "bfloat16": ("bf16", 2)}

# Live communicators by handle, so that torch.ops.tpar.all_reduce (which takes plain values)
# can find its communicator.
_live: weakref.WeakValueDictionary[int, Communicator] = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def _lookup(handle: int) -> Communicator:
    comm = _live.get(handle)
    if comm is None:
        raise TparError(
            f"no open tpar communicator has handle {handle}; it was closed or never created"
        )
    return comm


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _describe_host(array):
    """(dtype name, element size, address, element count, writeable) of a C-contiguous numpy
    array or torch CPU tensor, or TparError saying why it cannot be used."""
    if _is_torch(array):
        if not array.is_contiguous():
            raise TparError("tensor is not contiguous; call .contiguous() first")
        dtype = _TORCH_DTYPES.get(str(array.dtype))
        if dtype is None:
            raise TparError(
                f"dtype {array.dtype} is not supported; use float32, float16 or bfloat16"
            )
        return dtype[0], dtype[1], array.data_ptr(), array.numel(), True
    if type(array).__module__.startswith("numpy"):
        if not array.flags["C_CONTIGUOUS"]:
            raise TparError("array is not C-contiguous; use numpy.ascontiguousarray first")
        dtype = _NUMPY_DTYPES.get(str(array.dtype))
        if dtype is None:
            raise TparError(
                f"dtype {array.dtype} is not supported; use float32, float16 or bfloat16"
            )
        address = array.__array_interface__["data"][0]
        return dtype[0], dtype[1], address, array.size, bool(array.flags["WRITEABLE"])
    raise TparError(f"cannot reduce a {type(array).__name__}: pass a torch tensor or a numpy array")


def _cuda_ordinal(device):
    """The CUDA ordinal ``device`` names, or None for the CPU. ``None`` means the current CUDA
    device when torch is imported and sees a GPU, else the CPU."""
    torch = sys.modules.get("torch")
    if device is None:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.current_device()
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise TparError(f"device={device}: a CUDA ordinal is 0 or more")
        return device
    name = str(device)
    if name == "cpu":
        return None
    if name == "cuda":
        return torch.cuda.current_device() if torch is not None else 0
    if name.startswith("cuda:") and name[5:].isdigit():
        return int(name[5:])
    raise TparError(
        f"device={device!r}: use None, 'cpu', a CUDA ordinal, 'cuda', 'cuda:N' or a torch.device"
    )


def _integer(name, value, low=0, allow_none=True, high=1 << 31):
    """``value`` as an int of at least ``low`` (None passes when allowed), or TparError naming
    the argument."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if (
            type(value).__module__.startswith("numpy")
            and hasattr(value, "item")
            and isinstance(value.item(), int)
        ):
            value = value.item()
        else:
            raise TparError(f"{name}={value!r}: give an integer")
    if value < low or value > high:
        raise TparError(f"{name}={value}: give an integer from {low} to {high}")
    return value


def _eps(value):
    """``eps`` of a norm as a finite float of at least 0, or TparError saying so."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TparError(f"eps={value!r}: give a small positive number such as 1e-6")
    value = float(value)
    if not (value >= 0 and value < float("inf")):  # also refuses NaN
        raise TparError(f"eps={value}: must be finite and >= 0 (e.g. 1e-6)")
    return value


def _seconds(name, value):
    """``value`` as a positive, finite number of seconds, or TparError naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TparError(f"{name}={value!r}: give a number of seconds")
    value = float(value)
    if not (value > 0 and value <= 365 * 86400):  # also refuses NaN
        raise TparError(f"{name}={value}: give a number of seconds above 0 and at most a year")
    return value


def _nccl_choice(nccl):
    """What ``nccl=`` names: "own", "none", an ncclComm_t address, or the communicator behind a
    torch ProcessGroupNCCL (borrowed: tpar's NCCL calls then cost no memory)."""
    if isinstance(nccl, str):
        if nccl not in ("own", "none"):
            raise TparError(
                f"nccl={nccl!r}: use 'own', 'none', a torch ProcessGroupNCCL or an ncclComm_t address (int)"
            )
        return nccl
    if isinstance(nccl, int) and not isinstance(nccl, bool):
        if nccl <= 0:
            raise TparError(f"nccl={nccl}: an ncclComm_t address is a positive integer")
        return nccl
    if type(nccl).__module__.startswith("torch"):
        import torch

        try:
            backend = nccl._get_backend(torch.device("cuda"))
            address = backend._comm_ptr()
        except Exception as e:  # noqa: BLE001 - any failure means the pointer is not reachable
            raise TparError(
                f"nccl=<{type(nccl).__name__}>: cannot reach its NCCL communicator ({e}); this torch does not "
                "expose it: pass nccl='none' and keep NCCL-sized calls on the group, or an ncclComm_t address"
            ) from e
        if not address:
            raise TparError(
                "nccl=<ProcessGroup>: its NCCL communicator is not created yet; run one collective on it first"
            )
        return int(address)
    raise TparError(
        f"nccl={nccl!r}: use 'own', 'none', a torch ProcessGroupNCCL or an ncclComm_t address (int)"
    )


def _join_group(group, rank, world_size):
    """Rendezvous for the ranks of a torch.distributed group: rank 0 of the group makes a
    private directory and a job token and sends them over the group; tpar's own handles then
    travel through that directory. Returns (rank, world_size, directory, token, owned dir)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise TparError(
            "group=...: torch.distributed is not initialised; call torch.distributed.init_process_group first"
        )
    group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
    if group_rank < 0:
        raise TparError("group=...: this process is not a member of that group")
    if (rank is not None and rank != group_rank) or (
        world_size is not None and world_size != group_size
    ):
        raise TparError(
            f"rank/world_size ({rank}/{world_size}) disagree with the group ({group_rank}/{group_size})"
        )
    owned = None
    message = [None]
    if group_rank == 0:
        owned = tempfile.mkdtemp(prefix="tpar-group-")
        message = [(os.path.join(owned, "rdv"), secrets.token_hex(16), socket.gethostname())]
    dist.broadcast_object_list(message, src=dist.get_global_rank(group, 0), group=group)
    directory, token, host = message[0]
    if host != socket.gethostname():
        raise TparError(
            f"group=...: rank 0 of the group runs on {host}, this rank on {socket.gethostname()}; "
            "tpar reduces within one host: pass a group of this host's ranks"
        )
    return group_rank, group_size, directory, token, owned


class Communicator:
    """One rank's allreduce.

    ``Communicator()`` reads the rank environment; ``Communicator(rank, world_size,
    rendezvous=DIR, token=SECRET)`` gives it explicitly; ``Communicator(group=pg)`` joins the
    ranks of a torch.distributed process group (all on this host). ``device`` is this rank's
    GPU (an ordinal, ``"cuda:N"`` or a torch.device; default: torch's current device when torch
    is imported and has a GPU) or ``"cpu"``.

    Every rank must create its communicators in the same order and make the same calls with
    the same sizes and dtypes; a rank that calls differently gets a TparError naming both
    sides, and a rank that stops calling makes the others fail after ``timeout`` seconds
    naming it. ``max_bytes`` is the largest CUDA tensor :meth:`all_reduce` accepts.

    Any number of communicators may be open at once in one process, and closed and created
    again (also after an error), as long as every rank creates them in the same order.
    ``members=[job ranks]`` makes a subgroup of the rank environment's job (every member names
    the same list; this rank's ``rank`` becomes its index in it); ``group=`` a torch subgroup.

    ``nccl`` says what serves calls tpar's dispatcher gives to NCCL (large messages):
    ``"none"`` (the default, for engines that already hold NCCL: such calls are refused, and
    :meth:`should_use` says False and :meth:`plan` says so beforehand), ``"own"`` (tpar creates
    its own NCCL communicator at the first such call, about 0.5 GiB of device memory, counted
    in :meth:`memory_footprint`), or an existing communicator to borrow: a torch
    ProcessGroupNCCL or an ``ncclComm_t`` address (int) of the same ranks, from the same
    libnccl.so.2 tpar loads, alive until this communicator is closed.

    A call blocked waiting for peers on the CPU backend stops on Ctrl-C with KeyboardInterrupt
    within a fraction of a second; the communicator is unusable afterwards (create a new one
    on every rank).
    """

    def __init__(
        self,
        rank=None,
        world_size=None,
        device=None,
        *,
        group=None,
        rendezvous=None,
        token=None,
        max_bytes=64 << 20,
        timeout=30.0,
        chunk_bytes=None,
        members=None,
        nccl="none",
    ):
        self._comm = None
        rank = _integer("rank", rank)
        world_size = _integer("world_size", world_size, low=1)
        if rank is not None and world_size is not None and rank >= world_size:
            raise TparError(
                f"rank={rank} is not below world_size={world_size}: ranks are numbered 0 to {world_size - 1}"
            )
        timeout = _seconds("timeout", timeout)
        chunk_bytes = _integer("chunk_bytes", chunk_bytes, low=64, allow_none=True, high=1 << 30)
        self.max_bytes = _integer("max_bytes", max_bytes, low=1, high=1 << 62)
        if token is not None and not isinstance(token, str):
            raise TparError(f"token={type(token).__name__}: give the job's token as a string")
        if rendezvous is not None and not isinstance(rendezvous, (str, os.PathLike)):
            raise TparError(f"rendezvous={rendezvous!r}: give a directory path")
        if members is not None:
            if group is not None:
                raise TparError(
                    "pass either group= or members=, not both (a torch group already names its members)"
                )
            members = [_integer("members[]", m, allow_none=False) for m in members]
        nccl = _nccl_choice(nccl)
        owned = None
        if group is not None:
            if rendezvous is not None or token is not None:
                raise TparError("pass either group= or rendezvous=/token=, not both")
            rank, world_size, rendezvous, token, owned = _join_group(group, rank, world_size)
        self._device = _cuda_ordinal(device)
        self.nccl = nccl if isinstance(nccl, str) else "borrowed"
        self.last_algorithm = None
        self.last_fused_path = None
        self._capturing = False
        try:
            self._comm = _Comm(
                rank,
                world_size,
                None if rendezvous is None else os.fspath(rendezvous),
                token,
                timeout,
                chunk_bytes,
                self._device,
                members,
                nccl,
            )
            if group is not None:
                # Every rank has mapped what it needs: the directory can go.
                self._comm.barrier()
        finally:
            if owned is not None:
                shutil.rmtree(owned, ignore_errors=True)
        for warning in self._comm.warnings:
            warnings.warn(f"tpar: {warning}", RuntimeWarning, stacklevel=2)
        self.handle = next(_handles)
        _live[self.handle] = self

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def device(self):
        """The CUDA ordinal of this rank's GPU, or None for a CPU-only communicator."""
        return self._device

    # -- the call ---------------------------------------------------------------------------

    def all_reduce(self, tensor, out=None, *, algorithm=None):
        """Sums ``tensor`` over all ranks, in place or into ``out`` (same shape and dtype), and
        returns the tensor holding the result.

        A CUDA tensor is reduced on its current stream, without synchronising: the dispatcher
        picks tpar's kernels or NCCL for its size (``algorithm=`` forces one; one that cannot
        run is an error), and :attr:`last_algorithm` says what ran. numpy arrays and CPU
        tensors are reduced through shared memory (``algorithm``: one-shot or two-shot).
        tpar's own algorithms accumulate in fp32 in rank order, so every rank gets bitwise
        the same result."""
        if _is_torch(tensor) and tensor.device.type == "cuda":
            return self._all_reduce_cuda(tensor, out, algorithm)
        algorithm = algorithm or "one-shot"
        if algorithm not in _CPU_ALGORITHMS:
            raise TparError(
                f"unknown CPU algorithm {algorithm!r}; use one of {', '.join(_CPU_ALGORITHMS)}"
            )
        dtype, _, address, count, writeable = _describe_host(tensor)
        if out is None:
            if not writeable:
                raise TparError("array is read-only; pass out= or a writeable array")
            self._comm.all_reduce_ptr(dtype, None, address, count, algorithm)
            return tensor
        if _is_torch(out) and out.device.type != "cpu":
            raise TparError(
                f"out is on {out.device} but the input is on the CPU; they must be on the same device"
            )
        out_dtype, _, out_address, out_count, out_writeable = _describe_host(out)
        if (out_dtype, out_count) != (dtype, count):
            raise TparError(
                f"out holds {out_count} {out_dtype} elements, input {count} {dtype}; they must match"
            )
        if not out_writeable:
            raise TparError("out is read-only")
        self._comm.all_reduce_ptr(dtype, address, out_address, count, algorithm)
        return out

    def _cuda_refusal(self, tensor, max_bytes=None, algorithm=None):
        """Why this communicator cannot reduce the CUDA ``tensor``, or None when it can. A forced
        ``algorithm`` is checked by the call itself (with its own reason), not by the plan."""
        if self._device is None:
            return (
                f"tensor on {tensor.device} but this communicator has no GPU: "
                f"create it with device={tensor.device.index} (or device='cuda:{tensor.device.index}')"
            )
        if tensor.device.index != self._device:
            return f"tensor on {tensor.device} but this communicator's GPU is cuda:{self._device}; move the tensor or use that GPU's communicator"
        dtype = _TORCH_DTYPES.get(str(tensor.dtype))
        if dtype is None:
            return f"dtype {tensor.dtype} is not supported; use float32, float16 or bfloat16"
        if not tensor.is_contiguous():
            return "tensor is not contiguous; call .contiguous() first"
        limit = self.max_bytes if max_bytes is None else min(max_bytes, self.max_bytes or max_bytes)
        size = tensor.numel() * dtype[1]
        if limit is not None and size > limit:
            return (
                f"tensor of {size} bytes is over the limit of {limit} bytes (max_bytes); raise max_bytes= "
                "when creating the Communicator, or reduce larger tensors with torch.distributed"
            )
        import torch

        if algorithm is not None:
            return None
        capturing = self._capturing or torch.cuda.is_current_stream_capturing()
        return self._comm.refusal(dtype[0], size, capturing)

    def _all_reduce_cuda(self, tensor, out, algorithm):
        import torch

        why = self._cuda_refusal(tensor, algorithm=algorithm)
        if why:
            raise TparError(why)
        dtype = _TORCH_DTYPES[str(tensor.dtype)][0]
        count = tensor.numel()
        if out is None:
            source, target = None, tensor
        else:
            if not _is_torch(out) or out.device != tensor.device:
                raise TparError(f"out must be a tensor on {tensor.device}, like the input")
            if out.dtype != tensor.dtype or out.numel() != count:
                raise TparError(
                    f"out holds {out.numel()} {out.dtype} elements, input {count} {tensor.dtype}; they must match"
                )
            if not out.is_contiguous():
                raise TparError("out is not contiguous")
            source, target = tensor.data_ptr(), out
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        capturing = self._capturing or torch.cuda.is_current_stream_capturing()
        self.last_algorithm = self._comm.all_reduce_cuda(
            dtype, source, target.data_ptr(), count, stream, capturing, algorithm
        )
        return target

    # -- fused allreduce + residual add + RMSNorm --------------------------------------------

    def fused_add_rms_norm(
        self, x, residual, weight, eps=1e-6, *, out=None, in_place=True, algorithm=None
    ):
        """The allreduce of ``x`` fused with the residual add and RMSNorm that follow it in a
        transformer layer; returns ``(y, residual_out)``.

        ``x`` and ``residual`` have the same shape ``(..., hidden)`` (every leading dimension is a
        token), ``weight`` has ``hidden`` elements; all three are contiguous, of one dtype
        (float32, float16, bfloat16) and on one device (this communicator's GPU, or the CPU:
        numpy arrays or torch CPU tensors). Per element, exactly (``tpar::norm``):

        1. ``s = round(x_0 + x_1 + ... + x_{n-1})``: summed in fp32 in rank order, rounded once
           to the dtype (the plain :meth:`all_reduce`);
        2. ``residual_out = round(float(s) + float(residual))``;
        3. per token, ``inv = 1 / sqrt(mean(residual_out ** 2) + eps)`` in fp32 from the rounded
           ``residual_out`` (a fixed summation order, a correctly rounded square root);
        4. ``y = round(float(round(residual_out * inv)) * float(weight))``.

        That is vLLM's and SGLang's ``fused_add_rms_norm`` applied to the allreduced ``x``, and
        every rank gets bitwise the same ``y`` and ``residual_out`` (eager, in graphs, fused or
        not). ``y`` may differ from vLLM's kernel in the last bit (it uses an approximate rsqrt).

        ``in_place=True`` (the default) writes ``residual_out`` into ``residual`` and returns it;
        ``in_place=False`` leaves ``residual`` as it was and returns a new array or tensor.
        ``y`` goes into ``out`` when given (same shape and dtype; it may be ``x`` itself: with
        ``out=x`` and ``in_place=True`` this is the engines' in-place convention), else into a
        new one. ``out`` must not overlap ``residual``; ``x`` itself is only read.

        CUDA tensors run on their current stream without synchronising, inside graph capture
        too: the allreduce is planned as a plain call of the same bytes (``algorithm=`` forces
        one); on one-shot, two-shot and host-staged one kernel runs the whole op, any other
        path (NCCL, pull, a row above 16384) is followed by tpar's separate
        residual + RMSNorm kernel with the same results. :attr:`last_algorithm` says what the allreduce ran and
        :attr:`last_fused_path` whether it ran fused and why. On the CPU the allreduce runs
        through shared memory (``algorithm``: one-shot or two-shot) and the norm on the host.
        """
        torch_input = _is_torch(x)
        if torch_input and x.device.type == "cuda":
            return self._fused_cuda(x, residual, weight, eps, out, in_place, algorithm)
        algorithm = algorithm or "one-shot"
        if algorithm not in _CPU_ALGORITHMS:
            raise TparError(
                f"unknown CPU algorithm {algorithm!r}; use one of {', '.join(_CPU_ALGORITHMS)}"
            )
        tokens, hidden = self._fused_shape(x, residual, weight)
        eps = _eps(eps)
        described = {}
        for name, value in (("x", x), ("residual", residual), ("weight", weight)):
            if _is_torch(value) != torch_input:
                raise TparError(
                    f"{name} is a {type(value).__name__} but x is a {type(x).__name__}; pass one kind"
                )
            if _is_torch(value) and value.device.type != "cpu":
                raise TparError(
                    f"{name} is on {value.device} but x is on the CPU; they must be on the same device"
                )
            described[name] = _describe_host(value)
        dtype = described["x"][0]
        for name in ("residual", "weight"):
            if described[name][0] != dtype:
                raise TparError(
                    f"{name} is {described[name][0]} but x is {dtype}; all operands must have one dtype"
                )
        if in_place and not described["residual"][4]:
            raise TparError("residual is read-only; pass in_place=False or a writeable array")
        residual_out = None
        if not in_place:
            residual_out = residual.clone() if torch_input else residual.copy()
        if out is None:
            out = x.clone() if torch_input else x.copy()
        else:
            if _is_torch(out) != torch_input or (torch_input and out.device.type != "cpu"):
                raise TparError(f"out must be a {type(x).__name__} on the CPU, like x")
            out_dtype, _, _, out_count, out_writeable = _describe_host(out)
            if out_dtype != dtype or tuple(out.shape) != tuple(x.shape):
                raise TparError(
                    f"out is {tuple(out.shape)} {out_dtype}, x {tuple(x.shape)} {dtype}; they must match"
                )
            if not out_writeable:
                raise TparError("out is read-only")
        self._comm.fused_add_rms_norm_ptr(
            dtype,
            tokens,
            hidden,
            described["x"][2],
            described["residual"][2],
            None if residual_out is None else _describe_host(residual_out)[2],
            described["weight"][2],
            _describe_host(out)[2],
            eps,
            algorithm,
        )
        return out, (residual if residual_out is None else residual_out)

    @staticmethod
    def _fused_shape(x, residual, weight):
        """(tokens, hidden) of a fused call, or TparError naming the mismatch."""
        shape = tuple(x.shape)
        if len(shape) == 0:
            raise TparError("x is a scalar; give it the shape (tokens, hidden)")
        if tuple(residual.shape) != shape:
            raise TparError(
                f"residual has shape {tuple(residual.shape)} but x has {shape}; they must match"
            )
        hidden = shape[-1]
        if tuple(weight.shape) != (hidden,):
            raise TparError(
                f"weight has shape {tuple(weight.shape)}; it must be ({hidden},), the hidden size of x"
            )
        tokens = 1
        for d in shape[:-1]:
            tokens *= d
        if hidden == 0 and tokens:
            raise TparError("x has a hidden size of 0; its last dimension is the hidden size")
        return tokens, hidden

    def _fused_cuda(self, x, residual, weight, eps, out, in_place, algorithm):
        import torch

        tokens, hidden = self._fused_shape(x, residual, weight)
        eps = _eps(eps)
        for name, value in (("residual", residual), ("weight", weight)) + (
            (("out", out),) if out is not None else ()
        ):
            if not _is_torch(value) or value.device != x.device:
                where = value.device if _is_torch(value) else f"a {type(value).__name__}"
                raise TparError(
                    f"{name} is on {where} but x is on {x.device}; they must be on the same device"
                )
            if value.dtype != x.dtype:
                raise TparError(
                    f"{name} is {value.dtype} but x is {x.dtype}; all operands must have one dtype"
                )
            if not value.is_contiguous():
                raise TparError(f"{name} is not contiguous; call .contiguous() first")
        if out is not None and tuple(out.shape) != tuple(x.shape):
            raise TparError(
                f"out has shape {tuple(out.shape)} but x has {tuple(x.shape)}; they must match"
            )
        why = self._cuda_refusal(x, algorithm=algorithm)
        if why:
            raise TparError(why.replace("tensor ", "x ", 1))
        dtype = _TORCH_DTYPES[str(x.dtype)][0]
        y = torch.empty_like(x) if out is None else out
        residual_out = None if in_place else torch.empty_like(residual)
        stream = torch.cuda.current_stream(x.device).cuda_stream
        capturing = self._capturing or torch.cuda.is_current_stream_capturing()
        choice, fused, reason = self._comm.fused_add_rms_norm_cuda(
            dtype,
            tokens,
            hidden,
            x.data_ptr(),
            residual.data_ptr(),
            None if residual_out is None else residual_out.data_ptr(),
            weight.data_ptr(),
            y.data_ptr(),
            eps,
            stream,
            capturing,
            algorithm,
        )
        self.last_algorithm = choice
        self.last_fused_path = (fused, reason)
        return y, (residual if residual_out is None else residual_out)

    def fused_plan(self, tokens: int, hidden: int, dtype="bf16", capturing=False):
        """``(algorithm, fused, reason)``: what a CUDA :meth:`fused_add_rms_norm` of ``tokens x
        hidden`` elements of ``dtype`` runs here: its allreduce (as :meth:`plan` for the same
        bytes), whether the fused kernel runs it (else the allreduce and tpar's separate norm
        kernel), and why."""
        tokens = _integer("tokens", tokens, allow_none=False, high=1 << 40)
        hidden = _integer("hidden", hidden, allow_none=False, high=1 << 40)
        name = _TORCH_DTYPES.get(str(dtype), (str(dtype),))[0]
        return self._comm.fused_plan(name, tokens, hidden, bool(capturing))

    # -- questions and lifecycle ------------------------------------------------------------

    def should_use(self, tensor, max_bytes=None) -> bool:
        """True when :meth:`all_reduce` can take ``tensor``: a contiguous CUDA tensor on this
        communicator's GPU of float32, float16 or bfloat16 within ``max_bytes`` (this call's and
        the communicator's), or a contiguous numpy array or CPU tensor of those dtypes. False
        otherwise, so a caller can take another path knowingly."""
        if _is_torch(tensor) and tensor.device.type == "cuda":
            return self._cuda_refusal(tensor, max_bytes) is None
        try:
            _, size, _, count, _ = _describe_host(tensor)
        except TparError:
            return False
        return max_bytes is None or size * count <= max_bytes

    def plan(self, nbytes: int, dtype="bf16", capturing=False):
        """``(algorithm, reason)``: what a CUDA call of ``nbytes`` of ``dtype`` (f32, f16 or
        bf16, or a torch dtype) runs on this machine, and why. With ``nccl="none"`` a call
        planned for NCCL is refused by :meth:`all_reduce`, and the reason says so."""
        nbytes = _integer("nbytes", nbytes, allow_none=False, high=1 << 62)
        name = _TORCH_DTYPES.get(str(dtype), (str(dtype),))[0]
        return self._comm.plan(name, nbytes, bool(capturing))

    @contextlib.contextmanager
    def capture(self):
        """Enter around CUDA-graph capture (as engines do with their custom allreduce). tpar's
        buffers are registered when the communicator is created and its call counter lives in
        device memory, so captured calls stay correct on every replay; inside, the dispatcher
        plans for capture. Errors a kernel reported are raised on exit."""
        previous, self._capturing = self._capturing, True
        try:
            yield self
        finally:
            self._capturing = previous
        self.check()

    def check(self):
        """Raises the error a kernel or NCCL reported since the last check (a peer that timed
        out, a call that did not match), if any. Every CUDA call checks first as well."""
        if self._device is not None:
            self._comm.check()

    def memory_footprint(self) -> dict:
        """Bytes this rank took: device_bytes, pinned_host_bytes, shared_host_bytes (and their
        sum, allocated_bytes), peers' memory mapped into it (peer_mapped_bytes), with the
        figures of each backend under "cpu" and "cuda". device_bytes is split into
        device_buffer_bytes (tpar's buffers), module_bytes (tpar's kernels, measured as the drop
        in free device memory around their load; one per process and GPU, shared by its
        communicators) and nccl_bytes (the NCCL communicator tpar created itself with
        nccl="own", measured around its creation; 0 with "none" or a borrowed one)."""
        return self._comm.memory_footprint()

    def close(self):
        """Waits for queued GPU work, then releases every buffer. Later calls raise TparError.
        A communicator that is dropped without close() releases the same when collected."""
        _live.pop(getattr(self, "handle", None), None)
        if self._comm is not None:
            self._comm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def vllm_fusion_pass(graph) -> None:
    """tpar's vLLM fusion pass by name, for ``vllm serve``'s JSON configuration::

        vllm serve MODEL -tp 8 --compilation-config \\
          '{"inductor_passes": {"post_grad_custom_post_pass": "tpar.vllm_fusion_pass"}}'

    vLLM resolves a pass name as an attribute of its top-level package, hence this entry here;
    it runs :class:`tpar.engines.vllm_fusion.TparAllReduceFusionPass` (one per process) on
    ``graph``. Importing ``tpar`` imports neither torch nor vLLM for it."""
    from .engines.vllm_fusion import default_pass

    default_pass()(graph)
