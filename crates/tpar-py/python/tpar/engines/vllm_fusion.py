"""vLLM's allreduce + residual add + RMSNorm on tpar's fused op: a post-grad Inductor pass.

vLLM 0.33.0 fuses the allreduce that ends a tensor-parallel layer with the ``fused_add_rms_norm``
after it only through its own pattern pass (``AllReduceFusionPass`` in
``compilation/passes/fusion/allreduce_rms_fusion.py``), which rewrites to FlashInfer and never
asks the custom-allreduce object (see :mod:`tpar.engines`). :class:`TparAllReduceFusionPass`
matches the same two patterns of ``AllReduceFusedAddRMSNormPattern`` (the pair
``tensor_model_parallel_all_reduce(input)`` then ``vllm.ir.ops.fused_add_rms_norm(ar, residual,
weight, eps)``, returning ``(norm, residual)`` or the norm only; eps 1e-5 and 1e-6; the norm's
input and weight of one dtype) and rewrites each into one call of
``torch.ops.tpar.vllm_all_reduce_fused_add_rms_norm`` on the TP group.

Switching it on (vLLM runs a pass given as ``inductor_compile_config["post_grad_custom_post_pass"]``
after its own post-grad passes, before it lowers its IR ops), from Python::

    import tpar.engines.vllm_fusion as tpar_fusion
    llm = vllm.LLM(model, tensor_parallel_size=2, compilation_config=tpar_fusion.compilation_config())

or by name, for ``vllm serve`` (vLLM wraps the function :func:`tpar.vllm_fusion_pass` in its
``CallableInductorPass``)::

    vllm serve MODEL -tp 8 --compilation-config \
      '{"inductor_passes": {"post_grad_custom_post_pass": "tpar.vllm_fusion_pass"}}'

Either needs vLLM's compilation on (its default; not ``-O0`` / ``enforce_eager``) and tpar's
plugin (the wheel's entry point) to have taken the TP group's custom allreduce. On SM90/SM100
with FlashInfer installed vLLM switches its own FlashInfer fusion on, which runs before this
pass and takes the pairs: :func:`compilation_config` turns it off; by name, add
``"pass_config": {"fuse_allreduce_rms": false}``.

The pass builds its patterns in the worker at the first graph it sees (the TP group must exist
then), and rewrites nothing when the TP group's custom allreduce is not tpar's (the plugin is off,
or tpar's group vote left it disabled: every rank sees the same).

What the op does at run time, per call (the decision depends only on dtype, size and the
capture state, which every rank shares, so every rank takes the same path):

- where tpar's plugin would take this allreduce (the group's ``ca_comm`` is tpar's and its
  ``should_custom_ar`` says yes) and the operands fit tpar's fused op: ``(norm, residual_out)``
  from :meth:`TparCustomAllreduce.fused_allreduce_rmsnorm` (one kernel on the GPU where tpar's
  fused decision allows; semantics in :meth:`tpar.Communicator.fused_add_rms_norm`:
  ``residual_out`` is bitwise vLLM's, ``norm`` may differ from vLLM's kernel in the last bit);
- otherwise, or when tpar's call raises (logged once), vLLM's own unfused sequence:
  ``torch.ops.vllm.all_reduce`` on the group, then ``torch.ops.vllm_ir.fused_add_rms_norm``
  dispatched to the provider vLLM chose for this process. A refusal (operands tpar does not
  take) is found before any data moves and depends only on what every rank shares, so every rank
  falls back alike. An error after tpar's call started (a peer that timed out) is caught the
  same way so that the model does not raise, but then the ranks may disagree on the path: the
  warning says so, and tpar's communicator reports the error on its next call too.
"""

from __future__ import annotations

import torch
import torch._inductor.pattern_matcher as pm
import torch.fx as fx
import vllm.ir.ops
from torch._inductor.pattern_matcher import PatternMatcherPass
from vllm.compilation.passes.inductor_pass import InductorPass, enable_fake_mode
from vllm.distributed import parallel_state, tensor_model_parallel_all_reduce

from .contract import TparCustomAllreduce, enabled_tpar, log_once, logger

PASS_KEY = "post_grad_custom_post_pass"
"""The ``inductor_compile_config`` key vLLM runs a user's post-grad pass from."""

EPSILONS = (1e-5, 1e-6)
"""The RMSNorm epsilons the patterns are built for (vLLM's AllReduceFusionPass uses these)."""

_IR_FUSED_ADD_RMS_NORM = torch.ops.vllm_ir.fused_add_rms_norm.default


def tpar_allreduce_of(group_name: str) -> TparCustomAllreduce | None:
    """The enabled tpar custom allreduce vLLM holds for the group ``group_name``
    (``GroupCoordinator.unique_name``, e.g. ``tp:0``), or None (no such group, no device
    communicator, a custom allreduce that is not tpar's, or tpar disabled for the group)."""
    reference = parallel_state._groups.get(group_name)
    group = reference() if reference is not None else None
    communicator = getattr(group, "device_communicator", None)
    return enabled_tpar(getattr(communicator, "ca_comm", None))


def _unfused(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's own sequence, as the graph held it before the rewrite."""
    reduced = torch.ops.vllm.all_reduce(input, group_name=group_name)
    norm, residual_out = _IR_FUSED_ADD_RMS_NORM(reduced, residual, weight, epsilon)
    return norm, residual_out


@torch.library.custom_op("tpar::vllm_all_reduce_fused_add_rms_norm", mutates_args=())
def _all_reduce_fused_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    custom = tpar_allreduce_of(group_name)
    if custom is not None:
        try:
            fused = custom.fused_allreduce_rmsnorm(input, residual, weight, epsilon)
        except Exception as error:
            # The model must keep running: vLLM's path is always correct.
            log_once(
                ("vllm", group_name, type(error).__name__),
                "tpar's fused allreduce + RMSNorm failed on group %s (%s: %s); this call runs vLLM's "
                "allreduce and norm (a rank whose call did not fail ran tpar's: if that happened, this "
                "group's ranks no longer agree)",
                group_name,
                type(error).__name__,
                error,
                warning=True,
            )
            fused = None
        if fused is not None:
            norm, residual_out = fused
            return norm, residual_out
    return _unfused(input, residual, weight, epsilon, group_name)


@_all_reduce_fused_add_rms_norm.register_fake
def _(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format),
        torch.empty_like(residual, memory_format=torch.contiguous_format),
    )


def all_reduce_fused_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, residual_out)`` of vLLM's ``fused_add_rms_norm(all_reduce(input), residual,
    weight, epsilon)`` on the group ``group_name``: tpar's fused op where tpar takes the call,
    vLLM's unfused sequence otherwise (the module doc says when)."""
    return torch.ops.tpar.vllm_all_reduce_fused_add_rms_norm(
        input, residual, weight, float(epsilon), group_name
    )


def _norm_input_weight_dtype_match(match: pm.Match) -> bool:
    """vLLM's ``_norm_input_weight_dtype_match``: no rewrite where the norm's input and weight
    dtypes differ (a Gemma fp32 gamma), which tpar's fused op does not take."""
    for node in match.nodes:
        if node.target == _IR_FUSED_ADD_RMS_NORM:
            x, weight = node.args[0], node.args[2]
            if isinstance(x, fx.Node) and isinstance(weight, fx.Node):
                return x.meta["val"].dtype == weight.meta["val"].dtype
    return True


def _register(patterns: PatternMatcherPass, epsilon: float, group_name: str) -> None:
    """vLLM's AllReduceFusedAddRMSNormPattern (both registrations), replaced by tpar's op."""

    def pattern(
        residual: torch.Tensor, input: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        allreduce_output = tensor_model_parallel_all_reduce(input)
        rms, residual = vllm.ir.ops.fused_add_rms_norm(allreduce_output, residual, weight, epsilon)
        return rms, residual

    def replacement(
        residual: torch.Tensor, input: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = torch.ops.tpar.vllm_all_reduce_fused_add_rms_norm.default(
            input, residual, weight, epsilon, group_name
        )
        return fused[0], fused[1]

    # vLLM's example inputs: (5, 16) activations and a (16,) weight; the dtype does not
    # matter to the traced pattern (both ops are opaque), bf16 as vLLM's usual model dtype.
    inputs = [
        torch.empty(5, 16, dtype=torch.bfloat16),
        torch.empty(5, 16, dtype=torch.bfloat16),
        torch.empty(16, dtype=torch.bfloat16),
    ]
    pm.register_replacement(
        pattern,
        replacement,
        inputs,
        pm.fwd_only,
        patterns,
        extra_check=_norm_input_weight_dtype_match,
    )

    # The end of a graph, where the residual is not used again: only the norm is returned.
    def pattern_norm_only(residual, input, weight):
        return pattern(residual, input, weight)[0]

    def replacement_norm_only(residual, input, weight):
        return replacement(residual, input, weight)[0]

    pm.register_replacement(
        pattern_norm_only,
        replacement_norm_only,
        inputs,
        pm.fwd_only,
        patterns,
        extra_check=_norm_input_weight_dtype_match,
    )


class TparAllReduceFusionPass(InductorPass):
    """vLLM post-grad pass: the TP group's allreduce + ``fused_add_rms_norm`` become tpar's
    fused op (module doc). Holds no state that crosses processes: vLLM pickles its config,
    this pass included, into its workers, and each worker builds the patterns for its own TP
    group at its first graph."""

    def __init__(self):
        self._patterns: PatternMatcherPass | None = None
        self._group_name: str | None = None
        self._skip_logged = False
        self.matched_count = 0

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()

    def _patterns_for_tp_group(self) -> PatternMatcherPass | None:
        """The patterns for this process's TP group, built once; None where the TP group has
        one rank or its custom allreduce is not tpar's (nothing to fuse into)."""
        group = parallel_state.get_tp_group()
        if group.world_size <= 1 or tpar_allreduce_of(group.unique_name) is None:
            if not self._skip_logged:
                self._skip_logged = True
                logger.info(
                    "tpar's vLLM fusion pass rewrites nothing: the TP group %s (%d ranks) has no "
                    "enabled tpar custom allreduce",
                    group.unique_name,
                    group.world_size,
                )
            return None
        if self._patterns is None or self._group_name != group.unique_name:
            self._group_name = group.unique_name
            self._patterns = self._build(group.unique_name)
        return self._patterns

    @staticmethod
    @enable_fake_mode
    def _build(group_name: str) -> PatternMatcherPass:
        patterns = PatternMatcherPass(pass_name="tpar_all_reduce_fusion_pass")
        for epsilon in EPSILONS:
            _register(patterns, epsilon, group_name)
            # As vLLM's pass: the matcher refuses a pattern it has seen, and the patterns of
            # two epsilons look alike to it.
            pm._seen_patterns.clear()
        return patterns

    def __call__(self, graph: fx.Graph) -> None:
        patterns = self._patterns_for_tp_group()
        if patterns is None:
            self.matched_count = 0
            return
        self.matched_count = patterns.apply(graph)
        logger.debug(
            "tpar's vLLM fusion pass rewrote %d allreduce + RMSNorm pairs", self.matched_count
        )

    def uuid(self) -> str:
        # The compiled graph depends on this module's code (patterns and replacement).
        return InductorPass.hash_source(self, _register)


_default_pass: TparAllReduceFusionPass | None = None


def default_pass() -> TparAllReduceFusionPass:
    """This process's pass for :func:`tpar.vllm_fusion_pass` (vLLM's JSON route)."""
    global _default_pass
    if _default_pass is None:
        _default_pass = TparAllReduceFusionPass()
    return _default_pass


def compilation_config(base: dict | None = None) -> dict:
    """vLLM's ``compilation_config`` (a dict, as ``vllm.LLM(compilation_config=...)`` takes it)
    with tpar's pass as ``inductor_compile_config["post_grad_custom_post_pass"]``, and vLLM's
    own FlashInfer fusion off (``pass_config["fuse_allreduce_rms"] = False``: on SM90/SM100 with
    FlashInfer installed vLLM turns it on by default, and it runs first, taking every pair
    before tpar's pass sees it) unless ``base`` sets it. ``base``'s other entries are kept.
    ValueError where ``base`` already holds another pass there (vLLM runs one)."""
    config = dict(base or {})
    inductor = dict(config.get("inductor_compile_config") or {})
    existing = inductor.get(PASS_KEY)
    if existing is not None and not isinstance(existing, TparAllReduceFusionPass):
        raise ValueError(
            f"inductor_compile_config[{PASS_KEY!r}] already holds {existing!r}; vLLM runs one pass "
            "there: remove it, or call tpar's pass from yours"
        )
    inductor[PASS_KEY] = existing or TparAllReduceFusionPass()
    config["inductor_compile_config"] = inductor
    pass_config = config.get("pass_config")
    if pass_config is None or isinstance(pass_config, dict):
        config["pass_config"] = {"fuse_allreduce_rms": False, **(pass_config or {})}
    return config
