"""Registration only: the layout descriptor.  ``reference`` and ``direct`` serve it unchanged."""

from __future__ import annotations

from typing import Callable

from hicache_core import Layout, hookimpl

from .layout import LAYOUT


@hookimpl
def hicache_register_layouts(register: Callable[[Layout], None]) -> None:
    register(LAYOUT)
