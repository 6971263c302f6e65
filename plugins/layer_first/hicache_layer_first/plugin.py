"""Registration only: no Triton import here (the strategy module loads when a pool resolves it)."""

from __future__ import annotations

from typing import Any, Callable

from hicache_core import Layout, Strategy, StrategyInfo, hookimpl

from .layout import LAYOUT


def _kernel_strategy(**options: Any) -> Strategy:
    from .strategy import LayerFirstKernelStrategy

    return LayerFirstKernelStrategy(**options)


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(LAYOUT)


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo(
        "layer_first.kernel", "kernel", ("layer_first",), _kernel_strategy, sharded=(False, True),
        description="Triton zero-copy kernel: one launch per row-width group over all selected layers",
    ))
