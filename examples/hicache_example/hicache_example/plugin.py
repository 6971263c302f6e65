"""Registration only: no Triton import, no CUDA initialisation (strategies load when a pool resolves to them)."""

from __future__ import annotations

from typing import Any, Callable

from hicache_core import Layout, Strategy, StrategyInfo, hookimpl

from .layout import LAYOUT

__all__ = ["hicache_register_layouts", "hicache_register_strategies"]


def _kernel(**options: Any) -> Strategy:
    from .kernel import PackedKernel

    return PackedKernel(**options)


def _engine(**options: Any) -> Strategy:
    from .engine import EngineStrategy

    return EngineStrategy(**options)


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(LAYOUT)


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo("example.kernel", "kernel", (LAYOUT.name,), _kernel, (False, True),
                          description="Triton kernel for example_packed"))
    register(StrategyInfo("example.engine", "example_engine", (LAYOUT.name,), _engine, (False, True),
                          description="a vendor engine for example_packed (CPU stand-in)"))
