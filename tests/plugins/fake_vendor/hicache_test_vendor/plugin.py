"""Registration only: ``fakedma`` for exact (layout, sharded) keys; the strategy module loads lazily."""

from __future__ import annotations

from typing import Callable

from hicache_core import Strategy, StrategyInfo, hookimpl

__all__ = ["IO_BACKEND", "LAYOUTS", "STRATEGY_NAME", "hicache_register_strategies"]

IO_BACKEND = "fakedma"
STRATEGY_NAME = "test_vendor.fakedma"
#: Layouts owned by other distributions (two of ours, one third-party): a vendor
#: backend keys on layout names without depending on the plugins that define them.
LAYOUTS = ("layer_first", "page_first_direct", "page_head")


def _factory() -> Strategy:
    from .strategy import FakeDmaStrategy

    return FakeDmaStrategy()


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo(STRATEGY_NAME, IO_BACKEND, LAYOUTS, _factory, (False, True),
                          description="fake vendor DMA engine (records calls, copies through core.direct)"))
