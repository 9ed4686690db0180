"""tpar: low-latency allreduce for tensor-parallel inference on one host.

This package drives tpar's Rust library:

- CUDA tensors (torch) go to tpar's CUDA communicator, which picks tpar's own kernels or NCCL
  for each message (see :meth:`Communicator.decision_for`), queues the work on the tensor's current
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
import tempfile
import warnings
import weakref

from ._tpar import MAX_RANKS as _MAX_RANKS
from ._tpar import Comm as _Comm
from ._tpar import (  # the harness: `tpar tune` and `tpar selftest` for one rank
    TparError,
    TparRefused,
    __version__,
    environment,
    tune,
    verify,
)  # the set-up `import tpar` ran: NVRTC found, CUDA_DEVICE_MAX_CONNECTIONS

__all__ = [
    "Communicator",
    "TparError",
    "TparRefused",
    "__version__",
    "environment",
    "tune",
    "verify",
]  # tpar.adapter, tpar.ops: see there

# The names decision_for() and fused_decision() take for a dtype, besides f32/f16/bf16.
_DTYPE_NAMES = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16"}

# Open communicators by handle, so that torch.ops.tpar.all_reduce (which takes plain values)
# can find its communicator: a weak reference to the native object, dropped when it goes.
_live: dict[int, weakref.ref] = {}
_handles = itertools.count(1)


def _native(handle: int):
    """The native communicator behind ``handle``, or TparError."""
    ref = _live.get(handle)
    comm = None if ref is None else ref()
    if comm is None:
        raise TparError(
            f"no open tpar communicator has handle {handle}; it was closed or never created"
        )
    return comm


_lookup = _native  # the name tpar.ops used before it called the native object directly


def _cuda_ordinal(device):
    """The CUDA ordinal ``device`` names, or None for the CPU. ``None`` means the current CUDA
    device when torch is imported and sees a GPU, else the CPU."""
    import sys

    torch = sys.modules.get("torch")
    if device is None:
        if torch is not None and torch.cuda.is_available():
            return torch.cuda.current_device()
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise TparError(f"device={device}: a CUDA ordinal is 0 or more")
        return _existing(torch, device)
    name = str(device)
    if name == "cpu":
        return None
    if name == "cuda":
        return torch.cuda.current_device() if torch is not None else 0
    if name.startswith("cuda:") and name[5:].isdigit():
        return _existing(torch, int(name[5:]))
    raise TparError(
        f"device={device!r}: use None, 'cpu', a CUDA ordinal, 'cuda', 'cuda:N' or a torch.device"
    )


def _existing(torch, ordinal: int) -> int:
    """``ordinal``, or TparError where torch (when the program imported it) sees no such GPU:
    said before any rank waits for this one."""
    if torch is None:
        return ordinal
    if not torch.cuda.is_available():
        raise TparError(
            f"device=cuda:{ordinal}: torch sees no CUDA GPU here (no driver or no device); "
            "pass device='cpu' for tpar's CPU backend"
        )
    count = torch.cuda.device_count()
    if ordinal >= count:
        raise TparError(
            f"device=cuda:{ordinal}: there is no GPU {ordinal}; torch sees {count} CUDA "
            f"device(s), cuda:0 to cuda:{count - 1}"
        )
    return ordinal


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


def _group_failure(cause_rank: int, reason: str, failed: int) -> TparError:
    """The one error every rank of a group raises when creating the group's communicator
    failed somewhere: it names the rank whose failure was the cause, and its reason
    (``failed``: how many ranks failed for their own reason)."""
    others = f" (and {failed - 1} more, each for its own reason)" if failed > 1 else ""
    error = TparError(
        f"tpar.Communicator(group=...): group rank {cause_rank} could not create its communicator"
        f"{others}: {reason}"
    )
    error.cause_rank, error.cause = cause_rank, reason
    return error


def _join_group(group, rank, world_size, failure):
    """The rendezvous of a torch.distributed group's ranks, in one all-gather: every rank's
    host (a group over several hosts is refused at once, on every rank), rank 0's private
    directory and job token, and why a rank cannot take part (``failure``: a TparError of its
    arguments), which every rank then raises, naming that rank. Returns (rank, world_size,
    directory, token, owned dir)."""
    import torch.distributed as dist

    from . import _group

    if not dist.is_initialized():
        raise TparError(
            "group=...: torch.distributed is not initialised; call torch.distributed.init_process_group first"
        )
    group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
    if group_rank < 0:
        raise TparError("group=...: this process is not a member of that group")
    if failure is None and (
        (rank is not None and rank != group_rank)
        or (world_size is not None and world_size != group_size)
    ):
        failure = TparError(
            f"rank/world_size ({rank}/{world_size}) disagree with the group ({group_rank}/{group_size})"
        )
    owned = None
    record = {"host": socket.gethostname(), "reason": None if failure is None else str(failure)}
    if group_rank == 0:
        owned = tempfile.mkdtemp(prefix="tpar-group-")
        record.update(dir=os.path.join(owned, "rdv"), token=secrets.token_hex(16))
    try:
        records = _group.gather_records(group, record)
        split = _group.host_split([r["host"] for r in records])
        if split is not None:
            raise _group_failure(split[0], split[1], 1)
        verdict = _group.first_cause(records)
        if verdict is not None:
            raise _group_failure(*verdict)
    except BaseException:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise
    return group_rank, group_size, records[0]["dir"], records[0]["token"], owned


def _agree_on_creation(group, comm, failure):
    """After every rank of a group tried to create its communicator: one all-gather of the
    outcomes, so that all ranks succeed together or all raise the same error naming the rank
    whose failure was the cause (its own reason; a rank that stopped because a peer failed
    says so in ``cause_rank``)."""
    from . import _group

    record = {"reason": None}
    if failure is not None:
        cause_rank = getattr(failure, "cause_rank", None)
        record = {
            "reason": getattr(failure, "cause", None) or str(failure),
            "cause": cause_rank if cause_rank is not None else _group_rank(group),
        }
    verdict = _group.first_cause(_group.gather_records(group, record))
    if verdict is not None:
        if comm is not None:
            comm.close()
        raise _group_failure(*verdict)


def _group_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


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
    naming it. A rank that fails to create its communicator tells the others at once: they
    stop waiting and raise a TparError naming that rank and its reason (with ``group=``, every
    rank raises the same error; ``error.cause_rank`` and ``error.cause`` say it).
    ``max_bytes`` is the largest CUDA tensor :meth:`all_reduce` takes.

    A communicator may be used from any thread (a server's handler threads, an engine's
    helpers) and dropped on any thread; its calls are ordered as they are issued, as on a
    stream. Errors are always :class:`TparError`, refusals its subclass :class:`TparRefused`.

    Any number of communicators may be open at once in one process, and closed and created
    again (also after an error), as long as every rank creates them in the same order.
    ``members=[job ranks]`` makes a subgroup of the rank environment's job (every member names
    the same list; this rank's ``rank`` becomes its index in it); ``group=`` a torch subgroup.

    ``nccl`` says what serves calls tpar's dispatcher gives to NCCL (large messages):
    ``"none"`` (the default, for engines that already hold NCCL: such calls are refused with
    :class:`TparRefused`, and :meth:`should_use` says False and :meth:`decision` and
    :meth:`decision_for` say so beforehand), ``"own"`` (tpar creates its own NCCL communicator at the
    first such call, about 0.5 GiB of device memory, counted in :meth:`memory_footprint`), or
    an existing communicator to borrow: a torch ProcessGroupNCCL or an ``ncclComm_t`` address
    (int) of the same ranks, from the same libnccl.so.2 tpar loads, alive until this
    communicator is closed.

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
        self.handle = None
        if group is not None and (
            members is not None or rendezvous is not None or token is not None
        ):
            raise TparError(
                "pass either group= or members=/rendezvous=/token=, not both (a torch group already "
                "names its members and carries the rendezvous)"
            )
        # With group=, a rank whose arguments are wrong still meets the others (and they all
        # raise naming it); without, it raises at once.
        failure = None
        try:
            rank = _integer("rank", rank)
            if (
                isinstance(world_size, int)
                and not isinstance(world_size, bool)
                and world_size > _MAX_RANKS
            ):
                raise TparError(
                    f"world_size={world_size}: tpar serves 1 to {_MAX_RANKS} ranks (the GPUs of one host); "
                    "for larger groups use NCCL"
                )
            world_size = _integer("world_size", world_size, low=1, high=_MAX_RANKS)
            if rank is not None and world_size is not None and rank >= world_size:
                raise TparError(
                    f"rank={rank} is not below world_size={world_size}: ranks are numbered 0 to {world_size - 1}"
                )
            timeout = _seconds("timeout", timeout)
            chunk_bytes = _integer(
                "chunk_bytes", chunk_bytes, low=64, allow_none=True, high=1 << 30
            )
            max_bytes = _integer("max_bytes", max_bytes, low=1, high=1 << 62)
            if token is not None and not isinstance(token, str):
                raise TparError(f"token={type(token).__name__}: give the job's token as a string")
            if rendezvous is not None and not isinstance(rendezvous, (str, os.PathLike)):
                raise TparError(f"rendezvous={rendezvous!r}: give a directory path")
            if members is not None:
                members = [_integer("members[]", m, allow_none=False) for m in members]
            nccl = _nccl_choice(nccl)
            device = _cuda_ordinal(device)
        except TparError as error:
            if group is None:
                raise
            failure = error
        owned = None
        if group is not None:
            rank, world_size, rendezvous, token, owned = _join_group(
                group, rank, world_size, failure
            )
        self.max_bytes = max_bytes
        self.nccl = nccl if isinstance(nccl, str) else "borrowed"
        created = None
        try:
            try:
                self._comm = _Comm(
                    rank,
                    world_size,
                    None if rendezvous is None else os.fspath(rendezvous),
                    token,
                    timeout,
                    chunk_bytes,
                    device,
                    members,
                    nccl,
                    max_bytes,
                )
            except TparError as error:
                if group is None:
                    raise
                created = error
            if group is not None:
                _agree_on_creation(group, self._comm, created)
        finally:
            if owned is not None:
                # Every rank has read what it needs from the directory (it is empty by now).
                shutil.rmtree(owned, ignore_errors=True)
        for warning in self._comm.warnings:
            warnings.warn(f"tpar: {warning}", RuntimeWarning, stacklevel=2)
        self.handle = next(_handles)
        _live[self.handle] = weakref.ref(self._comm, _forget(self.handle))

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def device(self):
        """The CUDA ordinal of this rank's GPU, or None for a CPU-only communicator."""
        return self._comm.device

    @property
    def last_algorithm(self):
        """What the last call ran: a tpar algorithm or "nccl" (None before the first call)."""
        return self._comm.last_algorithm

    @property
    def last_fused_path(self):
        """``(fused, reason)`` of the last CUDA :meth:`fused_add_rms_norm` (None before one)."""
        return self._comm.last_fused_path

    # -- the call ---------------------------------------------------------------------------

    def all_reduce(self, tensor, out=None, *, algorithm=None):
        """Sums ``tensor`` over all ranks, in place or into ``out`` (the same shape, dtype and
        device), and returns the tensor holding the result.

        A CUDA tensor is reduced on torch's current stream of its device, without
        synchronising: the dispatcher picks tpar's kernels or NCCL for its size once
        (``algorithm=`` forces one; one that cannot run is an error), and
        :attr:`last_algorithm` says what ran. numpy arrays and CPU tensors are reduced
        through shared memory (``algorithm``: any the CPU backend runs; auto or None:
        one-shot). tpar's own algorithms accumulate in fp32 in rank order, so every rank gets
        bitwise the same result. A tensor tpar does not take (dtype, layout, device, over
        ``max_bytes``, a size decided for NCCL with ``nccl="none"``) raises
        :class:`TparRefused` before anything runs."""
        return self._comm.all_reduce(tensor, out, algorithm)

    def decision(self, tensor, *, algorithm=None, max_bytes=None):
        """``(choice, reason)``: what :meth:`all_reduce` of ``tensor`` runs and why, from the
        call's own decision (for a CUDA tensor, the capture state of torch's current stream),
        or ``(None, why)`` where the call would be refused. What an engine's
        ``should_custom_ar`` asks."""
        return self._comm.decision(tensor, algorithm, max_bytes)

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
        too: the allreduce is decided as a plain call of the same bytes (``algorithm=`` forces
        one); on one-shot, two-shot and host-staged one kernel runs the whole op, any other
        path (NCCL, pull, a row above 16384) is followed by tpar's separate
        residual + RMSNorm kernel with the same results. :attr:`last_algorithm` says what the
        allreduce ran and :attr:`last_fused_path` whether it ran fused and why. On the CPU the
        allreduce runs through shared memory (``algorithm``: any the CPU backend runs) and the
        norm on the host. Operands that do not fit (:meth:`fused_fit`) raise :class:`TparRefused`.
        """
        return self._comm.fused_add_rms_norm(
            x, residual, weight, _eps(eps), out, bool(in_place), algorithm
        )

    def fused_fit(self, x, residual, weight, max_bytes=None):
        """None when ``x``, ``residual`` and ``weight`` fit :meth:`fused_add_rms_norm` here, else
        ``(reason, why)`` (``reason`` a short code: "dtype", "mixed", "shapes", "contiguous",
        "device", "size", ...): the one check of the fused operands, which the call makes too."""
        return self._comm.fused_fit(x, residual, weight, max_bytes)

    def fused_decision(self, tokens: int, hidden: int, dtype="bf16", capturing=False):
        """``(algorithm, fused, reason)``: what a CUDA :meth:`fused_add_rms_norm` of ``tokens x
        hidden`` elements of ``dtype`` runs here: its allreduce (as :meth:`decision_for` for the
        same bytes), whether the fused kernel runs it (else the allreduce and tpar's separate
        norm kernel), and why."""
        tokens = _integer("tokens", tokens, allow_none=False, high=1 << 40)
        hidden = _integer("hidden", hidden, allow_none=False, high=1 << 40)
        name = _DTYPE_NAMES.get(str(dtype), str(dtype))
        return self._comm.fused_decision(name, tokens, hidden, bool(capturing))

    def fused_plan(self, tokens: int, hidden: int, dtype="bf16", capturing=False):
        """:meth:`fused_decision`, under the name it was published with (kept for callers)."""
        return self.fused_decision(tokens, hidden, dtype, capturing)

    # -- questions and lifecycle ------------------------------------------------------------

    def should_use(self, tensor, max_bytes=None) -> bool:
        """True when :meth:`all_reduce` takes ``tensor``: a contiguous CUDA tensor on this
        communicator's GPU of float32, float16 or bfloat16 within ``max_bytes`` (this call's and
        the communicator's) that tpar's dispatcher gives to a choice this communicator holds, or
        a contiguous numpy array or CPU tensor of those dtypes. False otherwise, so a caller can
        take another path knowingly (:meth:`decision` says why)."""
        return self._comm.decision(tensor, None, max_bytes)[0] is not None

    def decision_for(self, nbytes: int, dtype="bf16", capturing=False):
        """``(algorithm, reason)``: what a CUDA call of ``nbytes`` of ``dtype`` (f32, f16 or
        bf16, or a torch dtype) runs on this machine, and why (:meth:`decision` asks the same
        of a tensor). With ``nccl="none"`` a call decided for NCCL is refused by
        :meth:`all_reduce`, and the reason says so."""
        nbytes = _integer("nbytes", nbytes, allow_none=False, high=1 << 62)
        name = _DTYPE_NAMES.get(str(dtype), str(dtype))
        return self._comm.decision_for_bytes(name, nbytes, bool(capturing))

    def plan(self, nbytes: int, dtype="bf16", capturing=False):
        """:meth:`decision_for`, under the name it was published with (kept for callers)."""
        return self.decision_for(nbytes, dtype, capturing)

    @contextlib.contextmanager
    def capture(self):
        """Enter around CUDA-graph capture (as engines do with their custom allreduce). tpar's
        buffers are registered when the communicator is created and its call counter lives in
        device memory, so captured calls stay correct on every replay; each call reads the
        capture state of its stream itself. Errors a kernel reported are raised on exit."""
        yield self
        self.check()

    def check(self):
        """Raises the error a kernel or NCCL reported since the last check (a peer that timed
        out, a call that did not match), if any. Every CUDA call checks first as well."""
        if self._comm.device is not None:
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
        _live.pop(self.handle, None)
        if self._comm is not None:
            self._comm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _forget(handle):
    """The callback that drops ``handle`` once its native communicator is gone."""

    def forget(_ref):
        _live.pop(handle, None)

    return forget


def vllm_fusion_pass(graph) -> None:
    """tpar's vLLM fusion pass by name, for ``vllm serve``'s JSON configuration::

        vllm serve MODEL -tp 8 --compilation-config \\
          '{"inductor_passes": {"post_grad_custom_post_pass": "tpar.vllm_fusion_pass"}}'

    vLLM resolves a pass name as an attribute of its top-level package, hence this entry here;
    it runs :class:`tpar.engines.vllm_fusion.TparAllReduceFusionPass` (one per process) on
    ``graph``. Importing ``tpar`` imports neither torch nor vLLM for it."""
    from .engines.vllm_fusion import default_pass

    default_pass()(graph)
