"""The core's own plugin: generic ``reference``, ``direct`` and ``auto`` strategies for any layout.

Registered through the ``hicache`` entry-point group like every other plugin.
"""

from __future__ import annotations

from typing import Callable

from .hookspecs import hookimpl
from .strategy import ANY_LAYOUT, Strategy, StrategyInfo

__all__ = ["hicache_register_strategies"]


def _reference() -> Strategy:
    from .backends.reference import ReferenceStrategy

    return ReferenceStrategy()


def _direct(**options: object) -> Strategy:
    from .backends.direct import DirectStrategy

    return DirectStrategy(**options)  # type: ignore[arg-type]


def _auto(**options: object) -> Strategy:
    from .backends.auto import AutoStrategy

    return AutoStrategy(**options)  # type: ignore[arg-type]


@hookimpl
def hicache_register_strategies(register: Callable[[StrategyInfo], None]) -> None:
    register(StrategyInfo("core.reference", "reference", (ANY_LAYOUT,), _reference,
                          description="torch indexing on any device; the oracle"))
    register(StrategyInfo("core.direct", "direct", (ANY_LAYOUT,), _direct,
                          description="copy-engine copies over coalesced runs derived from layout strides"))
    register(StrategyInfo("core.auto", "auto", (ANY_LAYOUT,), _auto,
                          description="copy engine where its blocks reach the GPU's calibrated size, else the layout's kernel"))
