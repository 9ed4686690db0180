"""The engines' custom-allreduce contract, served by one tpar communicator per group.

:class:`TparCustomAllreduce` is what vLLM's ``CudaCommunicator`` and SGLang's
``GroupCoordinator`` construct once the plugin has swapped their class (see
:mod:`tpar.engines`): built from the engine's CPU (gloo) group and the rank's device, it
answers ``should_custom_ar`` from the decision tpar's call would make (so a size tpar would give
to NCCL stays on the engine's own NCCL, which already exists: tpar opens none), and
``custom_all_reduce`` returns a new tensor. It is also the one class for a communicator the
caller built itself (:meth:`TparCustomAllreduce.from_communicator`; ``tpar.adapter`` names it).

Construction is a group decision (:func:`group_vote`) that never stalls: a first vote carries
what each rank found without any collective of tpar's (its device, its host: a group over
several hosts is declined there), then the ranks create the communicator together, and a rank
that fails tells the others at once; if any rank cannot open tpar, every rank stays disabled
with one warning naming the rank whose failure was the cause and its reason, and the engine's
NCCL reduces every size on every rank alike.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import socket
import sys

DEFAULT_MAX_SIZE = 8 << 20
"""The engines' default ``max_size`` (vLLM's and SGLang's CustomAllreduce: 8 MiB)."""

# Sizes the log line reports the choice of, from 1 KiB up to max_size.
_LOG_SIZES = tuple(1 << s for s in range(10, 31))

logger = logging.getLogger("tpar.engines")
if not logger.handlers:
    # Engines configure their own loggers only; without a handler of its own the one line a
    # worker writes to say tpar took its group would be dropped (Python prints only warnings
    # when nothing is configured).
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [tpar] %(message)s", "%m-%d %H:%M:%S")
    )
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


# Keys of the fallbacks already logged: an engine's fallback is said once per process.
_logged_once: set = set()


def log_once(key, message: str, *args, warning: bool = False) -> None:
    """Logs ``message`` (``%``-style ``args``) the first time ``key`` is seen in this process."""
    if key in _logged_once:
        return
    _logged_once.add(key)
    (logger.warning if warning else logger.info)(message, *args)


def enabled() -> bool:
    """False when ``TPAR_ALLREDUCE`` is 0/false/off/no: the engine keeps its own class."""
    return os.environ.get("TPAR_ALLREDUCE", "1").strip().lower() not in ("0", "false", "off", "no")


def group_vote(group, failure: str | None, cause: int | None = None):
    """Every rank of ``group`` calls this with None (it can use tpar) or the reason it cannot
    (``cause``: the group rank whose failure that was, when it was another rank's); returns
    None when every rank can, else ``(rank, reason, failed)``: the rank whose failure was the
    cause (the lowest that failed for its own reason), its reason and how many ranks failed,
    the same tuple on every rank. Every rank's host travels with its vote: a group over
    several hosts is declined, naming them.

    One all-gather of a short row per rank decides. Every rank makes the same collective,
    whatever it voted."""
    import torch.distributed as dist

    from .._group import first_cause, gather_records, host_split

    rank = dist.get_rank(group)
    record = {"host": socket.gethostname(), "reason": failure, "cause": rank}
    if failure is not None and cause is not None:
        record["cause"] = cause
    records = gather_records(group, record)
    split = host_split([r.get("host") for r in records])
    if split is not None:
        return split[0], split[1], 1
    return first_cause(records)


def _communicator_kwargs(communicator_class) -> dict:
    """``nccl="none"`` when this tpar's Communicator takes it: tpar must not open a second NCCL
    per group beside the engine's (about 0.5 GiB a GPU each)."""
    try:
        parameters = inspect.signature(communicator_class).parameters
    except (TypeError, ValueError):
        return {}
    accepts = "nccl" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return {"nccl": "none"} if accepts else {}


def _format_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


class TparCustomAllreduce:
    """vLLM's / SGLang's ``CustomAllreduce`` contract on a tpar communicator.

    ``group`` is the engine's CPU (gloo) process group of this tensor-parallel group, ``device``
    the rank's CUDA device (a torch.device, ``"cuda:N"`` or an ordinal; ``"cpu"`` gives tpar's
    shared-memory backend, used by the tests), ``max_size`` the largest message in bytes
    (messages over it stay on the engine's NCCL). Other keyword arguments the engines pass
    (vLLM's ``symm_mem_enabled``, ``register_graph_buffers``, the all-gather/reduce-scatter
    sizes) are accepted and kept in :attr:`engine_kwargs`: tpar registers its buffers when it
    is created and does no all-gather or reduce-scatter.

    Never raises from the constructor for a failure to open tpar: every rank votes, and if any
    failed, all stay ``disabled`` with one warning naming the rank and its reason.

    ``tpar.adapter.TparAllreduce(comm, max_bytes)`` is this class over a communicator the
    caller built (:meth:`from_communicator`).
    """

    # What the engines read before (or without) a successful construction.
    disabled = True
    original_disabled = True
    _IS_CAPTURING = False
    comm = None

    def __init__(self, group, device, max_size=DEFAULT_MAX_SIZE, **kwargs):
        self.disabled = True
        self.original_disabled = True
        self._IS_CAPTURING = False
        # vLLM's DeepSeek-V4.1 mHC path reads this and needs NVLink multicast: tpar has none.
        self.mnnvl_lamport_ag_multicast_ptr = 0
        self.group = group
        self.max_size = int(max_size)
        self.engine_kwargs = dict(kwargs)
        self.comm = None
        self._native = None
        self._cuda = False
        self._decision_warned = False

        import torch.distributed as dist

        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        self.device = device
        if self.world_size == 1:
            # Every rank of a one-rank group sees the same: nothing to vote on.
            return

        failure = self._preflight(device)
        verdict = group_vote(group, failure)
        if verdict is None:
            # Every rank reaches the communicator's own collectives (rendezvous over the
            # group): opening it cannot leave one rank waiting for a collective the others skip,
            # and a rank that fails there tells the others at once.
            failure, cause = self._open()
            verdict = group_vote(group, failure, cause)
        if verdict is not None:
            self.close()
            rank, reason, failed = verdict
            others = f" (and {failed - 1} more)" if failed > 1 else ""
            logger.warning(
                "tpar is off for this group of %d ranks: group rank %d%s could not open it: %s. "
                "Every rank keeps the engine's NCCL for every size.",
                self.world_size,
                rank,
                others,
                reason,
            )
            return
        self._enable()
        logger.info("%s", self.describe())

    @classmethod
    def from_communicator(cls, comm, max_size=DEFAULT_MAX_SIZE):
        """This class over a :class:`tpar.Communicator` the caller built (and owns: ``close``
        closes it), enabled at once (there is nothing to vote on): sizes over ``max_size`` and
        those tpar's decision gives to NCCL stay on the caller's path."""
        self = cls.__new__(cls)
        self.group = None
        self.engine_kwargs = {}
        self.max_size = int(max_size)
        self.rank, self.world_size = comm.rank, comm.world_size
        self._cuda = comm.device is not None
        self.device = _torch_device(comm.device)
        self._decision_warned = False
        self._IS_CAPTURING = False
        self.mnnvl_lamport_ag_multicast_ptr = 0
        self.comm = comm
        self._enable()
        return self

    def _enable(self):
        self._native = self.comm._comm
        self.disabled = False
        self.original_disabled = False

    # -- construction ------------------------------------------------------------------------

    def _preflight(self, device):
        """Why this rank cannot open tpar, found without any collective, or None: a device
        that is not there, a bad ``max_size``, no tpar module."""
        try:
            import torch

            if isinstance(device, int) and not isinstance(device, bool):
                device = torch.device("cuda", device)
            device = torch.device(device)
            if device.type == "cuda":
                if not torch.cuda.is_available():
                    return f"{device}: torch sees no CUDA device"
                count = torch.cuda.device_count()
                index = torch.cuda.current_device() if device.index is None else device.index
                if index >= count:
                    return (
                        f"cuda:{index} does not exist: torch sees {count} CUDA device(s), "
                        f"cuda:0 to cuda:{count - 1}"
                    )
                device = torch.device("cuda", index)
                self._cuda = True
            elif device.type != "cpu":
                return f"device {device} is neither CUDA nor the CPU"
            if self.max_size < 1:
                return f"max_size={self.max_size}: give the largest message in bytes (at least 1)"
            self.device = device
            import tpar  # noqa: F401  (the native module: a missing or broken one is a reason)
        except Exception as error:  # every failure is a vote, never a one-rank exception
            return f"{type(error).__name__}: {error}"
        return None

    def _open(self):
        """Opens the tpar communicator over the group: ``(None, None)``, or the reason it
        failed and the group rank whose failure that was (where it was another rank's, or
        None)."""
        try:
            import tpar

            self.comm = tpar.Communicator(
                group=self.group,
                device=self.device.index if self._cuda else "cpu",
                max_bytes=self.max_size,
                **_communicator_kwargs(tpar.Communicator),
            )
        except Exception as error:
            cause = getattr(error, "cause_rank", None)
            reason = getattr(error, "cause", None)
            if cause is not None and reason:
                return reason, cause
            return f"{type(error).__name__}: {error}", None
        return None, None

    def describe(self) -> str:
        """One line: which group tpar took and what runs per size (bf16), for the log."""
        choices = []
        for size in _LOG_SIZES:
            if size > self.max_size:
                break
            choices.append((size, self._choice_name(size, "bf16", False)))
        spans = []
        for size, name in choices:
            if spans and spans[-1][2] == name:
                spans[-1][1] = size
            else:
                spans.append([size, size, name])
        text = ", ".join(
            f"{_format_bytes(lo)}{'' if lo == hi else '-' + _format_bytes(hi)} {'engine NCCL' if n == 'nccl' else n}"
            for lo, hi, n in spans
        )
        where = f"cuda:{self.device.index}" if self._cuda else "cpu"
        return (
            f"tpar took the allreduce of this group (rank {self.rank} of {self.world_size}, {where}): "
            f"bf16 {text}; over {_format_bytes(self.max_size)} engine NCCL"
        )

    def _choice_name(self, nbytes: int, dtype, capturing: bool) -> str:
        """tpar's algorithm for the size (its decision's choice), or "nccl" for one the engine's
        NCCL should take."""
        if not self._cuda:
            return "one-shot"
        try:
            algorithm, _reason = self.comm.decision_for(nbytes, dtype, capturing)
        except Exception as error:
            # The engine's NCCL is always correct; say so once rather than fail the call.
            if not self._decision_warned:
                self._decision_warned = True
                logger.warning(
                    "tpar could not decide %d bytes of %s (%s); such sizes stay on the engine's NCCL",
                    nbytes,
                    dtype,
                    error,
                )
            return "nccl"
        return "nccl" if str(algorithm).startswith("nccl") else str(algorithm)

    # -- the calls the engines make ----------------------------------------------------------

    def should_custom_ar(self, inp) -> bool:
        """True when tpar reduces ``inp``: f32/f16/bf16, contiguous, not empty, on this rank's
        device, at most ``max_size`` bytes, and decided for tpar's own kernels (a size tpar
        would give to NCCL stays on the engine's NCCL). The answer is the decision tpar's call
        makes (one query into tpar, cached there per dtype, size and capture state of the
        current stream, which every rank shares), so all ranks decide alike and SGLang's second
        question gets the same answer."""
        native = self._native
        if not self._routable(inp):
            return False
        choice, _why = native.decision(inp, None, self.max_size)
        return choice is not None and choice != "nccl"

    def custom_all_reduce(self, input):
        """The sum of ``input`` over the group in a new tensor (the input is left as it was and
        the result is never a view of tpar's buffers). Never None where ``should_custom_ar``
        said True; None where it said False, as the engines' own class does: the call itself
        decides once and refuses what ``should_custom_ar`` refuses."""
        if not self._routable(input):
            return None
        try:
            return self._native.all_reduce_new(input, None, self.max_size)
        except _refused():
            return None

    def _routable(self, inp) -> bool:
        """Whether tpar is open and ``inp`` is not empty and where this object reduces (a GPU
        object's tensors on the GPU, a CPU object's on the host): what the call itself does not
        refuse but the engines' contract does."""
        if self.disabled or self._native is None:
            return False
        is_cuda = getattr(inp, "is_cuda", None)
        if is_cuda is None:  # a numpy array (tpar.adapter over a CPU communicator)
            return not self._cuda and inp.size > 0
        # numel(), not nbytes: Dynamo traces this under SGLang's torch.compile.
        return is_cuda == self._cuda and inp.numel() > 0

    def fused_allreduce_rmsnorm(self, input_, residual, weight, eps):
        """SGLang's communicator-native fused API (``GroupCoordinator.fused_allreduce_rmsnorm``
        tries ``ca_comm.fused_allreduce_rmsnorm(input_, residual, weight, eps)`` first):
        ``(norm_out, residual_out)`` as new tensors, ``residual_out = allreduce(input_) +
        residual`` and ``norm_out = rmsnorm(residual_out) * weight``, with
        :meth:`tpar.Communicator.fused_add_rms_norm`'s exact semantics; the inputs are left as
        they were. None (the engine then runs its own path) where :meth:`should_custom_ar` says
        False for ``input_`` or the operands do not fit it (another dtype or device, a weight
        that is not ``(hidden,)``, no residual). The answer depends only on shapes, dtypes and
        the capture state, which every rank shares, so all ranks take the same path."""
        if residual is None or not self.should_custom_ar(input_):
            return None
        residual, weight = residual.contiguous(), weight.contiguous()
        if self.fused_refusal(input_, residual, weight) is not None:
            return None
        if input_.is_cuda:
            from .. import ops

            return ops.fused_add_rms_norm(input_, residual, weight, float(eps), self.comm)
        return self.comm.fused_add_rms_norm(input_, residual, weight, float(eps), in_place=False)

    def fused_refusal(self, x, residual, weight):
        """None where tpar's fused op takes these operands on this object, else ``(reason,
        why)``: the communicator's one check of the fused operands (:meth:`tpar.Communicator.
        fused_fit`) within ``max_size``, or why this object takes nothing."""
        if self.disabled or self.comm is None:
            return "disabled", "tpar is not enabled for this group"
        return self.comm.fused_fit(x, residual, weight, self.max_size)

    def custom_all_gather(self, inp):
        """None: tpar has no all-gather, so the engine uses its NCCL."""
        return None

    def custom_reduce_scatter(self, inp):
        """None: tpar has no reduce-scatter, so the engine uses its NCCL."""
        return None

    def should_custom_all_gather(self, inp) -> bool:
        return False

    def should_custom_reduce_scatter(self, inp) -> bool:
        return False

    @contextlib.contextmanager
    def capture(self):
        """The engines enter this around CUDA-graph capture: inside, tpar decides every call for
        capture, and on exit raises any error a kernel reported."""
        if self.disabled or self.comm is None:
            yield
            return
        self._IS_CAPTURING = True
        try:
            with self.comm.capture():
                yield
        finally:
            self._IS_CAPTURING = False

    def register_graph_buffers(self):
        """Nothing to do: tpar registers its buffers when it is created, and captured calls read
        their call counter from device memory, so a graph stays correct on every replay."""
        return None

    def memory_footprint(self) -> dict:
        """tpar's allocation on this rank (see :meth:`tpar.Communicator.memory_footprint`)."""
        return {} if self.comm is None else self.comm.memory_footprint()

    def close(self):
        """Releases the communicator; afterwards the object is disabled. It lets go of the
        engine's group too: a process group referenced past ``destroy_process_group`` is torn
        down during the interpreter's exit, where gloo's threads can abort the process."""
        comm, self.comm, self._native = self.comm, None, None
        self.disabled = True
        self.group = None
        if comm is not None:
            comm.close()

    def __del__(self):
        # vLLM's CudaCommunicator.destroy drops its reference without calling close().
        try:
            self.close()
        except Exception:
            pass


def _refused():
    """tpar.TparRefused (tpar is imported by the time a call runs)."""
    import tpar

    return tpar.TparRefused


def _torch_device(ordinal):
    """A torch.device for a communicator's CUDA ordinal (None: the CPU)."""
    import torch

    return torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)


def enabled_tpar(custom) -> TparCustomAllreduce | None:
    """``custom`` (an engine's custom allreduce, or None) when it is an enabled tpar one, else
    None."""
    if isinstance(custom, TparCustomAllreduce) and not custom.disabled:
        return custom
    return None
