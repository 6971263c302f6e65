"""hicache-core: move KV cache between a GPU KV pool and a host KV pool, in any layout.

The core names no layout.  Layouts and strategies come from plugins found
through the ``hicache`` entry-point group; see :mod:`hicache_core.hookspecs`.
"""

from __future__ import annotations

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .hookspecs import hookimpl
from .layout import Addressing, BufferSpec, HostPlan, Layout, Segment
from .pool import HostKVPool
from .registry import Registry, create_registry, default_registry, reset_default_registry
from .spec import MHA, MLA, Component, LayerMap, Part, PoolSpec, shard_range
from .strategy import ANY_LAYOUT, OPERATIONS, DirectionalStrategy, Strategy, StrategyInfo
from .binding import BoundSegment, PoolBinding

__version__ = "0.1.0"

__all__ = [
    "Addressing", "BufferSpec", "HostPlan", "Layout", "Segment",
    "HostKVPool",
    "Registry", "create_registry", "default_registry", "reset_default_registry",
    "MHA", "MLA", "Component", "LayerMap", "Part", "PoolSpec", "shard_range",
    "ANY_LAYOUT", "OPERATIONS", "DirectionalStrategy", "Strategy", "StrategyInfo",
    "BoundSegment", "PoolBinding", "hookimpl", "__version__",
] + list(_errors_all)
