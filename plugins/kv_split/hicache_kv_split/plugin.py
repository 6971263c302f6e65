"""Registration only: no Triton import here (the kernel strategy loads lazily)."""

from __future__ import annotations

from typing import Any, Callable

from hicache_core import Layout, Strategy, StrategyInfo, hookimpl

from .layout import LAYOUT


def _kernel(**options: Any) -> Strategy:
    from .strategy import KVSplitKernelStrategy

    return KVSplitKernelStrategy(**options)


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(LAYOUT)


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo(
        "page_first_kv_split.kernel", "kernel", (LAYOUT.name,), _kernel, sharded=(False, True),
        description="Triton zero-copy kernel; MLA latent/rope split and joined in one launch",
    ))
