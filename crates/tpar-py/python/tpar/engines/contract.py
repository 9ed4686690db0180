"""The engines' custom-allreduce contract, served by one tpar communicator per group.

:class:`TparCustomAllreduce` is what vLLM's ``CudaCommunicator`` and SGLang's
``GroupCoordinator`` construct once the plugin has swapped their class (see
:mod:`tpar.engines`): built from the engine's CPU (gloo) group and the rank's device, it
answers ``should_custom_ar`` from tpar's plan (so a size tpar would give to NCCL stays on the
engine's own NCCL, which already exists: tpar opens none), and ``custom_all_reduce`` returns a
new tensor. Construction is a group decision (:func:`group_vote`): if any rank cannot open tpar,
every rank stays disabled and the engine's NCCL reduces every size on every rank alike.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys

DEFAULT_MAX_SIZE = 8 << 20
"""The engines' default ``max_size`` (vLLM's and SGLang's CustomAllreduce: 8 MiB)."""

# Reasons travel over gloo as fixed-size byte rows (no pickled objects: gloo's object
# collectives break under torch.inference_mode, see pytorch issue 126032).
_REASON_BYTES = 480

# Sizes the log line reports the route of, from 1 KiB up to max_size.
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


def group_vote(group, failure: str | None):
    """Every rank of ``group`` calls this with None (it can use tpar) or the reason it cannot;
    returns None when every rank can, else ``(rank, reason, failed)``: the lowest group rank
    that failed, its reason and how many ranks failed, the same tuple on every rank.

    A MIN allreduce of the success flag decides; only when it is 0 are the reasons gathered.
    Every rank makes the same collectives in the same order, whatever it voted."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([0 if failure else 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if int(flag.item()) == 1:
        return None
    row = torch.zeros(_REASON_BYTES, dtype=torch.uint8)
    if failure:
        encoded = failure.encode("utf-8", "replace")[: _REASON_BYTES - 1]
        row[0] = 1
        row[1 : 1 + len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row, group=group)
    failed = [
        (rank, bytes(r[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace"))
        for rank, r in enumerate(rows)
        if int(r[0]) == 1
    ]
    rank, reason = failed[0]
    return rank, reason, len(failed)


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
        self._routes: dict = {}
        self._cuda = False
        self._plan_warned = False

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
            # group): opening it cannot leave one rank waiting for a collective the others skip.
            failure = self._open()
            verdict = group_vote(group, failure)
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
        self.disabled = False
        self.original_disabled = False
        logger.info("%s", self.describe())

    # -- construction ------------------------------------------------------------------------

    def _preflight(self, device):
        """Why this rank cannot open tpar, found without any collective, or None."""
        try:
            import torch

            if isinstance(device, int) and not isinstance(device, bool):
                device = torch.device("cuda", device)
            device = torch.device(device)
            if device.type == "cuda":
                if not torch.cuda.is_available():
                    return "torch sees no CUDA device"
                index = torch.cuda.current_device() if device.index is None else device.index
                device = torch.device("cuda", index)
                self._cuda = True
            elif device.type != "cpu":
                return f"device {device} is neither CUDA nor the CPU"
            self.device = device
            import tpar  # noqa: F401  (the native module: a missing or broken one is a reason)
        except Exception as error:  # every failure is a vote, never a one-rank exception
            return f"{type(error).__name__}: {error}"
        return None

    def _open(self):
        """Opens the tpar communicator over the group; the reason it failed, or None."""
        try:
            import tpar

            self.comm = tpar.Communicator(
                group=self.group,
                device=self.device.index if self._cuda else "cpu",
                max_bytes=self.max_size,
                **_communicator_kwargs(tpar.Communicator),
            )
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None

    def describe(self) -> str:
        """One line: which group tpar took and what runs per size (bf16), for the log."""
        routes = []
        for size in _LOG_SIZES:
            if size > self.max_size:
                break
            routes.append((size, self._plan_name(size, "bf16", False)))
        spans = []
        for size, name in routes:
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

    def _plan_name(self, nbytes: int, dtype, capturing: bool) -> str:
        """tpar's algorithm for the size, or "nccl" for one the engine's NCCL should take."""
        if not self._cuda:
            return "one-shot"
        try:
            try:
                algorithm, _reason = self.comm.plan(nbytes, dtype, capturing)
            except TypeError:  # a Communicator.plan without the capturing argument
                algorithm, _reason = self.comm.plan(nbytes, dtype)
        except Exception as error:
            # The engine's NCCL is always correct; say so once rather than fail the call.
            if not self._plan_warned:
                self._plan_warned = True
                logger.warning(
                    "tpar could not plan %d bytes of %s (%s); such sizes stay on the engine's NCCL",
                    nbytes,
                    dtype,
                    error,
                )
            return "nccl"
        return "nccl" if str(algorithm).startswith("nccl") else str(algorithm)

    # -- the calls the engines make ----------------------------------------------------------

    def should_custom_ar(self, inp) -> bool:
        """True when tpar reduces ``inp``: f32/f16/bf16, contiguous, on this rank's device, at
        most ``max_size`` bytes, and planned for tpar's own kernels. The answer depends only on
        (dtype, size, capture state), which every rank shares, so all ranks route alike; it is
        cached per that key (SGLang asks twice per call)."""
        if self.disabled or self.comm is None:
            return False
        import torch

        if inp.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False
        nbytes = inp.numel() * inp.element_size()
        if nbytes == 0 or nbytes > self.max_size or not inp.is_contiguous():
            return False
        if inp.device.type != self.device.type or (
            self._cuda and inp.device.index != self.device.index
        ):
            return False
        capturing = self._IS_CAPTURING or (inp.is_cuda and torch.cuda.is_current_stream_capturing())
        key = (inp.dtype, nbytes, capturing)
        route = self._routes.get(key)
        if route is None:
            route = self._plan_name(
                nbytes, inp.dtype, capturing
            ) != "nccl" and self.comm.should_use(inp)
            self._routes[key] = route
        return route

    def custom_all_reduce(self, input):
        """The sum of ``input`` over the group in a new tensor (the input is left as it was and
        the result is never a view of tpar's buffers). Never None where ``should_custom_ar``
        said True; None where it said False, as the engines' own class does."""
        if not self.should_custom_ar(input):
            return None
        import torch

        out = torch.empty_like(input)
        return self.comm.all_reduce(input, out=out)

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
        hidden = input_.shape[-1] if input_.dim() else None
        if (
            tuple(residual.shape) != tuple(input_.shape)
            or tuple(weight.shape) != (hidden,)
            or residual.dtype != input_.dtype
            or weight.dtype != input_.dtype
            or residual.device != input_.device
            or weight.device != input_.device
        ):
            return None
        if input_.is_cuda:
            from .. import ops

            return ops.fused_add_rms_norm(input_, residual, weight, float(eps), self.comm)
        return self.comm.fused_add_rms_norm(
            input_, residual.contiguous(), weight.contiguous(), float(eps), in_place=False
        )

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
        """The engines enter this around CUDA-graph capture: inside, tpar plans every call for
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
        """Releases the communicator; afterwards the object is disabled."""
        comm, self.comm = self.comm, None
        self.disabled = True
        self._routes.clear()
        if comm is not None:
            comm.close()

    def __del__(self):
        # vLLM's CudaCommunicator.destroy drops its reference without calling close().
        try:
            self.close()
        except Exception:
            pass


def enabled_tpar(custom) -> TparCustomAllreduce | None:
    """``custom`` (an engine's custom allreduce, or None) when it is an enabled tpar one, else
    None."""
    if isinstance(custom, TparCustomAllreduce) and not custom.disabled:
        return custom
    return None
