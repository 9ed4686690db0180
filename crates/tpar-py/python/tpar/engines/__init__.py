"""tpar behind vLLM's and SGLang's tensor-parallel allreduce, with no edit to the engine.

``pip install tpar`` puts two entry points in the wheel (``vllm.general_plugins`` and
``sglang.srt.plugins``); each engine loads them in every worker before it builds its
communicators, and the plugin swaps the engine's custom-allreduce class for
:class:`TparCustomAllreduce`. ``TPAR_ALLREDUCE=0`` keeps the engine's own class. For engine
versions without those plugin groups, ``TPAR_ENGINE_HOOK=1`` makes the ``tpar-engines.pth`` file
the wheel installs do the same swap at interpreter start-up, which reaches spawned workers too
(see :mod:`tpar.engines.plugins`).

What the engines construct and read (read from the released wheels vLLM 0.33.0 and SGLang
0.5.23; names move between releases: tests/python/test_engines_contract.py re-reads the pinned
sources for the imports, call sites and attributes below, and test_engines_vllm.py /
test_engines_sglang.py run the engines' own plugin loaders and modules):

vLLM 0.33.0
  - ``vllm/distributed/device_communicators/cuda_communicator.py``: ``CudaCommunicator.__init__``
    runs ``from vllm.distributed.device_communicators.custom_all_reduce import
    CustomAllreduce`` *inside* the constructor (so replacing the module attribute is enough)
    and, for groups whose ``unique_name`` is ``tp:*`` only, when ``_ENABLE_CUSTOM_ALL_REDUCE``
    (``--disable-custom-all-reduce`` clears it) and no AITER comm, builds
    ``CustomAllreduce(group=self.cpu_group, device=self.device, symm_mem_enabled=...,
    register_graph_buffers=register)``.
  - ``CustomAllreduce.__init__(group, device, max_size=8 MiB, max_all_gather_size, ...,
    symm_mem_enabled=False, *, register_graph_buffers=True)``. The PCIe gate: after gathering
    the physical device ids over the gloo group, ``same_node and world_size > 2 and not
    fully_connected`` returns with ``disabled = True`` ("not supported on more than two
    PCIe-only GPUs"); ``should_custom_ar`` also answers False unless ``world_size == 2 or
    fully_connected``.
  - Read on the object: ``disabled`` (all_reduce and the backend-selection log line, which
    lists 'CUSTOM' when it is False), ``should_custom_ar(x)`` then ``custom_all_reduce(x)``
    (``assert out is not None``), ``capture()`` (``GroupCoordinator.graph_capture`` in
    parallel_state.py), ``custom_all_gather(x)`` / ``custom_reduce_scatter(x)`` (None means
    "use NCCL": sequence_parallel.py, deepseek_v41 logits), ``mnnvl_lamport_ag_multicast_ptr``
    (deepseek_v41 mHC), and the static ``create_shared_buffer`` (minimax_m3 on ROCm).
    ``CudaCommunicator.destroy`` drops the reference without calling ``close()``.
  - Plugins: ``vllm.plugins.load_general_plugins()`` calls every ``vllm.general_plugins``
    entry point (filtered by ``VLLM_PLUGINS``) in every process, workers included.

SGLang 0.5.23
  - ``python/sglang/srt/distributed/parallel_state.py``: ``GroupCoordinator.__init__`` runs
    ``from sglang.srt.distributed.device_communicators.custom_all_reduce import
    dispatch_custom_allreduce`` inside the constructor and, for every group built with
    ``use_custom_allreduce`` (tp, attention tp, dcp, attn_cp, moe_dp) and world size > 1,
    ``CAClass = dispatch_custom_allreduce(group=self.cpu_group, device=self.device)`` then
    ``self.ca_comm = CAClass(group=self.cpu_group, device=self.device)`` inside a try/except
    that only logs a warning (one rank can fail alone).
  - ``dispatch_custom_allreduce`` returns ``CustomAllReduceV2`` (CUDA, when
    ``can_use_custom_all_reduce_v2``) or the legacy ``CustomAllreduce(group, device,
    max_size=_MAX_CAR_SIZE)``. The PCIe gate: ``can_use_custom_all_reduce_with_nvlink`` in
    custom_all_reduce_utils.py, ``world_size > 2 and not full_nvlink`` -> disabled.
  - Read on the object: ``disabled`` and ``should_custom_ar`` (``all_reduce`` and
    ``_resolve_outplace_all_reduce_method``: asked twice per call, so the answer must not
    change), ``custom_all_reduce`` (inside the registered ``outplace_all_reduce`` op),
    ``capture()`` (``graph_capture``, and the ViT graph runner), ``original_disabled``;
    everything else (fused AR+RMSNorm, reduce_scatter, all_gather_reg, ``_IS_CAPTURING``) is
    looked up with ``hasattr``/``getattr`` defaults or ``isinstance(CustomAllReduceV2)`` and
    stays on NCCL for an object without it.
  - Plugins: ``sglang.srt.plugins.load_plugins()`` calls every ``sglang.srt.plugins`` entry
    point (filtered by ``SGLANG_PLUGINS``) early in every scheduler process.

Fused allreduce + residual add + RMSNorm (issue 15): which of the engines' fusion paths reach
tpar's fused op (:meth:`tpar.Communicator.fused_add_rms_norm`), and why the others do not.

Covered
  - vLLM 0.33.0, through tpar's own post-grad pass (:mod:`tpar.engines.vllm_fusion`, switched
    on by the user: ``compilation_config=tpar.engines.vllm_fusion.compilation_config()`` from
    Python, or ``--compilation-config '{"inductor_passes": {"post_grad_custom_post_pass":
    "tpar.vllm_fusion_pass"}}'`` for ``vllm serve``). vLLM's only allreduce + RMSNorm fusion is
    the Inductor pattern pass ``compilation/passes/fusion/allreduce_rms_fusion.py``
    (``AllReduceFusionPass``, ``pass_config.fuse_allreduce_rms``), hard-wired to FlashInfer's
    ``trtllm_allreduce_fusion`` and never asking the custom-allreduce object; vLLM runs a
    user's pass from ``inductor_compile_config["post_grad_custom_post_pass"]``
    (``compilation/backends.py``: added to its ``PostGradPassManager`` after its own passes,
    before its IR lowering). tpar's pass matches the patterns of vLLM's
    ``AllReduceFusedAddRMSNormPattern`` (``tensor_model_parallel_all_reduce`` then
    ``vllm.ir.ops.fused_add_rms_norm``; norm and residual, or the norm only; eps 1e-5 and 1e-6;
    input and weight of one dtype) and rewrites them into
    ``torch.ops.tpar.vllm_all_reduce_fused_add_rms_norm``, which at run time takes tpar's fused
    op where the TP group's ``ca_comm`` is tpar's and ``should_custom_ar`` says yes, and vLLM's
    own unfused sequence otherwise (or when tpar's call raises). Tested on the CPU with vLLM's
    ``GroupCoordinator`` and IR ops on gloo (tests/python/test_engines_vllm_fusion.py: a traced
    graph and Inductor's own hook); vLLM's ``CudaCommunicator`` and a full ``vllm.LLM`` were not
    run (they need ``vllm.config``'s imports and vLLM's CUDA build).
    Not matched: vLLM's allreduce + ``rms_norm`` without a residual (FlashInfer's pass feeds it
    a zero residual; through tpar's op the allreduce output would lose a -0.0 sign), the Gemma
    variants (an fp32 gamma beside 16-bit activations) and the FP8/NVFP4 quantising variants.
  - SGLang ``GroupCoordinator.fused_allreduce_rmsnorm(input_, residual, weight, eps)``
    (``parallel_state.py``; ``communication_op.tensor_model_parallel_fused_allreduce_rmsnorm``
    calls it on the tp group) asks its custom allreduce for ``fused_allreduce_rmsnorm`` first
    ("communicator-native fused API"), inside a try/except, and takes a None as "not here".
    :meth:`TparCustomAllreduce.fused_allreduce_rmsnorm` answers it: new ``(norm_out,
    residual_out)`` tensors through ``tpar.ops.fused_add_rms_norm``, None where
    ``should_custom_ar`` says False or the operands do not fit (e.g. Gemma's fp32 gamma).
    tests/python/test_engines_sglang.py runs SGLang's own method on a gloo group. In 0.5.23
    SGLang's layers call that entry only on ROCm builds (``layernorm._forward_with_allreduce_fusion``
    takes it under ``_use_aiter``, and the per-group FP8 variants).
  - SGLang on CUDA, through the same plugin (:mod:`tpar.engines.sglang_fusion`, which writes
    down SGLang's call sequence): ``_forward_with_allreduce_fusion`` calls FlashInfer's
    ``flashinfer_allreduce_residual_rmsnorm`` (``layers/flashinfer_comm_fusion.py``, looked up at
    call time), and the layer boundary offers that fusion only where
    ``flashinfer_ar_fusion_applies`` holds (``layer_boundary/residual/add_norm.py``: SM90 or
    SM100, FlashInfer importable, the ``--flashinfer-allreduce-fusion-backend`` flag set, no DP
    attention). The plugin wraps both when SGLang imports them: the gate also holds where the
    TP group's custom allreduce is tpar's, and the entry runs tpar's fused op where the group it
    reduces over is tpar's and tpar takes the operands, SGLang's own answer otherwise.
    tests/python/test_engines_sglang_fusion.py runs it with SGLang's plugin loader,
    ``GroupCoordinator`` and ``flashinfer_comm_fusion`` and the source of the layer functions on
    a gloo group; scripts/gpu_sglang_fusion.py on a GPU. A full SGLang server was not run.

Not covered, and why
  - SGLang's CuTe DSL fusion (``--flashinfer-allreduce-fusion-backend cutedsl``, Blackwell:
    ``layer_boundary/fusions/cutedsl.py``) and the per-model ``CustomAllReduceFusion``
    (``layer_boundary/fusions/custom_all_reduce_fusion.py``, MiniMax-M3 and DeepSeek-V4 only)
    are built on FlashInfer's or SGLang's own ``CustomAllReduceV2`` buffers, not on the
    custom-allreduce object or the entry tpar wraps; SGLang's FP8-quantising fused variants
    (aiter only) and Gemma's fp32 gamma beside 16-bit activations stay SGLang's.
  - vLLM without tpar's pass switched on, or run eagerly (``enforce_eager``, ``-O0``: no
    Inductor passes): the allreduce goes to tpar and the norm stays vLLM's kernel. vLLM's own
    ``AllReduceFusionPass``, where FlashInfer is present and ``fuse_allreduce_rms`` is on, runs
    first and rewrites the pairs to FlashInfer before tpar's pass sees them. The eager helper
    ``model_executor/layers/fused_allreduce_gemma_rms_norm.py`` calls FlashInfer or AITER
    directly.
  - So on CUDA: in vLLM with tpar's pass and in SGLang, the pair is one tpar op; in vLLM
    without the pass, the allreduce runs on tpar and the norm stays vLLM's own kernel.
"""

from __future__ import annotations

from .contract import DEFAULT_MAX_SIZE, TparCustomAllreduce, enabled, group_vote

__all__ = ["DEFAULT_MAX_SIZE", "TparCustomAllreduce", "enabled", "group_vote"]
