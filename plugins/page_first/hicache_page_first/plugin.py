"""Registration only: no Triton import here (strategy factories import lazily)."""

from __future__ import annotations

from typing import Any, Callable

from hicache_core import Layout, Strategy, StrategyInfo, hookimpl

from .layout import PAGE_FIRST, PAGE_FIRST_DIRECT


def _page_first_kernel(**options: Any) -> Strategy:
    from .strategy import PageFirstKernelStrategy

    return PageFirstKernelStrategy(**options)


def _page_first_direct_kernel(**options: Any) -> Strategy:
    from .strategy import PageFirstDirectKernelStrategy

    return PageFirstDirectKernelStrategy(**options)


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(PAGE_FIRST)
    register(PAGE_FIRST_DIRECT)


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo("page_first.kernel", "kernel", ("page_first",), _page_first_kernel, sharded=(False, True),
                          description="Triton zero-copy kernel; token tiles x all layers per program"))
    register(StrategyInfo("page_first_direct.kernel", "kernel", ("page_first_direct",), _page_first_direct_kernel,
                          sharded=(False, True), description="Triton zero-copy kernel; one (page, layer) block per work item"))
