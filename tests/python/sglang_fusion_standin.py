"""SGLang 0.5.23's CUDA fused allreduce + RMSNorm call chain, importable without its CUDA stack.

SGLang's ``layers/layernorm.py``, ``layers/layer_boundary/residual/add_norm.py`` and
``layers/layer_boundary/fusions/allreduce.py`` import transformers, sgl_kernel and most of the
model executor, none of which is installed on the CI machine or the device machine. This module
builds those three modules (under their real names, through an import finder, so tpar's plugin
hooks them as it hooks SGLang's) from the *real source* of the functions on the fused path, cut
out of the pinned wheel's files with ``ast``:

- ``add_norm``: ``FUSE_ALLREDUCE_MAX_BATCH_SIZE`` and ``flashinfer_ar_fusion_applies`` (the gate),
  with the platform flags of a machine where FlashInfer's fusion does not apply
  (``_is_sm90_supported = _is_sm100_supported = False``, no FlashInfer);
- ``fusions.allreduce``: ``fused_ffn_input`` and ``flashinfer_preserves_residual``, which bind
  the gate by name from ``add_norm`` as the real module does (no aiter: a CUDA build);
- ``layernorm``: ``_forward_with_allreduce_fusion`` (no aiter);
- ``sglang.srt.layers.moe.utils``: the three helpers that function and ``resolve_fusion_group``
  use, for a dense model (the MoE output's sum is one allreduce over the TP group).

Everything else those functions touch is SGLang's own module: ``flashinfer_comm_fusion`` (the
fused entry tpar wraps), ``sglang.srt.distributed`` (the allreduce of the unfused fallback),
``runtime_context`` (``get_parallel``) and ``dp_attention``. Used by
tests/python/test_engines_sglang_fusion.py and scripts/gpu_sglang_fusion.py.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import pathlib
import sys

ADD_NORM = "sglang.srt.layers.layer_boundary.residual.add_norm"
FUSIONS_ALLREDUCE = "sglang.srt.layers.layer_boundary.fusions.allreduce"
LAYERNORM = "sglang.srt.layers.layernorm"
MOE_UTILS = "sglang.srt.layers.moe.utils"

_PACKAGES = (
    "sglang.srt.layers.layer_boundary",
    "sglang.srt.layers.layer_boundary.residual",
    "sglang.srt.layers.layer_boundary.fusions",
    "sglang.srt.layers.moe",
)

# module -> (file in sglang/srt, top-level names cut from it, what stands in for its imports)
_MODULES = {
    ADD_NORM: (
        "layers/layer_boundary/residual/add_norm.py",
        ("FUSE_ALLREDUCE_MAX_BATCH_SIZE", "flashinfer_ar_fusion_applies"),
        "import torch\n"
        "from sglang.srt.layers.dp_attention import is_dp_attention_enabled\n"
        "from sglang.srt.layers.flashinfer_comm_fusion import (\n"
        "    is_flashinfer_allreduce_unavailable, uses_cutedsl_ar_fusion)\n"
        "from sglang.srt.runtime_context import get_exec, get_parallel\n"
        "_is_sm90_supported = _is_sm100_supported = False  # a GPU FlashInfer's fusion does not take\n"
        "_is_flashinfer_available = False\n"
        "_use_aiter = False\n"
        "def aiter_ar_fusion_applies(input_tensor, forward_batch):\n"
        "    return False\n",
    ),
    FUSIONS_ALLREDUCE: (
        "layers/layer_boundary/fusions/allreduce.py",
        ("fused_ffn_input", "flashinfer_preserves_residual"),
        "import torch\n"
        "from typing import Optional, Tuple\n"
        f"from {ADD_NORM} import aiter_ar_fusion_applies, flashinfer_ar_fusion_applies\n"
        "from sglang.srt.runtime_context import get_exec, get_parallel\n"
        "ForwardBatch = object\n"
        "_use_aiter = False\n",
    ),
    LAYERNORM: (
        "layers/layernorm.py",
        ("_forward_with_allreduce_fusion",),
        "import torch\n"
        "from typing import Optional, Tuple, Union\n"
        "from sglang.srt.runtime_context import get_exec, get_parallel\n"
        "_use_aiter = False\n",
    ),
    MOE_UTILS: (
        None,
        (),
        "from sglang.srt.runtime_context import get_parallel\n"
        "def can_merge_post_experts_all_reduce():\n"
        "    return True\n"
        "def post_experts_reduction_group():\n"
        "    return get_parallel().tp_group\n"
        "def deferred_post_experts_all_reduce(x):\n"
        "    return get_parallel().tp_group.all_reduce(x)\n",
    ),
}


def cut(path: pathlib.Path, names) -> str:
    """The source of the top-level functions and assignments ``names`` in ``path``, in file order."""
    text = path.read_text()
    found = []
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            name = node.targets[0].id
        else:
            continue
        if name in names:
            found.append(name)
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            found.append("\n".join(text.splitlines()[start - 1 : node.end_lineno]))
    missing = set(names) - set(found[0::2])
    if missing:
        raise LookupError(f"{path} has no top-level {sorted(missing)}: not SGLang 0.5.23's file?")
    return "\n\n".join(found[1::2]) + "\n"


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, srt: pathlib.Path):
        self.srt = srt

    def find_spec(self, fullname, path, target=None):
        if fullname in _PACKAGES or fullname in _MODULES:
            # A loader per module, as the path finder gives each file its own.
            return importlib.machinery.ModuleSpec(
                fullname, _Finder(self.srt), is_package=fullname in _PACKAGES
            )
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        name = module.__name__
        if name in _PACKAGES:
            module.__path__ = []
            return
        relative, names, prelude = _MODULES[name]
        source = prelude + ("\n" + cut(self.srt / relative, names) if relative else "")
        module.__doc__ = (
            f"Stand-in built from SGLang's {relative or '(none)'}: {', '.join(names) or 'helpers'}"
        )
        exec(compile(source, f"<{name} stand-in from {relative}>", "exec"), module.__dict__)


def install(sglang_root) -> None:
    """Makes the stand-in modules importable; ``sglang_root`` holds ``sglang/srt``. Call it
    before tpar's plugin is loaded so that the plugin's import hook (which sits first on
    ``sys.meta_path``) sees these modules executed as it sees SGLang's."""
    srt = pathlib.Path(sglang_root) / "sglang" / "srt"
    if not (srt / "layers" / "layernorm.py").is_file():
        raise FileNotFoundError(f"no SGLang sources under {sglang_root}")
    sys.meta_path.insert(0, _Finder(srt))


class RMSNormStandIn:
    """SGLang's ``RMSNorm`` as ``_forward_with_allreduce_fusion`` uses it: ``variance_epsilon``,
    ``weight``, ``forward(x, residual, None)`` with sgl_kernel's in-place ``fused_add_rmsnorm``
    semantics in torch (residual += x rounded to the dtype; x = rmsnorm(residual) * weight), and
    ``forward_with_allreduce_fusion`` exactly as SGLang's class defines it."""

    def __init__(self, weight, eps):
        self.weight = weight
        self.variance_epsilon = eps
        self.forward_calls = 0

    def forward(self, x, residual=None, post_residual_addition=None):
        import torch

        self.forward_calls += 1
        assert post_residual_addition is None
        summed = (x.float() + residual.float()).to(x.dtype)
        residual.copy_(summed)
        v = summed.float()
        y = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        x.copy_((y * self.weight.float()).to(x.dtype))
        return x, residual

    def forward_with_allreduce_fusion(
        self, x, residual=None, post_residual_addition=None, use_attn_tp_group=True
    ):
        layernorm = sys.modules[LAYERNORM]
        return layernorm._forward_with_allreduce_fusion(
            self, x, residual, post_residual_addition, self.weight, use_attn_tp_group
        )


class PlanStandIn:
    """The layer boundary's plan as ``fused_ffn_input`` reads it: ``plan.norm``."""

    def __init__(self, norm):
        self.norm = norm
