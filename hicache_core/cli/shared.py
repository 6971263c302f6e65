"""What the ``hicache`` subcommands share: the registry a command builds, the representative pools, the usage error,
what an installation lacks, and the text helpers (tables, footnotes, counts).

Every command gets its registry as ``shared._registry()``, looked up in this module at each call, so that replacing
``_registry`` here (a test) reaches every command.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Sequence

import torch

from ..kernel_support import interpreting
from ..registry import ENV_ALLOW, ENV_BLOCK, Registry, create_registry
from ..spec import MHA, MLA, LayerMap, PoolSpec

KINDS = (MHA, MLA)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.uint8}
INSTALL_LAYOUTS = ("install a layout plugin from the hicache source tree (e.g. pip install ./plugins/layer_first "
                   "./plugins/page_first ./plugins/kv_split)")
NO_LAYOUT = f"no layout is installed: hicache-core alone gives generic backends and no layouts; {INSTALL_LAYOUTS}"
INTERPRET_EXTRA = "pip install 'hicache-core[interpret]'"
#: Layers of every representative pool; the sharded one is rank 1 of 2 (layers 2-3).
LAYERS = 4


class UsageError(Exception):
    """A name or value the user passed that cannot be used; printed as ``hicache <cmd>: <message>``, exit 2."""


def _registry() -> Registry:
    """A fresh registry from the environment: what every command works on."""
    return create_registry()


def install_problems(reg: Registry) -> list[str]:
    """What no cell of verify can show: each plugin that failed to load (it registered nothing) and each layout,
    strategy name or key registered twice (disabled). Either fails ``verify`` and ``plugins`` (exit 1)."""
    lines = [f"plugin {p.name} ({p.label}) is BROKEN and registered nothing: {p.error}" for p in reg.plugins if p.error]
    return lines + [f"DISABLED: {c.message}" for c in reg.conflicts]


def no_layout(reg: Registry) -> str:
    """Why ``reg`` has no layout, and the fix: the installed ones left out by ``HICACHE_PLUGINS`` /
    ``HICACHE_DISABLE_PLUGINS``, none installed, and (either way) each plugin that failed to load or name that two
    plugins registered (:func:`install_problems`: a layout plugin among them registered nothing)."""
    problems = install_problems(reg)
    if reg.skipped:
        text = (f"no layout is loaded: {ENV_ALLOW}/{ENV_BLOCK} left out the installed plugins "
                f"{sorted(set(reg.skipped))}; unset them, or allow the plugins of the layouts you want")
        return text + "".join(f"; also: {p}" for p in problems)
    if problems:  # a layout plugin may be among them: "none is installed" may not be true
        return f"no layout is loaded: {'; '.join(problems)}; mend that, or where no layout plugin is installed, " + \
            INSTALL_LAYOUTS
    return NO_LAYOUT


def _interpreter_problem() -> str | None:
    """Why kernel cells cannot run in Triton's interpreter although ``TRITON_INTERPRET=1``, or ``None``."""
    if interpreting() and importlib.util.find_spec("numpy") is None:
        return f"TRITON_INTERPRET=1 needs numpy, which is not installed: {INTERPRET_EXTRA}"
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- pools -------------------------------------------------------------------------
def _layer_map(sharded: bool, layers: int = LAYERS) -> LayerMap:
    """The layer map of the CLI's pools: ``layers`` layers, sharded as rank 1 of 2 where ``sharded``."""
    return LayerMap.sharded_cp(layers, 2, 1) if sharded else LayerMap.unsharded(layers)


def representative_spec(
    kind: str, sharded: bool, device: torch.device | str = "cpu", *, dtype: torch.dtype | None = None,
    page_size: int = 16, tokens: int = 64, medium: bool = False,
) -> PoolSpec:
    """The pool a matrix cell is resolved (and verified) on.

    MHA: 4 layers, 2 heads x 8 (``medium``: 8 heads x 128), fp16.  MLA: 4 layers,
    512 + 64, bf16.  Sharded: ``LayerMap.sharded_cp(4, 2, 1)``.  ``tokens`` is
    rounded up to whole pages.
    """
    lmap = _layer_map(sharded)
    capacity = max(1, -(-tokens // page_size)) * page_size
    if kind == MHA:
        heads, dim = (8, 128) if medium else (2, 8)
        return PoolSpec.mha(layer_map=lmap, head_num=heads, head_dim=dim, dtype=dtype or torch.float16,
                            page_size=page_size, capacity=capacity, device=device)
    if kind == MLA:
        return PoolSpec.mla(layer_map=lmap, kv_lora_rank=512, qk_rope_head_dim=64, dtype=dtype or torch.bfloat16,
                            page_size=page_size, capacity=capacity, device=device)
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _no_cuda_note(device: torch.device | str) -> str:
    """A note for tables computed for a CUDA device on a machine without one ('' otherwise)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        return ("CUDA is not available on this machine, so none of this can run here, and what needs the CUDA runtime "
                "(the copy engine: direct, auto's copy-engine picks) shows as unavailable where a GPU machine serves "
                "it: run this on the GPU machine for its real picture")
    return ""


# -- text --------------------------------------------------------------------------
def _n(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _yn(b: bool) -> str:
    return "yes" if b else "no"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


class _Notes:
    """Numbered footnotes, one per distinct text, in first-use order."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f"[{self.texts.index(text) + 1}]"

    def lines(self) -> list[str]:
        return [f"[{i}] {t}" for i, t in enumerate(self.texts, 1)]
