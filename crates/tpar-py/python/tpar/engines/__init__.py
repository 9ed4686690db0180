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
"""

from __future__ import annotations

from .contract import DEFAULT_MAX_SIZE, TparCustomAllreduce, enabled, group_vote

__all__ = ["DEFAULT_MAX_SIZE", "TparCustomAllreduce", "enabled", "group_vote"]
