"""SGLang's CUDA fused allreduce + residual add + RMSNorm (its FlashInfer path) on tpar's fused op.

What SGLang 0.5.23 does on CUDA (read from the released wheel; ROCm takes the aiter branch,
which asks the custom allreduce and is answered by
:meth:`tpar.engines.TparCustomAllreduce.fused_allreduce_rmsnorm`):

1. The layer boundary decides, per batch and before it runs, whether a fused kernel will finish
   the sum a stage left unreduced: ``layers/layer_boundary/fusions/allreduce.py``
   (``fused_attn_input`` for the MoE/FFN output's sum completed in the next attention input,
   ``fused_ffn_input`` for the attention output's sum completed in the FFN input, and
   ``flashinfer_preserves_residual``) and ``layers/layer_boundary/exit.py``
   (``_batch_allows_deferred_sum``) all ask ``flashinfer_ar_fusion_applies(batch_size)``, which
   they import by name from ``layers/layer_boundary/residual/add_norm.py``. It is True only on
   SM90/SM100 with FlashInfer importable, no DP attention, ``--flashinfer-allreduce-fusion-backend``
   set (not cutedsl), FlashInfer's workspace not failed, and ``0 < batch_size <= 2048``
   (``FUSE_ALLREDUCE_MAX_BATCH_SIZE``). On the PCIe machines tpar targets it is False, so SGLang
   runs its allreduce and then a separate ``fused_add_rmsnorm``.
2. When it holds, ``norm.forward_with_allreduce_fusion(x, residual, use_attn_tp_group=...)``
   (``RMSNorm``; ``GemmaRMSNorm`` passes ``1 + weight``) runs ``layernorm._forward_with_allreduce_fusion``,
   which for a group of more than one rank (attention TP size, or the MoE EP/TP size) imports
   ``flashinfer_allreduce_residual_rmsnorm`` from ``layers/flashinfer_comm_fusion.py`` *at call
   time* and calls it with keywords: ``input_tensor=x`` (tokens x hidden, this rank's partial
   sum), ``residual`` (same shape; ``residual + post_residual_addition`` when given),
   ``weight``, ``eps=norm.variance_epsilon``, ``max_token_num=max(tokens, 2048)``,
   ``use_attn_tp_group``.
3. That function (a registered custom op) returns ``(norm_out, residual_out)``, two *new*
   tensors (``residual_out = allreduce(x) + residual``, ``norm_out = rmsnorm(residual_out) *
   weight``; the inputs are not written), or ``(None, None)`` when it declines (FlashInfer
   missing, one rank, non-contiguous operands, no workspace). On ``(None, None)`` the caller
   runs the unfused sequence: allreduce over the same group
   (``attention_tensor_model_parallel_all_reduce`` or ``deferred_post_experts_all_reduce``),
   ``residual.clone()``, then ``norm.forward(x, residual)`` (sgl_kernel's in-place
   ``fused_add_rmsnorm``), returning ``(x, residual)``: the same values, a fresh residual too.

What :func:`sglang_plugin <tpar.engines.plugins.sglang_plugin>` installs (lazily: each wrap
runs when SGLang imports the module, see :func:`install`):

- ``flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm`` becomes
  :func:`_make_fused`'s function: where the group the call reduces over (the attention TP group,
  or ``resolve_fusion_group(use_attn_tp_group=False)``'s) holds an enabled
  :class:`TparCustomAllreduce` as its ``ca_comm`` and tpar takes the operands (2-D, contiguous,
  f32/f16/bf16, residual and weight of the input's dtype, weight ``(hidden,)``, tokens x hidden
  within tpar's ``max_size`` and planned for tpar, not NCCL), it returns
  ``(norm_out, residual_out)`` from tpar's fused op (new tensors, exact semantics in
  :meth:`tpar.Communicator.fused_add_rms_norm`: ``residual_out`` bitwise SGLang's unfused one,
  ``norm_out`` within the dtype's rounding). Otherwise, where SGLang's own gate admits the
  batch (FlashInfer's fusion is set up) it calls SGLang's function, which runs FlashInfer or
  returns ``(None, None)``; where only tpar's gate admitted it, it returns ``(None, None)``, as
  SGLang's function does without FlashInfer, so SGLang runs its unfused sequence. The reason
  is logged once per kind.
- ``add_norm.flashinfer_ar_fusion_applies`` (and the names ``fusions/allreduce.py`` and
  ``exit.py`` bound from it) becomes "SGLang's gate, or tpar's": tpar's holds where the TP
  group's ``ca_comm`` is an enabled tpar one, DP attention is off and ``0 < batch_size <=
  FUSE_ALLREDUCE_MAX_BATCH_SIZE``. Without it the fused entry is never reached off SM90/SM100.
  Where the batch is over tpar's ``max_size`` for its hidden size the fused entry declines and
  SGLang's fallback runs, which costs one residual copy more than SGLang's plain path.

Every test above depends only on shapes, dtypes, the group and the capture state, which all
ranks share, so all ranks take the same path. An exception from tpar's call is logged once and
the call falls back like a refusal (a peer whose call succeeded then disagrees: the warning
says so, and tpar's communicator reports the error on its next call). With ``TPAR_ALLREDUCE=0``
the plugin installs nothing; where tpar did not open (the group vote), ``ca_comm`` is disabled,
the gate is SGLang's own answer and the fused entry is SGLang's function's answer.

CUDA graphs: SGLang's decode graphs are captured inside its ``graph_capture`` (which enters
tpar's ``capture()``); its default prefill graphs (breakable, no torch.compile) capture the
fused call as they capture tpar's plain allreduce (tpar's decision reads the capture state of
the current stream itself); neither was run inside a real SGLang. Under ``--enable-torch-compile`` Dynamo
traces these wrappers: checked on the CPU with Dynamo's eager backend (tpar is called on every
call, with the eager bits), not with SGLang's compiled CUDA path.
"""

from __future__ import annotations

from .contract import TparCustomAllreduce, enabled_tpar, log_once, logger

FUSION_MODULE = "sglang.srt.layers.flashinfer_comm_fusion"
FUSION_SYMBOL = "flashinfer_allreduce_residual_rmsnorm"
GATE_MODULE = "sglang.srt.layers.layer_boundary.residual.add_norm"
GATE_SYMBOL = "flashinfer_ar_fusion_applies"
GATE_IMPORTERS = (
    "sglang.srt.layers.layer_boundary.fusions.allreduce",
    "sglang.srt.layers.layer_boundary.exit",
)
"""Modules that bind ``flashinfer_ar_fusion_applies`` by name at import (``from add_norm import``)."""

# The engine's functions replaced, by "module.name" (for tests and to undo), and the wrappers.
originals: dict = {}
replacements: dict = {}


def tpar_allreduce_of(coordinator) -> TparCustomAllreduce | None:
    """The enabled tpar custom allreduce an SGLang ``GroupCoordinator`` holds, or None."""
    return enabled_tpar(getattr(coordinator, "ca_comm", None))


def _operand_refusal(custom: TparCustomAllreduce, x, residual, weight):
    """``(kind, reason)`` when tpar's fused op does not take these operands, else None: the
    communicator's one check of the fused operands (one library, device and dtype, shapes
    ``(..., hidden)`` and ``(hidden,)``, contiguous, within ``max_size``)."""
    return custom.fused_refusal(x, residual, weight)


def _fusion_coordinator(fusion_module, use_attn_tp_group: bool):
    """The GroupCoordinator SGLang's fused entry reduces over (what its ``resolve_fusion_group``
    returns; the attention TP group is read directly, as that function does)."""
    if use_attn_tp_group:
        from sglang.srt.runtime_context import get_parallel

        return get_parallel().attn_tp_group
    return fusion_module.resolve_fusion_group(use_attn_tp_group=False)[2]


def tpar_fused(fusion_module, x, residual, weight, eps, use_attn_tp_group: bool):
    """``((norm_out, residual_out), None)`` from tpar's fused op, or ``(None, (kind, reason))``."""
    group_name = "attention TP" if use_attn_tp_group else "MoE reduction"
    try:
        coordinator = _fusion_coordinator(fusion_module, use_attn_tp_group)
    except Exception as error:
        return None, (
            f"group-{group_name}",
            f"SGLang's {group_name} group could not be resolved ({type(error).__name__}: {error})",
        )
    custom = tpar_allreduce_of(coordinator)
    if custom is None:
        return None, (
            f"not-tpar-{group_name}",
            f"the {group_name} group's custom allreduce is not an enabled tpar one",
        )
    refusal = _operand_refusal(custom, x, residual, weight)
    if refusal is not None:
        return None, refusal
    try:
        fused = custom.fused_allreduce_rmsnorm(x, residual, weight, eps)
    except Exception as error:
        # The model must keep running: SGLang's unfused path is always correct.
        log_once(
            ("sglang", "error", type(error).__name__),
            "tpar's fused allreduce + RMSNorm failed on SGLang's %s group (%s: %s); this call runs "
            "SGLang's path (a rank whose call did not fail ran tpar's: if that happened, this group's "
            "ranks no longer agree)",
            group_name,
            type(error).__name__,
            error,
            warning=True,
        )
        return None, None
    if fused is None:
        return None, (
            "decision",
            f"tpar's decision gives {tuple(x.shape)} {x.dtype} to the engine's NCCL",
        )
    return fused, None


def _make_fused(fusion_module, original):
    def flashinfer_allreduce_residual_rmsnorm(
        input_tensor,
        residual,
        weight,
        eps=1e-6,
        max_token_num=2048,
        use_oneshot=None,
        trigger_completion_at_end=False,
        fp32_acc=True,
        use_attn_tp_group=True,
    ):
        """tpar's fused allreduce + residual + RMSNorm where tpar serves the group and takes the
        operands; SGLang's own function (FlashInfer, or ``(None, None)``) otherwise."""
        fused, refusal = tpar_fused(
            fusion_module, input_tensor, residual, weight, eps, use_attn_tp_group
        )
        if fused is not None:
            norm_out, residual_out = fused
            return norm_out, residual_out
        if refusal is not None:
            kind, reason = refusal
            log_once(
                ("sglang", "decline", kind),
                "SGLang's fused allreduce + RMSNorm stays SGLang's (FlashInfer's where "
                "it applies, else allreduce then its norm) for %s; logged once",
                reason,
            )
        engine_gate = originals.get(f"{GATE_MODULE}.{GATE_SYMBOL}")
        if engine_gate is not None and not engine_gate(input_tensor.shape[0]):
            # SGLang would not have called its function for this batch (only tpar's gate admitted
            # it): decline as that function declines, and SGLang runs its unfused sequence.
            return None, None
        return original(
            input_tensor=input_tensor,
            residual=residual,
            weight=weight,
            eps=eps,
            max_token_num=max_token_num,
            use_oneshot=use_oneshot,
            trigger_completion_at_end=trigger_completion_at_end,
            fp32_acc=fp32_acc,
            use_attn_tp_group=use_attn_tp_group,
        )

    flashinfer_allreduce_residual_rmsnorm._tpar = True
    flashinfer_allreduce_residual_rmsnorm.engine_original = original
    return flashinfer_allreduce_residual_rmsnorm


def tpar_serves_tp_group() -> bool:
    """Whether SGLang's TP group holds an enabled tpar custom allreduce (False before the
    groups exist)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return tpar_allreduce_of(get_parallel().tp_group) is not None
    except Exception:
        return False


def _make_gate(gate_module, original):
    def flashinfer_ar_fusion_applies(batch_size: int):
        """SGLang's gate, or tpar's: the fused entry is tried where either takes the batch."""
        if original(batch_size):
            return True
        return (
            tpar_serves_tp_group()
            and not gate_module.is_dp_attention_enabled()
            # The size checks stay last, as in SGLang's gate (symbolic under Dynamo).
            and batch_size > 0
            and batch_size <= gate_module.FUSE_ALLREDUCE_MAX_BATCH_SIZE
        )

    flashinfer_ar_fusion_applies._tpar = True
    flashinfer_ar_fusion_applies.engine_original = original
    return flashinfer_ar_fusion_applies


def wrap_fusion(module) -> None:
    """Import hook of ``flashinfer_comm_fusion``: its fused entry becomes tpar's."""
    original = getattr(module, FUSION_SYMBOL)
    if getattr(original, "_tpar", False):
        return
    replacement = _make_fused(module, original)
    originals[f"{module.__name__}.{FUSION_SYMBOL}"] = original
    replacements[f"{module.__name__}.{FUSION_SYMBOL}"] = replacement
    setattr(module, FUSION_SYMBOL, replacement)
    logger.info(
        "SGLang: %s.%s takes tpar's fused allreduce + RMSNorm where tpar serves the group "
        "(TPAR_ALLREDUCE=0 keeps SGLang's)",
        module.__name__,
        FUSION_SYMBOL,
    )


def wrap_gate(module) -> None:
    """Import hook of ``add_norm``: its gate also admits the batches tpar can fuse."""
    original = getattr(module, GATE_SYMBOL)
    if getattr(original, "_tpar", False):
        return
    replacement = _make_gate(module, original)
    originals[f"{module.__name__}.{GATE_SYMBOL}"] = original
    replacements[GATE_SYMBOL] = replacement
    setattr(module, GATE_SYMBOL, replacement)


def rebind_gate(module) -> None:
    """Import hook of a module that bound the gate by name: it gets tpar's wrapper when it
    bound add_norm's original (it did, where add_norm was imported before the plugin ran)."""
    replacement = replacements.get(GATE_SYMBOL)
    bound = getattr(module, GATE_SYMBOL, None)
    if replacement is not None and bound is not None and bound is replacement.engine_original:
        setattr(module, GATE_SYMBOL, replacement)


def install(when_imported) -> None:
    """Registers the wraps with ``when_imported`` (:func:`tpar.engines.plugins.when_imported`):
    each runs now if SGLang already imported the module, else right after it does."""
    when_imported(FUSION_MODULE, wrap_fusion)
    when_imported(GATE_MODULE, wrap_gate)
    for name in GATE_IMPORTERS:
        when_imported(name, rebind_gate)
