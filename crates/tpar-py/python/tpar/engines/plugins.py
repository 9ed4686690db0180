"""The engines' plugin entry points, and the start-up hook for engines without plugin groups.

- :func:`vllm_plugin` (entry point group ``vllm.general_plugins``) makes
  ``vllm.distributed.device_communicators.custom_all_reduce.CustomAllreduce`` tpar's class.
- :func:`sglang_plugin` (entry point group ``sglang.srt.plugins``) makes
  ``sglang.srt.distributed.device_communicators.custom_all_reduce.dispatch_custom_allreduce``
  return tpar's class, and routes SGLang's CUDA fused allreduce + residual + RMSNorm entry
  (``sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm``, and the
  gate ``flashinfer_ar_fusion_applies`` that decides whether it is tried) to tpar's fused op
  for the groups tpar serves (:mod:`tpar.engines.sglang_fusion` says how and when).

Both engines import those names inside the communicator's constructor, so replacing the module
attribute before the first group is built is enough. The swap waits until the engine imports
that module (an import hook), so loading the plugin imports nothing of the engine's and a
process that never builds a communicator (vLLM's API server) pays nothing. ``TPAR_ALLREDUCE=0``
leaves the engine alone.

Fallback for engine versions without these plugin groups: the wheel installs
``tpar-engines.pth`` into site-packages; when ``TPAR_ENGINE_HOOK=1`` is in the environment,
Python runs :func:`install_startup_hook` at the start of every interpreter, workers spawned by
the engine included (they inherit the environment), and it installs both swaps.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading

from . import sglang_fusion
from .contract import TparCustomAllreduce, enabled, logger

VLLM_MODULE = "vllm.distributed.device_communicators.custom_all_reduce"
VLLM_SYMBOL = "CustomAllreduce"
SGLANG_MODULE = "sglang.srt.distributed.device_communicators.custom_all_reduce"
SGLANG_SYMBOL = "dispatch_custom_allreduce"

# The engine's own object each swapped name held, by "module.name" (for tests and to undo).
originals: dict = {}

# Static helpers of vLLM's class that other vLLM code calls on the class itself.
_VLLM_CLASS_HELPERS = ("create_shared_buffer", "free_shared_buffer")


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs callbacks on a module right after it is first executed."""

    def __init__(self):
        self.pending: dict = {}
        self.lock = threading.Lock()

    def find_spec(self, fullname, path, target=None):
        with self.lock:
            if fullname not in self.pending:
                return None
            callbacks = self.pending.pop(fullname)
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            if module.__name__ == fullname:
                for callback in callbacks:
                    callback(module)

        # Each source file has a loader object of its own, so shadowing its method is local; a
        # loader that serves several modules (a zip importer) runs each module's callbacks only
        # for that module, whichever of them is imported first.
        loader.exec_module = exec_module
        return spec


_after_import = _AfterImport()


def when_imported(module_name: str, callback) -> None:
    """Calls ``callback(module)`` now if ``module_name`` is imported, else right after it is."""
    module = sys.modules.get(module_name)
    if module is not None:
        callback(module)
        return
    with _after_import.lock:
        _after_import.pending.setdefault(module_name, []).append(callback)
    if _after_import not in sys.meta_path:
        sys.meta_path.insert(0, _after_import)


def _swap_vllm(module) -> None:
    original = getattr(module, VLLM_SYMBOL)
    if getattr(original, "_tpar", False):
        return
    helpers = {
        name: staticmethod(getattr(original, name))
        for name in _VLLM_CLASS_HELPERS
        if hasattr(original, name)
    }
    replacement = type(
        VLLM_SYMBOL,
        (TparCustomAllreduce,),
        {"_tpar": True, "engine_original": original, "__module__": __name__, **helpers},
    )
    originals[f"{module.__name__}.{VLLM_SYMBOL}"] = original
    setattr(module, VLLM_SYMBOL, replacement)
    logger.info(
        "vLLM: %s.%s is tpar's (TPAR_ALLREDUCE=0 keeps vLLM's)", module.__name__, VLLM_SYMBOL
    )


def _swap_sglang(module) -> None:
    original = getattr(module, SGLANG_SYMBOL)
    if getattr(original, "_tpar", False):
        return

    def dispatch_custom_allreduce(group, device, *args, **kwargs):
        """tpar's class for every group SGLang builds a custom allreduce for."""
        return TparCustomAllreduce

    dispatch_custom_allreduce._tpar = True
    dispatch_custom_allreduce.engine_original = original
    originals[f"{module.__name__}.{SGLANG_SYMBOL}"] = original
    setattr(module, SGLANG_SYMBOL, dispatch_custom_allreduce)
    logger.info(
        "SGLang: %s.%s returns tpar's class (TPAR_ALLREDUCE=0 keeps SGLang's)",
        module.__name__,
        SGLANG_SYMBOL,
    )


def vllm_plugin() -> None:
    """Entry point of ``vllm.general_plugins``: tpar takes vLLM's custom allreduce."""
    if enabled():
        when_imported(VLLM_MODULE, _swap_vllm)


def sglang_plugin() -> None:
    """Entry point of ``sglang.srt.plugins``: tpar takes SGLang's custom allreduce and its CUDA
    fused allreduce + residual + RMSNorm entry."""
    if enabled():
        when_imported(SGLANG_MODULE, _swap_sglang)
        sglang_fusion.install(when_imported)


def install_startup_hook() -> None:
    """What ``tpar-engines.pth`` runs at interpreter start-up when TPAR_ENGINE_HOOK=1: both
    swaps, each applied when its engine is imported (vLLM's plugin, if also installed and
    loaded, finds the name already swapped and does nothing)."""
    vllm_plugin()
    sglang_plugin()
